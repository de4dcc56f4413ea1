"""Which implementation an engine's hot ops run, as its config asks and this machine allows:
our C++ kernels (engine/kernels/native.py) or torch's. `auto` takes ours on CPU where they load and
falls back where they don't (engine/kernels/native.py logs why, once; each op here what it runs
instead); `native` is an error where they can't run."""

from __future__ import annotations

import logging

import engine.kernels.native as native
import engine.kernels.native_attention as native_attention
from engine.model.attention import decode_attention_with_own
from engine.config import EngineConfig, KernelChoice
from engine.model.packed_linear import can_pack, load_few_rows
from engine.sampling.sampler import Draw

logger = logging.getLogger(__name__)

def decode_attention(config: EngineConfig, head_dim: int) -> native_attention.DecodeAttention:
    """The decode graph's attention: our kernel, or the expression inductor compiles."""
    fits = config.torch_device.type == "cpu" and native_attention.supports(head_dim)
    if not _wants_native("decode_attention", config.decode_attention, fits,
                         f"runs on CPU with a head size that is a multiple of {native_attention.HEAD_DIM_MULTIPLE}, "
                         f"not {config.torch_device}, {head_dim}"):
        logger.info("decode attention: the PyTorch expression, compiled by inductor")
        return decode_attention_with_own
    try:
        return native_attention.load()
    except Exception as exc:  # noqa: BLE001 - no compiler, no ninja, a failed build: the expression instead
        _fall_back("decode_attention", config.decode_attention, exc, "inductor compiles the expression")
        return decode_attention_with_own


def sampler_draw(config: EngineConfig) -> Draw | None:
    """The sampler's draw: our kernel, or None for torch's (compiled with compile_decode)."""
    if not _wants_native("sampler", config.sampler, config.torch_device.type == "cpu",
                         f"runs on CPU, not {config.torch_device}"):
        return None
    try:
        return native.load().draw
    except Exception as exc:  # noqa: BLE001 - as decode_attention
        _fall_back("sampler", config.sampler, exc, "the draw runs on torch ops")
        return None


def small_batch_linear(config: EngineConfig) -> bool:
    """Whether packed linears take small steps on our kernels (engine/model/packed_linear.py)."""
    packs = config.linears == "auto" and can_pack(config.torch_device, config.torch_dtype)
    if not _wants_native("small_batch_linear", config.small_batch_linear, packs,
                         f"needs linears: auto on a CPU that packs {config.torch_dtype}"):
        return False
    try:
        load_few_rows()
    except Exception as exc:  # noqa: BLE001 - as decode_attention
        _fall_back("small_batch_linear", config.small_batch_linear, exc, "oneDNN's product for every step")
        return False
    logger.info("small_batch_linear: small steps on our C++ kernels")
    return True


def _wants_native(option: str, choice: KernelChoice, fits: bool, why_not: str) -> bool:
    if choice == "native" and not fits:
        raise ValueError(f"{option}: native {why_not}")
    return choice != "torch" and fits


def _fall_back(option: str, choice: KernelChoice, exc: Exception, instead: str) -> None:
    if choice == "native":
        raise ValueError(f"{option}: native: the C++ kernel did not build here ({exc!r})") from exc
    logger.info("%s: our C++ kernel is not available; %s", option, instead)
