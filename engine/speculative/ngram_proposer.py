"""Prompt lookup: a sequence's next tokens proposed from where its latest n-gram last occurred.

Per sequence an index maps each n-gram (prompt_lookup_min <= n <= prompt_lookup_max) to the
latest position where it ended, among positions that have a following token. It grows with
the sequence, max - min + 1 entries per token, so a proposal is a few dict lookups, never a
scan of the history.

What followed the occurrence runs up to the sequence's end, which for a recent one is soon:
past it the proposal goes on copying itself (the match says the sequence repeats with the
period from that occurrence to the end), so a loop of a few tokens, or a run of one,
proposes num_tokens tokens rather than the few before the end.
"""

from __future__ import annotations


class NgramIndex:
    def __init__(self, min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n
        self._last_end: dict[tuple[int, ...], int] = {}
        self._num_indexed = 0  # positions whose ending n-grams are in the index

    def update(self, token_ids: list[int]) -> None:
        """Index every position but the last (its successor is not known yet): a lookup of the
        sequence's own suffix then finds an earlier occurrence, never itself."""
        for end in range(self._num_indexed, len(token_ids) - 1):
            for n in range(self.min_n, min(self.max_n, end + 1) + 1):
                self._last_end[tuple(token_ids[end - n + 1 : end + 1])] = end
        self._num_indexed = max(self._num_indexed, len(token_ids) - 1)

    def propose(self, token_ids: list[int], num_tokens: int) -> list[int]:
        """num_tokens tokens that followed the longest suffix of token_ids found earlier in it
        (its latest occurrence), repeating with its period past the end; [] where none of
        min_n..max_n tokens recurs."""
        self.update(token_ids)
        for n in range(min(self.max_n, len(token_ids) - 1), self.min_n - 1, -1):
            end = self._last_end.get(tuple(token_ids[-n:]))
            if end is not None:
                follow = token_ids[end + 1 :]
                return [follow[i % len(follow)] for i in range(num_tokens)]
        return []
