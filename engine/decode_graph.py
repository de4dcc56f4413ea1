"""Decode-only steps through one inductor graph of the whole forward (`compile_decode: true`),
as vLLM's CPU worker runs its model: weights frozen into the graph, LayerNorm, GELU and
residual adds fused around the linears, and the paged pools read in place by the attention
(`decode_attention` in the config: our C++ kernel, engine/native_attention.py, or the
expression inductor compiles, engine/attention.py decode_attention_with_own). The linears
are the model's own: its oneDNN-prepacked ones (`linears: auto`), which eager prefill steps
share, or nn.Linear (`linears: reference`), which inductor packs itself.

The graph is pure: it takes the runner's one KV pool, returns every layer's new k, v already
in the pool's head-major order, and one copy writes them all after it (a write per layer and
pool costs more in dispatch than in bytes): our C++ one where our attention kernel runs,
index_copy_, which copies on one thread, otherwise. So the compiled code never copies or
mutates the pool, and a warm-up call leaves no trace. Its logits stay in the model's dtype:
converting a bf16 batch's to float32 in the graph cost more than our C++ sampler's reading
bf16 as it is (BENCHMARKS.md, session 10); what else reads them converts the rows it reads.
Where the sampler is torch's, the graph also returns each row's greedy token
(`argmax_in_graph`), as ATen's argmax over the vocabulary is a slow, unvectorised pass.

One graph for every step: batch and block-table width are dynamic, and padded to at least
2, because dynamo specialises a size of 1 into a graph of its own (four graphs, each
compiled at its first use, and a batch-of-one graph whose frozen fp32 linears inductor
would put on MKL rather than oneDNN). The pools' shapes never change, so they are static.
warm_up compiles that one graph before the engine serves.
"""

from __future__ import annotations

import functools
import logging
import time

import torch

from engine.attention import decode_attention_with_own
from engine.inductor import compile_for
from engine.models.gpt2 import GPT2LMHead
from engine.native_attention import DecodeAttention

logger = logging.getLogger(__name__)


def layer_caches(kv_pool: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The per-layer (k, v) views of a pool [n_layer, 2, H, num_blocks, block_size, D]."""
    return [(layer[0], layer[1]) for layer in kv_pool.unbind(0)]


def write_new_kv(kv_pool: torch.Tensor, new_kv: torch.Tensor, slot_mapping: torch.Tensor, native: bool = False) -> None:
    """new_kv [n_layer * 2 * H, B, D] (decode_step's order) into each row's slot, every layer
    at once; `native`: our C++ copy (engine/csrc/kv_write.cpp), on torch's threads."""
    num_layers, _, num_heads, num_blocks, block_size, head_dim = kv_pool.shape
    rows = kv_pool.view(num_layers * 2 * num_heads, num_blocks * block_size, head_dim)
    if native:
        torch.ops.rayinfer.write_kv(rows, new_kv, slot_mapping)
    else:
        rows.index_copy_(1, slot_mapping, new_kv)


def decode_step(model: GPT2LMHead, attention: DecodeAttention, argmax: bool, input_ids: torch.Tensor,
                positions: torch.Tensor, kv_pool: torch.Tensor, block_tables: torch.Tensor,
                ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """What the graph computes: logits [B, vocab] in the model's dtype, greedy tokens [B] (None
    unless `argmax`) and the new k, v of every layer as [n_layer * 2 * H, B, D], the pool's row order."""
    logits, keys, values = model.decode(input_ids, positions, layer_caches(kv_pool), block_tables, attention)
    new_kv = torch.stack([keys, values], dim=1).permute(0, 1, 3, 2, 4)  # [n_layer, 2, H, B, D]
    return logits, logits.argmax(dim=-1) if argmax else None, new_kv.flatten(0, 2)


class DecodeGraph:
    def __init__(self, model: GPT2LMHead, device: torch.device, attention: DecodeAttention,
                 argmax_in_graph: bool = True):
        # freezing also lowers the prepacked linears: inductor takes their weights only as constants
        self.attention = attention
        self.native_write = attention is not decode_attention_with_own  # our kernels are built: write with ours too
        step = functools.partial(decode_step, model, attention, argmax_in_graph)
        # On CPU the kernels are called from C++, not Python (BENCHMARKS.md, session 8).
        self._compiled = compile_for(device, step, dynamic=True, freezing=True, cpp_wrapper=device.type == "cpu")
        self.num_steps = 0  # decode steps run through the graph

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_pool: torch.Tensor,
                 block_tables: torch.Tensor, slot_mapping: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits [B, vocab] in the model's dtype and greedy tokens [B] (None unless
        argmax_in_graph), one row per sequence; the pool holds this step's k, v after."""
        logits, greedy, new_kv = self._run(input_ids, positions, kv_pool, block_tables)
        self.num_steps += 1
        with torch.inference_mode():
            write_new_kv(kv_pool, new_kv, slot_mapping, self.native_write)
        return logits, greedy

    def warm_up(self, kv_pool: torch.Tensor, batch: int) -> None:
        """Compile the graph now, on scratch inputs that touch no pool, block or sequence.

        `batch` rows against 4 blocks (5 if batch is 4: dynamo gives equal sizes one
        symbol, which would tie batch to width); the rows are what inductor's heuristics
        (and its packing of `linears: reference` weights) take as typical.
        """
        torch._dynamo.mark_static(kv_pool)
        batch = max(batch, 2)
        width = 5 if batch == 4 else 4

        def zeros(*shape: int) -> torch.Tensor:  # distinct tensors: dynamo guards on aliasing
            return torch.zeros(shape, dtype=torch.int64, device=kv_pool.device)

        start = time.monotonic()
        self._run(zeros(batch), zeros(batch), kv_pool, zeros(batch, width))
        logger.info("decode graph compiled in %.1f s", time.monotonic() - start)

    def _run(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_pool: torch.Tensor,
             block_tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """The graph on inputs padded to at least 2 rows and 2 blocks, unpadded after.

        A padding row repeats row 0; a padding block is block 0, masked out (a sequence with
        one block has fewer cached tokens than a block holds, the mask's bound). Inputs are
        made outside inference mode, as the runner's are: dynamo guards on that too.
        """
        batch, width = block_tables.shape
        if width < 2:
            block_tables = torch.cat([block_tables, torch.zeros_like(block_tables)], dim=1)
        if batch < 2:
            input_ids, positions, block_tables = input_ids.repeat(2), positions.repeat(2), block_tables.repeat(2, 1)
        with torch.inference_mode():
            logits, greedy, new_kv = self._compiled(input_ids, positions, kv_pool, block_tables)
        return logits[:batch], None if greedy is None else greedy[:batch], new_kv[:, :batch]
