"""Attention over the paged KV cache.

Cache layout, one pair per layer, head-major so a gather of whole blocks comes out as
contiguous [H, B, L, D], ready for batched matmuls with no further copy:

    k_cache, v_cache   [num_heads, num_blocks, block_size, head_dim]
    slot s             block s // block_size, offset s % block_size

A step's tokens are flattened, single-token queries (decodes) first: tokens
[0, num_decodes) form one group of one query each; the rest are prefill chunks, a second
group padded to the longest chunk. Keeping the two apart means a long prefill chunk never
pads every decode up to its length.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch



@dataclass
class AttentionGroup:
    """Sequences attending together: padded queries against their gathered cache blocks."""

    block_tables: torch.Tensor  # [B, max_blocks] int64, padded with block 0
    mask: torch.Tensor  # [B, Q, max_blocks * block_size] bool, True = may attend
    query_index: torch.Tensor | None  # [B, Q] flat token index per query slot; None for decodes
    query_valid: torch.Tensor | None  # [B, Q] bool, real queries (not padding)


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64, where each token's K/V is written
    num_decodes: int
    decode: AttentionGroup | None
    prefill: AttentionGroup | None
    native_write: bool = False  # k, v written by our C++ copy (engine/kernels/csrc/kv_write.cpp): it is built


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
             native: bool = False) -> None:
    """k, v: [T, H, D] written to their slots; `native`: over torch's threads by our C++ copy,
    where index_copy_ copies on one (a long prefill's writes are worth spreading)."""
    num_heads, _, _, head_dim = k_cache.shape
    for new, cache in ((k, k_cache), (v, v_cache)):
        rows, by_head = cache.view(num_heads, -1, head_dim), new.transpose(0, 1)
        if native:
            torch.ops.rayinfer.write_kv(rows, by_head.contiguous(), slots)
        else:
            rows.index_copy_(1, slots, by_head)


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
) -> torch.Tensor:
    """q, k, v: [T, H, D] for this step's tokens. Writes k, v to the cache, returns [T, H, D]."""
    write_kv(k, v, k_cache, v_cache, meta.slot_mapping, meta.native_write)
    num_decodes = meta.num_decodes
    if meta.prefill is None:
        return _attend_decodes(q, k_cache, v_cache, meta)
    out = torch.empty_like(q)
    if meta.decode is not None:
        out[:num_decodes] = _attend_decodes(q[:num_decodes], k_cache, v_cache, meta)
    group = meta.prefill
    padded = _attend(q[group.query_index], k_cache, v_cache, group)
    out[group.query_index[group.query_valid]] = padded[group.query_valid]
    return out


def _attend_decodes(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
    """q: [B, H, D], one query per sequence -> [B, H, D]."""
    return _attend(q.unsqueeze(1), k_cache, v_cache, meta.decode).squeeze(1)


def decode_attention_with_own(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                              v_cache: torch.Tensor, block_tables: torch.Tensor, context_lens: torch.Tensor,
                              first_rows: torch.Tensor | None = None) -> torch.Tensor:
    """Decode attention that reads the paged pools in place, for queries [B, H, D] whose own
    k, v [B, H, D] are not in the pools yet: each
    attends to its context_lens [B] cached tokens and to its own key; with first_rows [B], row
    b also attends to the keys of this step's rows first_rows[b]..b (a prefill chunk's rows
    before it, causal). The signature of torch.ops.rayinfer.decode_attention
    (engine/kernels/native_attention.py), whose reference this is.

    Leaves the pools unwritten, so a compiled graph of the whole step stays free of
    mutation (the caller writes k, v after it).
    """
    keys = torch.arange(block_tables.shape[1] * k_cache.shape[2], device=q.device)
    mask = keys.unsqueeze(0) < context_lens.unsqueeze(1)  # [B, L]: the cached tokens
    queries = q.transpose(0, 1).float()  # [H, B, D]
    cached = _cached_scores(queries, k_cache, block_tables, mask)
    if first_rows is None:
        fresh = (queries * k.transpose(0, 1).float()).sum(-1, keepdim=True) * q.shape[-1] ** -0.5  # [H, B, 1]
        probs = torch.cat([cached, fresh], dim=-1).softmax(dim=-1)
        out = _weighted_values(probs[..., :-1], v_cache, block_tables) + probs[..., -1:] * v.transpose(0, 1).float()
        return out.to(q.dtype).transpose(0, 1)
    rows = torch.arange(q.shape[0], device=q.device)
    in_chunk = (rows.unsqueeze(0) >= first_rows.unsqueeze(1)) & (rows.unsqueeze(0) <= rows.unsqueeze(1))  # [B, B]
    fresh = torch.matmul(queries, k.transpose(0, 1).float().transpose(1, 2)) * q.shape[-1] ** -0.5  # [H, B, B]
    probs = torch.cat([cached, fresh.masked_fill(~in_chunk, float("-inf"))], dim=-1).softmax(dim=-1)
    num_cached = cached.shape[-1]
    out = (_weighted_values(probs[..., :num_cached], v_cache, block_tables)
           + torch.matmul(probs[..., num_cached:], v.transpose(0, 1).float()))
    return out.to(q.dtype).transpose(0, 1)


def _cached_scores(queries: torch.Tensor, k_cache: torch.Tensor, block_tables: torch.Tensor,
                   mask: torch.Tensor) -> torch.Tensor:
    """Scaled float32 scores [H, B, L] of queries [H, B, D] against each row's blocks, -inf
    where the mask [B, L] says not to attend."""
    keys = k_cache[:, block_tables].flatten(2, 3)  # [H, B, L, D]
    scores = (queries.unsqueeze(2) * keys.float()).sum(-1) * queries.shape[-1] ** -0.5
    return scores.masked_fill(~mask, float("-inf"))


def _weighted_values(probs: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
    """float32 [H, B, D]: each row's blocks of values weighted by probs [H, B, L]."""
    values = v_cache[:, block_tables].flatten(2, 3)  # [H, B, L, D]
    return (probs.unsqueeze(-1) * values.float()).sum(2)


def _attend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, group: AttentionGroup) -> torch.Tensor:
    """q: [B, Q, H, D] -> [B, Q, H, D], each row attending to its own blocks.

    Plain matmuls with a float32 softmax: on CPU, SDPA's kernel is slower for short queries
    against a mask, and these run unchanged on CUDA.
    """
    keys = _gather(k_cache, group.block_tables)  # [H, B, L, D]
    values = _gather(v_cache, group.block_tables)
    queries = q.permute(2, 0, 1, 3)  # [H, B, Q, D]
    scores = torch.matmul(queries, keys.transpose(-1, -2)).float() * q.shape[-1] ** -0.5
    probs = scores.masked_fill_(~group.mask, float("-inf")).softmax(dim=-1).to(q.dtype)
    return torch.matmul(probs, values).permute(1, 2, 0, 3)


def _gather(cache: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
    """The blocks of each row, concatenated: [H, B, max_blocks * block_size, D].

    index_select copies whole blocks as rows, where advanced indexing goes element by
    element on CPU.
    """
    num_heads, num_blocks, block_size, head_dim = cache.shape
    batch, width = block_tables.shape
    rows = cache.view(num_heads, num_blocks, block_size * head_dim).index_select(1, block_tables.flatten())
    return rows.view(num_heads, batch, width * block_size, head_dim)
