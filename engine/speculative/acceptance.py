"""Which proposed tokens a sequence keeps: the speculative-sampling rule for one-hot drafts.

The target draws a token at every verified row as it would without speculation (the
sampler's own draw, greedy or sampled). Proposals are kept while each equals the draw at its
row; the first draw that differs, or the draw after the last proposal, is appended as well.

This is the standard acceptance rule (accept proposal t with probability min(1, p(t)/q(t)),
else draw from the normalised max(0, p - q)) for an n-gram proposer, whose q is one-hot
at t: a draw x ~ p equals t with probability p(t), and where it does not, x is distributed as
p with t removed, renormalised. So the output's distribution is exactly the target's.

A seeded request draws one uniform per verified row from its own generator; rewinding it to
one draw per appended token leaves the generator where it would be without speculation, and
the same seed gives the same tokens with speculation or without.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def accepted_tokens(drafts: list[int], targets: list[int]) -> list[int]:
    """The tokens a sequence appends: targets (one per verified row, len(drafts) + 1) up to
    and including the first that differs from its row's proposal."""
    num_accepted = 0
    while num_accepted < len(drafts) and drafts[num_accepted] == targets[num_accepted]:
        num_accepted += 1
    return targets[: num_accepted + 1]


def rewind(generator: torch.Generator, state: torch.Tensor, num_draws: int,
           draw: Callable[[torch.Generator], object]) -> None:
    """The generator as if only num_draws of the sampler's draws had been made from `state`."""
    generator.set_state(state)
    for _ in range(num_draws):
        draw(generator)
