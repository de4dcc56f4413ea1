"""Which running decodes propose tokens this step, and how many; their counters.

A sequence speculates only where every verified row samples exactly as its own decode step
would. Not, therefore, where a row's sampling depends on the proposals before it: a grammar
(its mask follows the state after each token), presence, frequency or repetition penalties
(the counts of the tokens before), min_tokens not yet reached (the stop tokens' ban ends at
a given output length). Nor where it asks for logprobs, which are computed one row per step.
Plain greedy and temperature / top-k / top-p / min-p sampling, logit_bias and stop
conditions all speculate.

Proposing must never cost a step more than it wins: a sequence whose proposals all failed
stops proposing for a number of steps that doubles with each failure in a row
(MAX_BACK_OFF_STEPS at most), and a step takes proposals only up to max_step_rows rows
(SpeculativeConfig), since past that a step's time grows with its rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine.speculative.config import SpeculativeConfig
from engine.speculative.ngram_proposer import NgramIndex

if TYPE_CHECKING:
    from engine.core.sequence import Sequence

MAX_BACK_OFF_STEPS = 32


@dataclass
class DraftState:
    """One sequence's proposer: its n-gram index and its back-off."""

    index: NgramIndex
    num_failures: int = 0  # verified steps in a row that kept no proposal
    num_skipped_left: int = 0  # steps still to go without proposing


def can_speculate(seq: Sequence) -> bool:
    params = seq.params
    return (seq.grammar is None and params.logprobs is None and not params.has_penalties
            and seq.num_output_tokens >= params.min_tokens)


class Speculator:
    def __init__(self, config: SpeculativeConfig, max_model_len: int):
        self.config = config
        self.max_model_len = max_model_len
        self.num_proposed_tokens = 0  # totals since start: verified proposals, and those kept
        self.num_accepted_tokens = 0

    def row_budget(self, num_decodes: int) -> int:
        """Proposals a step with num_decodes decodes may take, all sequences together."""
        return max(self.config.max_step_rows - num_decodes, 0)

    def propose(self, seq: Sequence, max_tokens: int) -> list[int]:
        """Tokens for seq (a decode: one token left to compute) to verify this step, up to
        max_tokens and what is left of its max_tokens and of the model's context."""
        room = min(max_tokens, self.config.num_speculative_tokens, self._room(seq))
        if room < 1 or not can_speculate(seq):
            return []
        state = self._state(seq)
        if state.num_skipped_left > 0:
            state.num_skipped_left -= 1
            return []
        return state.index.propose(seq.token_ids, room)

    def record(self, seq: Sequence, num_proposed: int, num_accepted: int) -> None:
        """A verified step's result: counters, and the sequence's back-off."""
        self.num_proposed_tokens += num_proposed
        self.num_accepted_tokens += num_accepted
        state = self._state(seq)
        if num_accepted:
            state.num_failures = 0
            return
        state.num_failures += 1
        state.num_skipped_left = min(2 ** state.num_failures - 1, MAX_BACK_OFF_STEPS)

    def _room(self, seq: Sequence) -> int:
        """Proposals that still leave room for the token drawn after them."""
        return min(seq.params.max_tokens - seq.num_output_tokens, self.max_model_len - seq.num_tokens) - 1

    def _state(self, seq: Sequence) -> DraftState:
        if seq.draft_state is None:
            seq.draft_state = DraftState(NgramIndex(self.config.prompt_lookup_min, self.config.prompt_lookup_max))
        return seq.draft_state
