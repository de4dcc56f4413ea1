"""Incremental, UTF-8-safe detokenization with stop strings. Depends only on a tokenizer,
so the offline engine and the HTTP ingress share it."""

from __future__ import annotations

import codecs
from collections.abc import Sequence
from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase


@dataclass(frozen=True, slots=True)
class TokenVocab:
    token_bytes: tuple[bytes, ...]  # indexed by token id
    special_ids: frozenset[int]

    @property
    def vocab_size(self) -> int:
        return len(self.token_bytes)

    @classmethod
    def from_tokenizer(cls, tokenizer: PreTrainedTokenizerBase) -> TokenVocab:
        tokens = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
        # Byte-level BPE tokens spell bytes as printable characters; translate maps them back.
        to_latin1 = {ord(char): byte for byte, char in bytes_to_unicode().items()}
        token_bytes = [_token_to_bytes(token, to_latin1) for token in tokens]
        # Added tokens are stored as plain text, not byte-level spelled.
        for token_id, added in tokenizer.added_tokens_decoder.items():
            if token_id < len(token_bytes):
                token_bytes[token_id] = added.content.encode("utf-8")
        return cls(tuple(token_bytes), frozenset(tokenizer.all_special_ids))


@dataclass(frozen=True, slots=True)
class DetokenizedDelta:
    text: str  # new text safe to emit; never includes (part of) a matched stop string
    stopped: bool  # a stop string matched; later pushes return no text
    num_tokens: int  # pushed ids that belong to the output (through the one completing a stop)


class IncrementalDetokenizer:
    """Turns token ids into text as they arrive.

    Invariant without stop strings: the concatenated deltas plus finish() equal
    tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False).
    """

    def __init__(self, vocab: TokenVocab, stop: Sequence[str] = ()) -> None:
        self._vocab = vocab
        self._stop = tuple(s for s in stop if s)
        self._max_held = max((len(s) for s in self._stop), default=1) - 1
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._held = ""  # decoded text not yet emitted: a suffix that may start a stop string
        self.is_stopped = False
        self.stop_str = ""  # the stop string that matched, once stopped

    def push(self, token_ids: Sequence[int]) -> DetokenizedDelta:
        if self.is_stopped:
            return DetokenizedDelta("", True, 0)
        pieces: list[str] = []
        for i, token_id in enumerate(token_ids):
            if token_id in self._vocab.special_ids:
                continue
            pieces.append(self._feed(self._utf8.decode(self._vocab.token_bytes[token_id])))
            if self.is_stopped:
                return DetokenizedDelta("".join(pieces), True, i + 1)
        return DetokenizedDelta("".join(pieces), False, len(token_ids))

    def finish(self) -> str:
        """Flush held-back text; incomplete UTF-8 bytes become U+FFFD."""
        if self.is_stopped:
            return ""
        text = self._feed(self._utf8.decode(b"", final=True))
        if self.is_stopped:
            return text
        held, self._held = self._held, ""
        return text + held

    def _feed(self, text: str) -> str:
        """Returns the text that can be emitted now; sets is_stopped on a match."""
        if not self._stop:
            return text
        # A match ending in `text` starts within `text` or within the held suffix.
        window = self._held + text
        match = _first_match(window, self._stop)
        if match is not None:
            start, self.stop_str = match
            self.is_stopped, self._held = True, ""
            return window[:start]
        num_held = self._num_held(window)
        self._held = window[len(window) - num_held :]
        return window[: len(window) - num_held]

    def _num_held(self, window: str) -> int:
        """Length of the longest suffix of `window` that is a proper prefix of a stop string."""
        for n in range(min(self._max_held, len(window)), 0, -1):
            suffix = window[-n:]
            if any(s.startswith(suffix) for s in self._stop):
                return n
        return 0


def _first_match(text: str, stop: Sequence[str]) -> tuple[int, str] | None:
    """Where the earliest stop string starts, and which one it is."""
    starts = [(i, s) for i, s in ((text.find(s), s) for s in stop) if i >= 0]
    return min(starts) if starts else None


def _token_to_bytes(token: str | None, to_latin1: dict[int, int]) -> bytes:
    if token is None:
        return b""
    try:
        return token.translate(to_latin1).encode("latin-1")
    except UnicodeEncodeError:  # not byte-level spelled
        return token.encode("utf-8")


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte → printable character table (transformers 5.x no longer exports it
    from models.gpt2)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [byte for byte in range(256) if byte not in printable]
    table = {byte: chr(byte) for byte in printable}
    table.update({byte: chr(256 + n) for n, byte in enumerate(others)})
    return table
