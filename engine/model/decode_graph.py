"""Decode steps, and steps short enough with prefill chunks among them (`graph_prefill_tokens`),
through one inductor graph of the whole forward (`compile_decode: true`), as vLLM's CPU
worker runs its model: LayerNorm, GELU and residual adds fused around the linears, and the paged pools read in place by the attention
(`decode_attention` in the config: our C++ kernel, engine/kernels/native_attention.py, or the
expression inductor compiles, engine/model/attention.py decode_attention_with_own). The linears
are the model's own: its oneDNN-prepacked ones (`linears: auto`), which eager prefill steps
share, or nn.Linear (`linears: reference`), which inductor packs itself.

The graph is pure: it takes the runner's one KV pool, returns every layer's new k, v already
in the pool's head-major order, and one copy writes them all after it (a write per layer and
pool costs more in dispatch than in bytes): our C++ one where our attention kernel runs,
index_copy_, which copies on one thread, otherwise. So the compiled code never copies or
mutates the pool, and a warm-up call leaves no trace. Its logits stay in the model's dtype:
converting a bf16 batch's to float32 in the graph costs more than our C++ sampler's reading
bf16 as it is; what else reads them converts the rows it reads.
Where the sampler is torch's, the graph also returns each row's greedy token
(`argmax_in_graph`), as ATen's argmax over the vocabulary is a slow, unvectorised pass.

A row is one token: a decode's, or one of a prefill chunk's, which shares its sequence's
block table and attends to the chunk's rows before it (`first_rows`); the graph returns the
logits of the rows that sample (`logits_indices`) only.

One graph for every step: rows, sampled rows and block-table width are dynamic, and padded
to at least 2, because dynamo specialises a size of 1 into a graph of its own (each
compiled at its first use, and a batch-of-one graph whose frozen fp32 linears inductor
would put on MKL rather than oneDNN). The pools' shapes never change, so they are static.
The same graph serves every torch thread count (engine/kernels/inductor.py). warm_up compiles it,
before the engine serves or while it serves eager steps (engine/model/graph_compile.py).

Where compile_decode is auto, the tuner races the compiled graph against the same step run
eagerly, per step size (engine/core/tuner.py), and steps of a size whose eager run was faster
skip the graph (`use_eager_at`): on some CPUs oneDNN's eager products beat the fused graph.

The weights are the graph's inputs, not constants frozen into it, wherever the linears are
our prepacked ones: then inductor's disk caches hold the compiled graph, and a later
process loads it in seconds rather than compiling it again. `linears: reference` freezes
them, as inductor prepacks an nn.Linear's weight only as a constant; it compiles in every
process.
"""

from __future__ import annotations

import functools
import itertools
import logging
import time
from collections.abc import Callable, Sequence

import torch
from torch import nn

from engine.model.attention import decode_attention_with_own
from engine.kernels.inductor import compile_for
from engine.lora.lora_linear import LoraBatch, LoraForm
from engine.lora.slots import LoraSlots
from engine.model.gpt2 import GPT2LMHead
from engine.kernels.native_attention import DecodeAttention

logger = logging.getLogger(__name__)


def layer_caches(kv_pool: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The per-layer (k, v) views of a pool [n_layer, 2, H, num_blocks, block_size, D]."""
    return [(layer[0], layer[1]) for layer in kv_pool.unbind(0)]


def write_new_kv(kv_pool: torch.Tensor, new_kv: torch.Tensor, slot_mapping: torch.Tensor, native: bool = False) -> None:
    """new_kv [n_layer * 2 * H, B, D] (decode_step's order) into each row's slot, every layer
    at once; `native`: our C++ copy (engine/kernels/csrc/kv_write.cpp), on torch's threads."""
    num_layers, _, num_heads, num_blocks, block_size, head_dim = kv_pool.shape
    rows = kv_pool.view(num_layers * 2 * num_heads, num_blocks * block_size, head_dim)
    if native:
        torch.ops.rayinfer.write_kv(rows, new_kv, slot_mapping)
    else:
        rows.index_copy_(1, slot_mapping, new_kv)


def decode_step(model: GPT2LMHead, attention: DecodeAttention, argmax: bool, input_ids: torch.Tensor,
                positions: torch.Tensor, kv_pool: torch.Tensor, block_tables: torch.Tensor, first_rows: torch.Tensor,
                logits_indices: torch.Tensor, lora_slots: torch.Tensor | None = None,
                lora_stacks: tuple[torch.Tensor, ...] = (), lora_form: LoraForm = "per_row",
                ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """What the graph computes: logits [S, vocab] of the rows logits_indices picks, in the
    model's dtype, their greedy tokens [S] (None unless `argmax`) and the new k, v of every
    layer as [n_layer * 2 * H, T, D], the pool's row order. With LoRA on, each row's adapter
    slot (0: the base model) and the slots' stacked weights (engine/lora/slots.py) are inputs."""
    lora = None if lora_slots is None else LoraBatch.of(lora_slots, lora_stacks, lora_form)
    logits, keys, values = model.decode(input_ids, positions, layer_caches(kv_pool), block_tables, attention,
                                        first_rows, logits_indices, lora)
    new_kv = torch.stack([keys, values], dim=1).permute(0, 1, 3, 2, 4)  # [n_layer, 2, H, T, D]
    return logits, logits.argmax(dim=-1) if argmax else None, new_kv.flatten(0, 2)


def scratch_block_tables(kv_pool: torch.Tensor, rows: int, context: int, avoid: Sequence[int]) -> torch.Tensor:
    """Block tables for `rows` rows of `context` cached tokens each, over the pool's blocks in
    turn, for a step on scratch inputs that reads the pool and never writes it. Their width
    is at least the context's blocks and none of `avoid`: dynamo gives equal sizes one symbol,
    which would tie them together in a compiled graph (warm_up)."""
    num_blocks, block_size = kv_pool.shape[3], kv_pool.shape[4]
    width = next(w for w in itertools.count(-(-context // block_size)) if w not in avoid)
    return (torch.arange(rows * width, device=kv_pool.device) % num_blocks).view(rows, width)


class DecodeGraph:
    def __init__(self, model: GPT2LMHead, device: torch.device, attention: DecodeAttention,
                 argmax_in_graph: bool = True, lora: LoraSlots | None = None):
        """lora: the adapters' slots, read by every step with adapter rows (each row names a
        slot). Such steps run a graph of their own, compiled beside the base model's: a step of
        base rows alone then costs what it costs with LoRA off."""
        self._model, self._device, self._argmax = model, device, argmax_in_graph
        self.lora = lora
        self.use_attention(attention)
        self.num_steps = 0  # steps run through the graph
        self.eager_at: tuple[tuple[int, str], ...] = ()  # (rows, "graph" or "eager"): use_eager_at's

    def use_attention(self, attention: DecodeAttention) -> None:
        """The graph's attention (the tuner may change it); before warm_up only, as the graph
        is traced at its first call."""
        self.attention = attention
        self.native_write = attention is not decode_attention_with_own  # our kernels are built: write with ours too
        lora_form = "kernel" if self.lora is not None and self.lora.kernel else "per_row"
        step = functools.partial(decode_step, self._model, attention, self._argmax, lora_form=lora_form)
        self._eager = step
        # On CPU the kernels are called from C++, not Python: a step's dispatch costs less.
        freezing = any(isinstance(module, nn.Linear) for module in self._model.modules())  # inductor packs only constants
        self._compiled = compile_for(self._device, step, dynamic=True, freezing=freezing,
                                     cpp_wrapper=self._device.type == "cpu")

    @property
    def argmax_in_graph(self) -> bool:
        return self._argmax

    def use_eager_at(self, choices: Sequence[tuple[int, str]]) -> None:
        """Per step size, the compiled graph or the same step run eagerly: (rows, "graph" or
        "eager") for ascending row counts, each winner taking the steps of more rows than the
        count before it, up to its own; past the last count, the last winner. Read whole by
        the step loop, so it may change between two steps."""
        self.eager_at = tuple((rows, path) for rows, path in choices)

    def runs_eager(self, rows: int) -> bool:
        """Whether a step of `rows` rows runs eagerly (use_eager_at's choice)."""
        if not self.eager_at:
            return False
        return next((path for count, path in self.eager_at if rows <= count), self.eager_at[-1][1]) == "eager"

    @property
    def is_eager_everywhere(self) -> bool:
        return bool(self.eager_at) and all(path == "eager" for _, path in self.eager_at)

    def describe(self) -> str:
        """The steps' path, for the log."""
        if not any(path == "eager" for _, path in self.eager_at):
            return "steps now compiled"
        if self.is_eager_everywhere:
            return "steps run the graph's step eagerly (measured faster here than compiled)"
        eager = ", ".join(f"up to {rows}" for rows, path in self.eager_at if path == "eager")
        return f"steps now compiled, except those of the sizes measured faster eagerly (rows {eager})"

    def scratch_step(self, kv_pool: torch.Tensor, rows: int, context: int, eager: bool) -> Callable[[], None]:
        """A decode step of `rows` rows, each attending to `context` cached tokens, on scratch
        inputs: the pool is read, never written. On the compiled graph, or its step run eagerly."""
        tables = scratch_block_tables(kv_pool, rows, context, avoid=(rows,))
        positions = torch.full((rows,), min(context, tables.shape[1] * kv_pool.shape[4]) - 1, dtype=torch.int64,
                               device=kv_pool.device)
        input_ids = torch.zeros(rows, dtype=torch.int64, device=kv_pool.device)
        first_rows, sampled = (torch.arange(rows, device=kv_pool.device) for _ in range(2))  # distinct: dynamo guards on aliasing
        return lambda: self._run(input_ids, positions, kv_pool, tables, first_rows, sampled, eager=eager)

    def use_argmax_in_graph(self, argmax: bool) -> None:
        """Whether the graph computes each sampled row's greedy token (the sampler's draw is
        torch's) or leaves it to our draw's argmax; before warm_up only, as use_attention."""
        self._argmax = argmax
        self.use_attention(self.attention)

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_pool: torch.Tensor,
                 block_tables: torch.Tensor, slot_mapping: torch.Tensor, first_rows: torch.Tensor,
                 logits_indices: torch.Tensor, lora_slots: torch.Tensor | None = None,
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits [S, vocab] in the model's dtype and greedy tokens [S] (None unless
        argmax_in_graph) of the rows logits_indices picks; rows one token each, each chunk's
        from first_rows (a decode's is its own row). The pool holds this step's k, v after.
        lora_slots: each row's adapter slot (None: every row the base model's)."""
        logits, greedy, new_kv = self._run(input_ids, positions, kv_pool, block_tables, first_rows, logits_indices,
                                           lora_slots)
        self.num_steps += 1
        with torch.inference_mode():
            write_new_kv(kv_pool, new_kv, slot_mapping, self.native_write)
        return logits, greedy

    def warm_up(self, kv_pool: torch.Tensor, batch: int) -> None:
        """Compile the graph now, on scratch inputs that touch no pool, block or sequence.

        `batch` rows (at least 3), one fewer sampled, against a block-table width that is
        neither: dynamo gives equal sizes one symbol, which would tie them together in the
        graph. The rows are what inductor's heuristics (and its packing of `linears:
        reference` weights) take as typical.
        """
        torch._dynamo.mark_static(kv_pool)
        rows = max(batch, 3)
        sampled = rows - 1
        width = next(w for w in (4, 5, 6) if w not in (rows, sampled))

        def zeros(*shape: int) -> torch.Tensor:  # distinct tensors: dynamo guards on aliasing
            return torch.zeros(shape, dtype=torch.int64, device=kv_pool.device)

        if self.lora is not None:
            for stack in self.lora.stacks:
                torch._dynamo.mark_static(stack)
        start, threads = time.monotonic(), torch.get_num_threads()  # what inductor's heuristics read
        for lora_slots in [None] + ([] if self.lora is None else [zeros(rows)]):  # the base graph, the adapters'
            self._run(zeros(rows), zeros(rows), kv_pool, zeros(rows, width), torch.arange(rows, device=kv_pool.device),
                      torch.arange(sampled, device=kv_pool.device), lora_slots, eager=False)
        logger.info("decode graph compiled in %.1f s (torch threads: %d)", time.monotonic() - start, threads)

    def _run(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_pool: torch.Tensor, block_tables: torch.Tensor,
             first_rows: torch.Tensor, logits_indices: torch.Tensor, lora_slots: torch.Tensor | None = None,
             eager: bool | None = None) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """The graph on inputs padded to at least 2 rows, 2 sampled rows and 2 blocks,
        unpadded after; `eager` (None: use_eager_at's choice for the step's rows) runs the
        step uncompiled.

        A padding row repeats row 0 as a chunk of its own (row 0's cached tokens are in the
        pool whether it decodes or starts a chunk); a padding sample repeats the first
        (row 0 where none samples); a padding block is block 0, masked out (a sequence with
        one block has fewer cached tokens than a block holds, the mask's bound); a padding row's
        adapter slot repeats row 0's. Inputs are
        made outside inference mode, as the runner's are: dynamo guards on that too.
        """
        batch, width = block_tables.shape
        num_sampled = len(logits_indices)
        step = self._eager if (self.runs_eager(batch) if eager is None else eager) else self._compiled
        if width < 2:
            block_tables = torch.cat([block_tables, torch.zeros_like(block_tables)], dim=1)
        if batch < 2:
            input_ids, positions, block_tables = input_ids.repeat(2), positions.repeat(2), block_tables.repeat(2, 1)
            first_rows = torch.arange(2, device=first_rows.device)
            lora_slots = None if lora_slots is None else lora_slots.repeat(2)
        if num_sampled < 2:
            logits_indices = (logits_indices if num_sampled else torch.zeros_like(first_rows[:1])).repeat(2)[:2]
        with torch.inference_mode():
            lora = () if lora_slots is None else (lora_slots, self.lora.stacks)
            logits, greedy, new_kv = step(input_ids, positions, kv_pool, block_tables, first_rows, logits_indices, *lora)
        return logits[:num_sampled], None if greedy is None else greedy[:num_sampled], new_kv[:, :batch]
