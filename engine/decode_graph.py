"""Decode-only steps through one inductor graph of the whole forward (`compile_decode: true`),
as vLLM's CPU worker runs its model: weights frozen into the graph so inductor prepacks
the linears itself, LayerNorm, GELU and residual adds fused around them, and the paged
pools read in place by the attention (engine/attention.py decode_attention_with_own).

The graph is pure: it returns each layer's new k, v and the pools are written after it, so
the compiled code never copies or mutates a pool. Prefill and mixed steps keep the eager
forward. Shapes are dynamic (batch, block-table width), so a growing batch or context does
not recompile; dynamo still specialises sizes 0 and 1, so a batch of one is a graph of its own.
"""

from __future__ import annotations

import torch

from engine.attention import write_kv
from engine.inductor import compile_for
from engine.models.gpt2 import GPT2LMHead


class DecodeGraph:
    def __init__(self, model: GPT2LMHead, device: torch.device):
        self._compiled = compile_for(device, model.decode, dynamic=True, freezing=True)
        self.num_steps = 0  # decode steps run through the graph

    @torch.inference_mode()
    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                 block_tables: torch.Tensor, slot_mapping: torch.Tensor) -> torch.Tensor:
        """float32 logits [B, vocab], one row per sequence; the pools hold this step's k, v after."""
        logits, keys, values = self._compiled(input_ids, positions, kv_caches, block_tables)
        self.num_steps += 1
        for (k_cache, v_cache), k, v in zip(kv_caches, keys, values):
            write_kv(k, v, k_cache, v_cache, slot_mapping)
        return logits
