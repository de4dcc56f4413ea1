"""Torch's CPU threads per engine step: one for steps of at most `one_thread_max_tokens`
tokens, the engine's `cpu_threads` for the rest.

Why: in a server the engine's cores are shared with the path to the client (Ray's proxy,
the ingress, the replica's own event loop and core-worker threads). A decode step of one
row is short, bandwidth-bound work on small matrices; split over two
OpenMP threads, every barrier in it waits whenever the other processes preempt one of
them, and the threads' spinning between steps takes the core those processes need. Over
HTTP one thread wins for a bf16 stream alone, though it is slower offline; in fp32 the
second thread is worth more, as each step moves twice the bytes.
`auto`, the default everywhere, the offline `LLM` included, is measured on the machine
(engine/core/tuner.py), which sets one_thread_max_tokens here once it has. 0 keeps every
step on every thread.

The count is per OS thread (OpenMP's nthreads ICV, which torch.set_num_threads sets for
the calling thread): the step loop's, or a caller's. It is read back before each set rather
than remembered, as it can change under its thread: the first ATen parallel loop in each
library (our kernels, an inductor graph) sets the calling thread's count to the one any
thread set last, which a background compile (engine/model/graph_compile.py) may have.
"""

from __future__ import annotations

import torch


class StepThreads:
    def __init__(self, cpu_threads: int, one_thread_max_tokens: int):
        self.cpu_threads = cpu_threads
        self.one_thread_max_tokens = one_thread_max_tokens

    def for_step(self, num_tokens: int) -> None:
        """Set the calling thread's torch threads for a step of `num_tokens` tokens."""
        if len(self.counts()) == 1:
            return
        self.use(1 if num_tokens <= self.one_thread_max_tokens else self.cpu_threads)

    def counts(self) -> tuple[int, ...]:
        """Every thread count steps run at, the engine's own first."""
        return (self.cpu_threads,) if self.one_thread_max_tokens == 0 or self.cpu_threads == 1 else (self.cpu_threads, 1)

    def use(self, threads: int) -> None:
        """Set the calling thread's torch threads to `threads`."""
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
