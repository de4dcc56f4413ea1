"""How many chunks a second an engine replica streams to the ingress, across all its streams.

Past the budget the engine packs several tokens into a chunk (engine/frontend/request_stream.py): k
tokens a chunk, k the smallest count that keeps all streams under the budget at the current
step rate, and never for a stream's first token. Relaying a chunk costs about the same CPU
whatever it holds (the engine replica sends it, the ingress renders it, the proxy writes
it), so the budget that leaves the engine its cores scales with the node's CPUs: `auto` is
CHUNKS_PER_S_PER_CPU for each CPU this process may run on. It trades how often a stream
hears from the server (a few times a second under load) for the engine's tokens a second; a
stream alone, whose steps come slower than the budget, still gets every token as it comes.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from engine.kernels.cpu import usable_cpus

CHUNKS_PER_S_PER_CPU = 50.0

# What AppArgs.max_chunks_per_s takes: chunks a second, auto, or None for no budget (a chunk
# for every token).
ChunkBudget = Annotated[float, Field(gt=0)] | Literal["auto"] | None


def resolve(budget: ChunkBudget) -> float | None:
    """Chunks a second for the engine: `auto` from this process's CPUs, else as given."""
    return CHUNKS_PER_S_PER_CPU * usable_cpus() if budget == "auto" else budget
