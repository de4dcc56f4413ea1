"""Log-probabilities of the model's own distribution.

Every logprob the engine reports is log_softmax of the model's raw logits in float32,
before any penalty, logit bias, min_tokens mask, temperature or filter changes them
(vLLM's "raw_logprobs" mode): what the model thinks of the token, whatever the request's
sampling controls did to choose it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from engine.request.token_logprob import TokenLogprob

if TYPE_CHECKING:
    from engine.core.sequence import Sequence


def token_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, num_top: list[int]) -> list[TokenLogprob]:
    """logits: float32 [R, V] raw; token_ids: [R] the token at each row; num_top: k per row.

    One logsumexp per row, then gathers: x - logsumexp(x) is log_softmax(x) without
    materialising the [R, V] result.
    """
    lse = torch.logsumexp(logits, dim=-1, keepdim=True)
    chosen = (logits.gather(1, token_ids.view(-1, 1)) - lse).squeeze(1).tolist()
    k = max(num_top, default=0)
    if k == 0:
        return [TokenLogprob(t, lp) for t, lp in zip(token_ids.tolist(), chosen)]
    top_values, top_ids = logits.topk(k, dim=-1)
    top_values, top_ids = (top_values - lse).tolist(), top_ids.tolist()
    return [
        TokenLogprob(t, lp, tuple(zip(ids[:n], values[:n])))
        for t, lp, ids, values, n in zip(token_ids.tolist(), chosen, top_ids, top_values, num_top)
    ]


@dataclass
class PromptScoring:
    """Prompt positions whose logprobs this step computes: position p's logits score token
    p + 1. The last prompt position scores no prompt token (it samples the first output)."""

    seqs: list[Sequence]
    counts: list[int]  # positions per sequence
    flat_indices: list[int]  # into the step's flat tokens
    targets: list[int]  # the prompt token each position scores
    num_top: list[int]

    @classmethod
    def of(cls, seqs: list[Sequence], num_new: list[int]) -> PromptScoring | None:
        scoring = cls([], [], [], [], [])
        offset = 0
        for seq, n in zip(seqs, num_new):
            if seq.needs_prompt_logprobs:
                scoring._add(seq, offset, n)
            offset += n
        return scoring if scoring.flat_indices else None

    def _add(self, seq: Sequence, offset: int, num_new: int) -> None:
        start = seq.num_computed_tokens
        # A recomputation after preemption skips the positions already scored.
        first, end = max(start + 1, len(seq.prompt_logprobs)), min(start + num_new + 1, seq.num_prompt_tokens)
        if first >= end:
            return
        self.seqs.append(seq)
        self.counts.append(end - first)
        self.flat_indices += range(offset + first - 1 - start, offset + end - 1 - start)
        self.targets += seq.token_ids[first:end]
        self.num_top += [seq.params.prompt_logprobs] * (end - first)

    def logprobs(self, logits: torch.Tensor, device: torch.device) -> list[tuple[Sequence, list[TokenLogprob]]]:
        computed = token_logprobs(logits, torch.tensor(self.targets, device=device), self.num_top)
        out, start = [], 0
        for seq, count in zip(self.seqs, self.counts):
            out.append((seq, computed[start : start + count]))
            start += count
        return out
