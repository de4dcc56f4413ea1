"""One position's logprob, as every output of the engine carries it (engine/sampling/logprobs.py
computes them). Apart from that module so that the processes that only relay outputs (the
Ingress, the tokenizer replicas) don't import torch with it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """One position: the logprob of its token, and the position's most likely tokens."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token id, logprob) of the k most likely, best first
