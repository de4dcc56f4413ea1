"""Attention over the paged KV cache.

Cache layout, one pair per layer:

    k_cache, v_cache   [num_blocks, block_size, num_heads, head_dim]
    slot s             block s // block_size, offset s % block_size

A step's tokens are flattened, decodes first: tokens [0, num_decodes) are one query each;
the rest are prefill chunks. Decodes attend as one batch of single-token queries; prefill
chunks attend as a second batch padded to the longest chunk. Keeping the two apart means a
long prefill chunk never pads every decode up to its length.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class AttentionGroup:
    """Sequences attending together: padded queries against their gathered cache blocks."""

    block_tables: torch.Tensor  # [B, max_blocks] int64, padded with block 0
    mask: torch.Tensor  # [B, 1, Q, max_blocks * block_size] bool, True = may attend
    query_index: torch.Tensor | None  # [B, Q] flat token index per query slot; None for decodes
    query_valid: torch.Tensor | None  # [B, Q] bool, real queries (not padding)


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64, where each token's K/V is written
    num_decodes: int
    decode: AttentionGroup | None
    prefill: AttentionGroup | None


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
) -> torch.Tensor:
    """q, k, v: [T, H, D] for this step's tokens. Writes k, v to the cache, returns [T, H, D]."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    k_cache.view(-1, num_heads, head_dim).index_copy_(0, meta.slot_mapping, k)
    v_cache.view(-1, num_heads, head_dim).index_copy_(0, meta.slot_mapping, v)
    if meta.prefill is None:
        return _attend(q.unsqueeze(1), k_cache, v_cache, meta.decode).squeeze(1)
    out = torch.empty_like(q)
    if meta.decode is not None:
        out[: meta.num_decodes] = _attend(q[: meta.num_decodes].unsqueeze(1), k_cache, v_cache, meta.decode).squeeze(1)
    group = meta.prefill
    padded = _attend(q[group.query_index], k_cache, v_cache, group)
    out[group.query_index[group.query_valid]] = padded[group.query_valid]
    return out


def _attend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, group: AttentionGroup) -> torch.Tensor:
    """q: [B, Q, H, D] -> [B, Q, H, D], each row attending to its own blocks."""
    batch, num_blocks = group.block_tables.shape
    keys = k_cache[group.block_tables].flatten(1, 2)  # [B, L, H, D]
    values = v_cache[group.block_tables].flatten(1, 2)
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2), attn_mask=group.mask
    )
    return out.transpose(1, 2)
