"""One step's token bitmask for the rows whose requests are constrained (structured outputs).

Each constrained sequence's grammar state (engine/sampling/grammar.py) fills its row of a
packed bitmask (one bit per vocabulary entry: may this token come next?), and the sampler
sets every other token's logit to -inf in those rows before penalties, temperature and the
draw, so greedy and sampled rows alike only ever draw a token the grammar allows. Free rows
are not touched. The state moves on as each sampled token is appended
(Sequence.append_token), and only then: a sequence preempted by recompute keeps its tokens
and its state, so prefilling them again (as a prefix-cache hit or in chunks) samples
nothing and moves nothing.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from engine.core.sequence import Sequence


@dataclass
class GrammarMask:
    rows: list[int]  # the batch's constrained rows
    bitmask: torch.Tensor  # [S, ceil(V / 32)] int32 on the CPU; the free rows' all allowed, unread
    seconds: float  # filling it and, once applied, applying it: the step's mask time

    @classmethod
    def of(cls, seqs: list[Sequence], vocab_size: int) -> GrammarMask | None:
        """None when no row is constrained: the sampler then skips this work."""
        rows = [row for row, seq in enumerate(seqs) if seq.grammar is not None]
        if not rows:
            return None
        import xgrammar as xgr  # loaded already: the constraint was compiled (engine/sampling/grammar.py)

        started = time.perf_counter()
        bitmask = xgr.allocate_token_bitmask(len(seqs), vocab_size)
        for row in rows:
            fill(seqs[row], bitmask, row)
        return cls(rows, bitmask, time.perf_counter() - started)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """A masked copy in float32: the raw logits stay intact for logprobs."""
        import xgrammar as xgr

        started = time.perf_counter()
        masked = logits.float()
        masked = masked.clone() if masked is logits else masked
        xgr.apply_token_bitmask_inplace(masked, self.bitmask.to(masked.device), indices=self.rows)
        self.seconds += time.perf_counter() - started
        return masked


def fill(seq: Sequence, bitmask: torch.Tensor, row: int) -> None:
    """seq's row of the bitmask; where its grammar cannot fill it, the failure is the
    sequence's alone (the step's postprocess ends it), and its row stays all allowed."""
    try:
        seq.grammar.fill(bitmask, row)
    except Exception as exc:  # noqa: BLE001 - one request's grammar fails it alone, never the step
        seq.failure = exc
        bitmask[row] = -1
