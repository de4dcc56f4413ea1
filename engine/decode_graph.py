"""Decode-only steps through one inductor graph of the whole forward (`compile_decode: true`),
as vLLM's CPU worker runs its model: weights frozen into the graph, LayerNorm, GELU and
residual adds fused around the linears, and the paged pools read in place by the attention
(engine/attention.py decode_attention_with_own). The linears are the model's own: its
oneDNN-prepacked ones (`linears: auto`), which eager prefill steps share, or nn.Linear
(`linears: reference`), which inductor packs itself.

The graph is pure: it returns each layer's new k, v and the pools are written after it, so
the compiled code never copies or mutates a pool, and a warm-up call leaves no trace.

One graph for every step: batch and block-table width are dynamic, and padded to at least
2, because dynamo specialises a size of 1 into a graph of its own (four graphs, each
compiled at its first use, and a batch-of-one graph whose frozen fp32 linears inductor
would put on MKL rather than oneDNN). The pools' shapes never change, so they are static.
warm_up compiles that one graph before the engine serves.
"""

from __future__ import annotations

import logging
import time

import torch

from engine.attention import write_kv
from engine.inductor import compile_for
from engine.models.gpt2 import GPT2LMHead

logger = logging.getLogger(__name__)

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]


class DecodeGraph:
    def __init__(self, model: GPT2LMHead, device: torch.device):
        # freezing also lowers the prepacked linears: inductor takes their weights only as constants
        self._compiled = compile_for(device, model.decode, dynamic=True, freezing=True)
        self.num_steps = 0  # decode steps run through the graph

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: KVCaches,
                 block_tables: torch.Tensor, slot_mapping: torch.Tensor) -> torch.Tensor:
        """float32 logits [B, vocab], one row per sequence; the pools hold this step's k, v after."""
        logits, keys, values = self._run(input_ids, positions, kv_caches, block_tables)
        self.num_steps += 1
        with torch.inference_mode():
            for (k_cache, v_cache), k, v in zip(kv_caches, keys, values):
                write_kv(k, v, k_cache, v_cache, slot_mapping)
        return logits

    def warm_up(self, kv_caches: KVCaches, batch: int) -> None:
        """Compile the graph now, on scratch inputs that touch no pool, block or sequence.

        `batch` rows against 4 blocks (5 if batch is 4: dynamo gives equal sizes one
        symbol, which would tie batch to width); the rows are what inductor's heuristics
        (and its packing of `linears: reference` weights) take as typical.
        """
        for k_cache, v_cache in kv_caches:
            torch._dynamo.mark_static(k_cache)
            torch._dynamo.mark_static(v_cache)
        batch = max(batch, 2)
        width = 5 if batch == 4 else 4

        def zeros(*shape: int) -> torch.Tensor:  # distinct tensors: dynamo guards on aliasing
            return torch.zeros(shape, dtype=torch.int64, device=kv_caches[0][0].device)

        start = time.monotonic()
        self._run(zeros(batch), zeros(batch), kv_caches, zeros(batch, width))
        logger.info("decode graph compiled in %.1f s", time.monotonic() - start)

    def _run(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: KVCaches,
             block_tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
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
            logits, keys, values = self._compiled(input_ids, positions, kv_caches, block_tables)
        return logits[:batch], keys[:, :batch], values[:, :batch]
