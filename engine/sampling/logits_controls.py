"""Per-request changes to the logits before temperature: logit_bias, min_tokens and the
presence, frequency and repetition penalties, batched over the rows that use them.

Applied in vLLM's order: logit_bias is added, tokens that would end the sequence before
min_tokens are masked to -inf, then the penalties (as SamplingParams defines them). Greedy
rows take the argmax of the result. Rows that use none of these are not touched, and a
batch where no row uses any skips this module altogether.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from engine.core.sequence import Sequence


class TokenCounts:
    """One sequence's token counts for its penalties, kept on the device and updated one
    token at a time, so a step never rebuilds them from the sequence's whole history."""

    def __init__(self, prompt_token_ids: list[int], output_token_ids: list[int], vocab_size: int, device: torch.device):
        self.output = torch.zeros(vocab_size, dtype=torch.float32, device=device)
        self.output.index_add_(0, _ids(output_token_ids, device), torch.ones(len(output_token_ids), device=device))
        self.in_prompt = torch.zeros(vocab_size, dtype=torch.bool, device=device)
        self.in_prompt[_ids(prompt_token_ids, device)] = True

    def add(self, token_id: int) -> None:
        self.output[token_id] += 1


@dataclass
class Penalties:
    """The penalised rows' parameters and token counts, stacked: [R] and [R, V]."""

    rows: torch.Tensor
    presence: torch.Tensor
    frequency: torch.Tensor
    repetition: torch.Tensor | None  # None when every row's is 1
    output_counts: torch.Tensor
    in_prompt: torch.Tensor | None

    def apply(self, logits: torch.Tensor) -> None:
        """In place on logits' rows."""
        sub = logits[self.rows]
        seen = self.output_counts > 0
        if self.repetition is not None:
            r = self.repetition.unsqueeze(1)
            sub = torch.where(seen | self.in_prompt, torch.where(sub > 0, sub / r, sub * r), sub)
        sub -= self.frequency.unsqueeze(1) * self.output_counts + self.presence.unsqueeze(1) * seen
        logits[self.rows] = sub


@dataclass
class LogitsControls:
    bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None  # rows, token ids, biases
    banned: tuple[torch.Tensor, torch.Tensor] | None  # rows, token ids: -inf (min_tokens)
    penalties: Penalties | None

    @classmethod
    def from_seqs(cls, seqs: list[Sequence], vocab_size: int, device: torch.device) -> LogitsControls | None:
        """None when no row uses any control: the sampler then skips this work."""
        if not any(s.params.has_logit_controls for s in seqs):
            return None
        return cls(_bias(seqs, device), _banned(seqs, device), _penalties(seqs, vocab_size, device))

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """A changed copy: the raw logits stay intact for logprobs."""
        logits = logits.clone()
        if self.bias is not None:
            rows, token_ids, biases = self.bias
            logits.index_put_((rows, token_ids), biases, accumulate=True)
        if self.banned is not None:
            logits[self.banned] = float("-inf")
        if self.penalties is not None:
            self.penalties.apply(logits)
        return logits


def _bias(seqs: list[Sequence], device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    rows: list[int] = []
    token_ids: list[int] = []
    biases: list[float] = []
    for row, seq in enumerate(seqs):
        if seq.params.logit_bias:
            ids, values = seq.params.logit_bias_items
            rows += [row] * len(ids)
            token_ids += ids
            biases += values
    if not rows:
        return None
    return _ids(rows, device), _ids(token_ids, device), torch.tensor(biases, dtype=torch.float32, device=device)


def _banned(seqs: list[Sequence], device: torch.device) -> tuple[torch.Tensor, torch.Tensor] | None:
    rows: list[int] = []
    token_ids: list[int] = []
    for row, seq in enumerate(seqs):
        if seq.num_output_tokens < seq.params.min_tokens and seq.stop_token_ids:
            rows += [row] * len(seq.stop_token_ids)
            token_ids += seq.stop_token_ids
    return (_ids(rows, device), _ids(token_ids, device)) if rows else None


def _penalties(seqs: list[Sequence], vocab_size: int, device: torch.device) -> Penalties | None:
    rows = [row for row, seq in enumerate(seqs) if seq.params.has_penalties]
    if not rows:
        return None
    penalised = [seqs[row] for row in rows]
    counts = [_counts(seq, vocab_size, device) for seq in penalised]
    params = [seq.params for seq in penalised]
    has_repetition = any(p.repetition_penalty != 1 for p in params)
    return Penalties(
        rows=_ids(rows, device),
        presence=_floats([p.presence_penalty for p in params], device),
        frequency=_floats([p.frequency_penalty for p in params], device),
        repetition=_floats([p.repetition_penalty for p in params], device) if has_repetition else None,
        output_counts=torch.stack([c.output for c in counts]),
        in_prompt=torch.stack([c.in_prompt for c in counts]) if has_repetition else None,
    )


def _counts(seq: Sequence, vocab_size: int, device: torch.device) -> TokenCounts:
    if seq.token_counts is None:  # first step that needs them; Sequence.append_token keeps them
        seq.token_counts = TokenCounts(seq.token_ids[: seq.num_prompt_tokens], seq.output_token_ids, vocab_size, device)
    return seq.token_counts


def _ids(values: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64, device=device)


def _floats(values: list[float], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32, device=device)
