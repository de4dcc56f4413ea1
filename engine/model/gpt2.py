"""GPT-2 forward pass over the paged KV cache.

Weights keep Hugging Face's names; HF stores GPT-2's projections as Conv1D ([in, out]),
which load_hf_weights transposes into nn.Linear's [out, in].
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GPT2Config

from engine.model.attention import AttentionMetadata, decode_attention_with_own, paged_attention
from engine.kernels.native_attention import DecodeAttention
from engine.lora.lora_linear import LayerLora, LoraBatch
from engine.model.packed_linear import PackedLinear, linear_add, linear_gelu, lora_linear_add, pack_linears

CONV1D_WEIGHTS = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")


class GPT2Block(nn.Module):
    def __init__(self, config: GPT2Config):
        super().__init__()
        hidden, eps = config.n_embd, config.layer_norm_epsilon
        inner = config.n_inner or 4 * hidden
        self.num_heads = config.n_head
        self.head_dim = hidden // config.n_head
        self.ln_1 = nn.LayerNorm(hidden, eps=eps)
        self.attn_qkv = nn.Linear(hidden, 3 * hidden)
        self.attn_out = nn.Linear(hidden, hidden)
        self.ln_2 = nn.LayerNorm(hidden, eps=eps)
        self.mlp_fc = nn.Linear(hidden, inner)
        self.mlp_proj = nn.Linear(inner, hidden)

    def forward(self, h: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata,
                lora: LayerLora | None = None) -> torch.Tensor:
        """lora: each row's adapter update (engine/lora/lora_linear.py); None, the base model alone."""
        if lora is not None:
            return self._forward_lora(h, kv_cache, meta, lora)
        qkv = self.attn_qkv(self.ln_1(h)).view(h.shape[0], 3, self.num_heads, self.head_dim)
        attn = paged_attention(qkv[:, 0], qkv[:, 1], qkv[:, 2], kv_cache[0], kv_cache[1], meta)
        return self._mlp(linear_add(self.attn_out, attn.flatten(1), h))

    def _forward_lora(self, h: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata,
                      lora: LayerLora) -> torch.Tensor:
        qkv = self._qkv_lora(h, lora)
        attn = paged_attention(qkv[:, 0], qkv[:, 1], qkv[:, 2], kv_cache[0], kv_cache[1], meta)
        return self._attn_out_mlp_lora(attn.flatten(1), h, lora)

    def decode(self, h: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor], block_tables: torch.Tensor,
               context_lens: torch.Tensor, attention: DecodeAttention,
               first_rows: torch.Tensor | None = None, lora: LayerLora | None = None,
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A step's rows, the pools read and left unwritten: (h, this step's k, v). Each row
        attends to its context_lens cached tokens and to this step's rows from first_rows (its
        chunk's first; None: each row alone, a decode) up to itself."""
        if lora is not None:
            q, k, v = self._qkv_lora(h, lora).unbind(1)
            attn = attention(q, k, v, kv_cache[0], kv_cache[1], block_tables, context_lens, first_rows)
            return self._attn_out_mlp_lora(attn.flatten(1), h, lora), k, v
        qkv = self.attn_qkv(self.ln_1(h)).view(h.shape[0], 3, self.num_heads, self.head_dim)
        q, k, v = qkv.unbind(1)
        attn = attention(q, k, v, kv_cache[0], kv_cache[1], block_tables, context_lens, first_rows)
        return self._mlp(linear_add(self.attn_out, attn.flatten(1), h)), k, v

    def _mlp(self, h: torch.Tensor) -> torch.Tensor:
        return linear_add(self.mlp_proj, linear_gelu(self.mlp_fc, self.ln_2(h)), h)

    # The same block with each linear's output plus its LoRA update, added where PEFT adds it:
    # to the linear's output, before the GELU and the residual.
    def _qkv_lora(self, h: torch.Tensor, lora: LayerLora) -> torch.Tensor:
        x = self.ln_1(h)
        return (self.attn_qkv(x) + lora.delta("attn_qkv", x)).view(h.shape[0], 3, self.num_heads, self.head_dim)

    def _attn_out_mlp_lora(self, attn: torch.Tensor, h: torch.Tensor, lora: LayerLora) -> torch.Tensor:
        h = lora_linear_add(self.attn_out, attn, h, lora.delta("attn_out", attn))
        x = self.ln_2(h)
        inner = F.gelu(self.mlp_fc(x) + lora.delta("mlp_fc", x), approximate="tanh")
        return lora_linear_add(self.mlp_proj, inner, h, lora.delta("mlp_proj", inner))


class GPT2LMHead(nn.Module):
    def __init__(self, config: GPT2Config):
        super().__init__()
        _check_supported(config)
        self.config = config
        self.wte = _uninitialized_embedding(config.vocab_size, config.n_embd)
        self.wpe = _uninitialized_embedding(config.n_positions, config.n_embd)
        self.h = nn.ModuleList(GPT2Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.lm_head: PackedLinear | None = None  # tied to wte; a packed copy after pack_linears()

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
        logits_indices: torch.Tensor,
        lora: LoraBatch | None = None,
    ) -> torch.Tensor:
        """Flat tokens [T] in; float32 logits [S, vocab] out for the S tokens that sample.
        lora: each token's adapter (engine/lora/lora_linear.py); None, the base model alone."""
        h = self.wte(input_ids) + self.wpe(positions)
        for index, (block, kv_cache) in enumerate(zip(self.h, kv_caches)):
            h = block(h, kv_cache, meta, None if lora is None else lora.layer(index))
        return self._logits(self.ln_f(h[logits_indices])).float()

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        """In the model's dtype."""
        return F.linear(h, self.wte.weight) if self.lm_head is None else self.lm_head(h)

    def decode(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
               block_tables: torch.Tensor, attention: DecodeAttention = decode_attention_with_own,
               first_rows: torch.Tensor | None = None, logits_indices: torch.Tensor | None = None,
               lora: LoraBatch | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A step as one pure function (what engine/model/decode_graph.py compiles): tokens [T] at
        `positions`, each row with its sequence's block table, in; logits in the model's dtype
        (of the rows logits_indices picks, or of every row) and every layer's k, v
        [n_layer, T, H, D], still to be written, out. Without first_rows every row is a decode
        (one token per sequence, its position its number of cached tokens); with them, row b
        belongs to the chunk of one sequence's new tokens that starts at row first_rows[b], so
        it has position - (b - first_rows[b]) tokens cached. `attention` is
        decode_attention_with_own or its C++ kernel (engine/kernels/native_attention.py). `lora`:
        each row's adapter (engine/lora/lora_linear.py), None for the base model alone."""
        h = self.wte(input_ids) + self.wpe(positions)
        context_lens = positions
        if first_rows is not None:
            context_lens = positions - (torch.arange(len(positions), device=positions.device) - first_rows)
        new_keys, new_values = [], []
        for index, (block, kv_cache) in enumerate(zip(self.h, kv_caches)):
            layer_lora = None if lora is None else lora.layer(index)
            h, k, v = block.decode(h, kv_cache, block_tables, context_lens, attention, first_rows, layer_lora)
            new_keys.append(k)
            new_values.append(v)
        if logits_indices is not None:
            h = h[logits_indices]
        return self._logits(self.ln_f(h)), torch.stack(new_keys), torch.stack(new_values)

    def pack_linears(self, few_rows: bool = False) -> None:
        """Prepack the projections and the LM head for oneDNN (bf16 on CPU, see
        engine/model/packed_linear.py). Call after the weights are loaded: the state dict then no
        longer holds the projections. `few_rows`: small steps on our kernels (engine/model/packed_linear.py)."""
        pack_linears(self.h, few_rows)
        self.lm_head = PackedLinear(self.wte.weight, None, few_rows)

    @torch.no_grad()
    def load_hf_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        own = self.state_dict()
        loaded = set()
        for name, tensor in state_dict.items():
            key = hf_to_own_name(name.removeprefix("transformer."))
            if key is None:
                continue
            if any(name.endswith(suffix) for suffix in CONV1D_WEIGHTS):
                tensor = tensor.t()
            if own[key].shape != tensor.shape:
                raise ValueError(f"weight {name}: shape {tuple(tensor.shape)} != expected {tuple(own[key].shape)}")
            own[key].copy_(tensor)
            loaded.add(key)
        missing = set(own) - loaded
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} weights, e.g. {sorted(missing)[:3]}")

    @torch.no_grad()
    def init_random(self, seed: int) -> None:
        """GPT-2's own initialisation (normal(0, initializer_range)), for benchmarks and offline demos."""
        generator = torch.Generator().manual_seed(seed)
        std = self.config.initializer_range
        for name, param in self.named_parameters():
            if name.startswith("ln") or ".ln_" in name:
                nn.init.ones_(param) if name.endswith("weight") else nn.init.zeros_(param)
            elif name.endswith("bias"):
                nn.init.zeros_(param)
            else:
                param.normal_(0.0, std, generator=generator)  # the values of randn(...) * std, without the copies


def _uninitialized_embedding(num_embeddings: int, dim: int) -> nn.Embedding:
    """An embedding whose weight is given, not drawn: the model is built on the meta device and
    its weights are loaded or drawn after, and nn.Embedding's own draw there runs torch's
    Python reference ops, whose first use imports torch._dynamo, on the start-up's path."""
    return nn.Embedding(num_embeddings, dim, _weight=torch.empty(num_embeddings, dim))


_RENAMES = {"attn.c_attn": "attn_qkv", "attn.c_proj": "attn_out", "mlp.c_fc": "mlp_fc", "mlp.c_proj": "mlp_proj"}


def hf_to_own_name(hf_name: str) -> str | None:
    """Map an HF GPT-2 weight name to ours; None for buffers and the tied lm_head."""
    if hf_name.endswith((".attn.bias", ".attn.masked_bias")) or hf_name.startswith("lm_head"):
        return None
    for hf, own in _RENAMES.items():
        hf_name = hf_name.replace(f".{hf}.", f".{own}.")
    return hf_name


def _check_supported(config: GPT2Config) -> None:
    if config.model_type != "gpt2":
        raise ValueError(f"model_type {config.model_type!r} is not GPT-2")
    if getattr(config, "scale_attn_by_inverse_layer_idx", False) or getattr(config, "reorder_and_upcast_attn", False):
        raise ValueError("scale_attn_by_inverse_layer_idx / reorder_and_upcast_attn are not supported")
    if not getattr(config, "scale_attn_weights", True):
        raise ValueError("scale_attn_weights=False is not supported")
    if config.activation_function not in ("gelu_new", "gelu_pytorch_tanh"):
        raise ValueError(f"activation {config.activation_function!r} is not supported")
