"""Decode steps on CUDA replayed from CUDA graphs (`cuda_graphs`), as vLLM's CUDA path runs
them. Eager, a step at a few sequences is mostly Python launching the forward's small
kernels while the GPU idles; a replay launches them all at once.

A graph records fixed shapes and addresses, so the steps are bucketed: one graph per (rows,
block-table width) bucket, captured before the engine serves, all reading the same static
input buffers and writing the same static outputs. A step's inputs are copied into the
buffers and padded to its bucket: a padding row is token 0 at position 0 with no cached
token, so it attends to itself alone (no NaN), and a padding block is block 0, which no
row's context reaches. A graph records engine/model/decode_graph.py's `decode_step`, eager or
compiled by inductor (compile_decode): the pools read in place, every row's logits, greedy
token and new k, v out. The real rows' k, v are written to the pool after the replay, so
the graph never mutates the pool.

Only steps whose every row is one token take a graph; a row of one token attends to its
position's worth of cached tokens and itself, whether it decodes or is a one-token prompt
chunk. Steps with longer chunks run eagerly.
"""

from __future__ import annotations

import functools
import logging
import time

import torch

from engine.model.attention import decode_attention_with_own
from engine.model.decode_graph import decode_step, write_new_kv
from engine.kernels.inductor import compile_for
from engine.model.gpt2 import GPT2LMHead

logger = logging.getLogger(__name__)


def row_buckets(max_rows: int, smallest: int = 1) -> list[int]:
    """Step sizes captured: 1, 2, 4, then every 8 up to 64, every 16 up to 128, every 32
    beyond (vLLM's spacing, thinned past 64 rows where a padding row's share is small), and
    max_rows itself; none below `smallest`."""
    sizes = [1, 2, 4, *range(8, 65, 8), *range(80, 129, 16), *range(160, max_rows + 1, 32)]
    return sorted({max(size, smallest) for size in sizes if size < max_rows} | {max(max_rows, smallest)})


def width_buckets(max_width: int, smallest: int = 1) -> list[int]:
    """Block-table widths captured: powers of two below max_width, and max_width; none below
    `smallest`. A decode's attention reads every block of its row's table, so a step pads at
    most to twice its longest context."""
    widths = [max(1 << i, smallest) for i in range(max_width.bit_length()) if 1 << i < max_width]
    return sorted({*widths, max(max_width, smallest)})


def bucket(sizes: list[int], n: int) -> int:
    """The smallest size that holds n."""
    for size in sizes:
        if size >= n:
            return size
    raise ValueError(f"{n} is past the largest captured size, {sizes[-1]}")


class CudaGraphDecode:
    """DecodeGraph's call, for steps of one-token rows, on CUDA graphs."""

    max_prefill_tokens = 0  # the runner sends only steps of one-token rows
    native_write = False  # the eager steps write k, v with index_copy_ (our C++ copy is CPU's)

    def __init__(self, model: GPT2LMHead, max_rows: int, max_width: int, argmax: bool = True,
                 compiled: bool = False):
        # compiled (compile_decode: true): the step is inductor's graph of it, Triton kernels
        # with the attention's gathers fused into its reductions, captured like the eager one.
        # Its buckets start at 2, as DecodeGraph pads to: dynamo would compile a size of 1
        # into a graph of its own.
        smallest = 2 if compiled else 1
        self.rows, self.widths = row_buckets(max_rows, smallest), width_buckets(max_width, smallest)
        self.argmax, self.compiled = argmax, compiled
        self._model, self._max_rows, self._max_width = model, max_rows, max_width
        step = functools.partial(decode_step, model, decode_attention_with_own, argmax)
        device = next(model.parameters()).device
        self._step = compile_for(device, step, dynamic=True, freezing=True) if compiled else step
        self._graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.num_steps = 0  # steps replayed

    @property
    def num_graphs(self) -> int:
        return len(self._graphs)

    def eager(self) -> CudaGraphDecode:
        """The same graphs of the eager step: what serves where the compiled one cannot capture."""
        return CudaGraphDecode(self._model, self._max_rows, self._max_width, self.argmax)

    @torch.inference_mode()
    def capture(self, kv_pool: torch.Tensor) -> None:
        """Capture every bucket's graph, largest first, into one memory pool: a graph's
        intermediates are dead once it has replayed, so the graphs can share them."""
        start = time.monotonic()
        self._allocate(kv_pool)
        pool = torch.cuda.graph_pool_handle()
        for rows in reversed(self.rows):
            for width in reversed(self.widths):
                self._record(kv_pool, rows, width)  # eager first: cuBLAS's handles and plans for the shape
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self._record(kv_pool, rows, width)
                self._graphs[rows, width] = graph
        torch.cuda.synchronize(kv_pool.device)
        logger.info("captured %d CUDA graphs (rows %s, block-table widths %s) in %.1f s", len(self._graphs),
                    self.rows, self.widths, time.monotonic() - start)

    @torch.inference_mode()
    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_pool: torch.Tensor,
                 block_tables: torch.Tensor, slot_mapping: torch.Tensor, first_rows: torch.Tensor,
                 logits_indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits [S, vocab] in the model's dtype and greedy tokens [S] (None unless argmax) of
        the rows logits_indices picks; every row one token (first_rows is each row's own). The
        pool holds this step's k, v after."""
        batch, width = block_tables.shape
        rows, padded_width = bucket(self.rows, batch), bucket(self.widths, width)
        self._input_ids[:batch].copy_(input_ids)
        self._input_ids[batch:rows].zero_()
        self._positions[:batch].copy_(positions)
        self._positions[batch:rows].zero_()
        self._block_tables[:rows, :padded_width].zero_()
        self._block_tables[:batch, :width].copy_(block_tables)
        self._graphs[rows, padded_width].replay()
        write_new_kv(kv_pool, self._new_kv[:, :batch], slot_mapping)
        self.num_steps += 1
        greedy = self._greedy[logits_indices] if self.argmax else None
        return self._logits[logits_indices], greedy

    def _allocate(self, kv_pool: torch.Tensor) -> None:
        """The static buffers every graph reads and writes, at the largest bucket's size."""
        rows, width = self.rows[-1], self.widths[-1]
        num_layers, _, num_heads, _, _, head_dim = kv_pool.shape

        def indices(*shape: int) -> torch.Tensor:
            return torch.zeros(shape, dtype=torch.int64, device=kv_pool.device)

        # A column more than any bucket reads: every bucket's block table is then a view with
        # the same row stride, never a contiguous one (which a compiled step guards apart).
        self._input_ids, self._positions, self._block_tables = indices(rows), indices(rows), indices(rows, width + 1)
        self._logits = kv_pool.new_empty(rows, self._model.config.vocab_size)  # the model's dtype, as the pool's
        self._greedy = indices(rows)
        self._new_kv = kv_pool.new_empty(num_layers * 2 * num_heads, rows, head_dim)
        if self.compiled:
            # Its first call compiles: rows and width unequal (3 and 4), or dynamo would give
            # them one symbol and compile again at the first step where they differ.
            torch._dynamo.mark_static(kv_pool)
            self._step(self._input_ids[:3], self._positions[:3], kv_pool, self._block_tables[:3, :4], None, None)

    def _record(self, kv_pool: torch.Tensor, rows: int, width: int) -> None:
        """One step of `rows` rows against `width` blocks, from the input buffers to the output ones."""
        logits, greedy, new_kv = self._step(self._input_ids[:rows], self._positions[:rows], kv_pool,
                                            self._block_tables[:rows, :width], None, None)
        self._logits[:rows].copy_(logits)
        if greedy is not None:
            self._greedy[:rows].copy_(greedy)
        self._new_kv[:, :rows].copy_(new_kv)
