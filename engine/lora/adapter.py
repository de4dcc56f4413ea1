"""A LoRA adapter read from PEFT's format and checked against the base model, at load time.

PEFT's `save_pretrained` writes a directory with `adapter_config.json` and
`adapter_model.safetensors` (or `adapter_model.bin`). On GPT-2 the targets are Conv1D
(`fan_in_fan_out`), but PEFT stores lora_A as [r, in] and lora_B as [out, r] either way, and
the update is scaling * x @ A.T @ B.T with scaling lora_alpha / r (rsLoRA: / sqrt(r)).
Whatever this engine cannot serve exactly as PEFT computes it is refused here, by name.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file
from transformers import GPT2Config

# PEFT's module name -> ours (engine/model/gpt2.py). `c_proj` in target_modules names both.
HF_MODULES = {"attn.c_attn": "attn_qkv", "attn.c_proj": "attn_out", "mlp.c_fc": "mlp_fc", "mlp.c_proj": "mlp_proj"}
MODULE_KINDS = tuple(HF_MODULES.values())
TARGETS = {"c_attn": ("attn_qkv",), "c_proj": ("attn_out", "mlp_proj"), "c_fc": ("mlp_fc",)}

# Config options that change what the adapter computes; any set to a truthy value is refused.
_UNSUPPORTED_OPTIONS = (
    "use_dora", "layers_to_transform", "layers_pattern", "rank_pattern", "alpha_pattern", "modules_to_save",
    "layer_replication", "lora_bias", "trainable_token_indices", "use_qalora", "alora_invocation_tokens",
    "target_parameters", "exclude_modules", "use_bdlora",
)
_KEY = re.compile(r"base_model\.model\.transformer\.h\.(\d+)\.(attn\.c_attn|attn\.c_proj|mlp\.c_fc|mlp\.c_proj)"
                  r"\.lora_([AB])\.weight")


class LoraAdapterError(ValueError):
    """An adapter this engine refuses to load; the message names the adapter and the problem."""


@dataclass(frozen=True)
class LoraAdapter:
    """One adapter's weights on the CPU, in the model's orientation: per (layer, module kind),
    a [in, r] and b [r, out] with the scaling folded into b, so the update is x @ a @ b."""

    name: str
    path: str
    rank: int
    scaling: float
    target_modules: tuple[str, ...]  # PEFT's names, as the config lists them
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]
    # The prefix cache's seed for this adapter's blocks: a digest of its files, so that KV computed
    # under other weights (another adapter, or this name reloaded from changed files) is never shared.
    cache_seed: int


def load_adapter(name: str, path: str | Path, model: GPT2Config, max_rank: int) -> LoraAdapter:
    """Read and check the adapter at `path`; raises LoraAdapterError naming what it refuses."""
    directory = Path(path)
    config = _read_config(name, directory)
    rank, targets = _check_config(name, config, max_rank)
    weight_file = _weight_file(name, directory)
    tensors = _read_tensors(name, weight_file)
    alpha = config.get("lora_alpha", 8)
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    weights = _oriented(name, tensors, model, rank, targets, scaling)
    seed = _digest(directory / "adapter_config.json", weight_file)
    return LoraAdapter(name, str(directory), rank, scaling, tuple(config["target_modules"]), weights, seed)


def _read_config(name: str, directory: Path) -> dict:
    file = directory / "adapter_config.json"
    if not file.is_file():
        raise LoraAdapterError(f"LoRA adapter {name!r}: no adapter_config.json in {directory}")
    config = json.loads(file.read_text())
    if not isinstance(config, dict):
        raise LoraAdapterError(f"LoRA adapter {name!r}: adapter_config.json is not a JSON object")
    return config


def _check_config(name: str, config: dict, max_rank: int) -> tuple[int, set[str]]:
    """The rank and our module kinds the adapter targets."""
    where = f"LoRA adapter {name!r}"
    if config.get("peft_type", "LORA") != "LORA":
        raise LoraAdapterError(f"{where}: peft_type {config['peft_type']!r} is not LORA")
    for option in _UNSUPPORTED_OPTIONS:
        if config.get(option):
            raise LoraAdapterError(f"{where}: {option}={config[option]!r} is not supported")
    if config.get("bias", "none") != "none":
        raise LoraAdapterError(f"{where}: bias={config['bias']!r} is not supported (only 'none')")
    rank = config.get("r")
    if not isinstance(rank, int) or rank < 1:
        raise LoraAdapterError(f"{where}: rank r={rank!r} is not a positive integer")
    if rank > max_rank:
        raise LoraAdapterError(f"{where}: rank r={rank} exceeds max_lora_rank={max_rank}")
    targets = config.get("target_modules")
    if not isinstance(targets, list) or not targets:
        raise LoraAdapterError(f"{where}: target_modules={targets!r} must list module names (no regex)")
    unknown = sorted(set(targets) - set(TARGETS))
    if unknown:
        raise LoraAdapterError(f"{where}: target module(s) {unknown} not supported (GPT-2's: c_attn, c_proj, c_fc)")
    return rank, {kind for target in targets for kind in TARGETS[target]}


def _weight_file(name: str, directory: Path) -> Path:
    for file_name in ("adapter_model.safetensors", "adapter_model.bin"):
        if (directory / file_name).is_file():
            return directory / file_name
    raise LoraAdapterError(f"LoRA adapter {name!r}: no adapter_model.safetensors or adapter_model.bin in {directory}")


def _read_tensors(name: str, file: Path) -> dict[str, torch.Tensor]:
    try:
        if file.suffix == ".safetensors":
            return load_file(file)
        return torch.load(file, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - a corrupt or foreign file: refused like any other
        raise LoraAdapterError(f"LoRA adapter {name!r}: cannot read {file.name}: {exc}") from exc


def _oriented(name: str, tensors: dict[str, torch.Tensor], model: GPT2Config, rank: int, targets: set[str],
              scaling: float) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    """(layer, kind) -> (a [in, r], scaling * b [r, out]), every tensor's name and shape checked."""
    where = f"LoRA adapter {name!r}"
    found: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _KEY.fullmatch(key)
        if match is None:
            raise LoraAdapterError(f"{where}: weight {key!r} is not a LoRA A/B of c_attn, c_proj or c_fc")
        layer, kind = int(match[1]), HF_MODULES[match[2]]
        if layer >= model.n_layer or kind not in targets:
            raise LoraAdapterError(f"{where}: weight {key!r} outside the base model's layers or the adapter's targets")
        found.setdefault((layer, kind), {})[match[3]] = tensor
    expected = {(layer, kind) for layer in range(model.n_layer) for kind in targets}
    if set(found) != expected or any(set(pair) != {"A", "B"} for pair in found.values()):
        raise LoraAdapterError(f"{where}: weights do not cover every layer's {sorted(targets)} with both A and B")
    return {key: _pair(where, key, pair["A"], pair["B"], model, rank, scaling) for key, pair in found.items()}


def _pair(where: str, key: tuple[int, str], a: torch.Tensor, b: torch.Tensor, model: GPT2Config, rank: int,
          scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    fan_in, fan_out = module_shape(model, key[1])
    if tuple(a.shape) != (rank, fan_in) or tuple(b.shape) != (fan_out, rank):
        raise LoraAdapterError(
            f"{where}: layer {key[0]} {key[1]}: lora_A {tuple(a.shape)}, lora_B {tuple(b.shape)} do not fit the base "
            f"model's {fan_in} -> {fan_out} at rank {rank} (an adapter of a model of another shape?)")
    return a.float().t().contiguous(), (b.float() * scaling).t().contiguous()


def module_shape(model: GPT2Config, kind: str) -> tuple[int, int]:
    """(in, out) of one of a block's linears."""
    hidden = model.n_embd
    inner = model.n_inner or 4 * hidden
    return {"attn_qkv": (hidden, 3 * hidden), "attn_out": (hidden, hidden), "mlp_fc": (hidden, inner),
            "mlp_proj": (inner, hidden)}[kind]


def _digest(*files: Path) -> int:
    digest = hashlib.blake2b(digest_size=8)
    for file in files:
        digest.update(file.read_bytes())
    return int.from_bytes(digest.digest(), "big") >> 1  # non-negative, and never the base model's seed
