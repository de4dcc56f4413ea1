"""Which implementation an engine's hot ops run, as its config asks and this machine allows:
our C++ kernels (engine/kernels/native.py) or torch's. `auto` takes ours on CPU where they load and
falls back where they don't (engine/kernels/native.py logs why, once; each op here what it runs
instead); `native` is an error where they can't run. Where both run, the measured choices
(apply_measured_choices) then decide how far each is used on this machine."""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

import engine.core.tuning_cache as tuning_cache
import engine.kernels.native as native
import engine.kernels.native_attention as native_attention
from engine.lora.lora_linear import load_kernel as load_lora_kernel
from engine.model.attention import decode_attention_with_own
from engine.config import EngineConfig, KernelChoice, LinearChoice
from engine.core.step_threads import StepThreads
from engine.core.tuner import Tuning, graph_or_eager, tune
from engine.model.decode_graph import DecodeGraph
from engine.model.gpt2 import GPT2LMHead
from engine.model.packed_linear import PackedLinear, can_pack, load_few_rows, runs_brgemm
from engine.sampling.sampler import Draw, Sampler

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


def lora_kernel(config: EngineConfig) -> bool:
    """Whether steps run their rows' LoRA updates on our C++ op (engine/lora/lora_linear.py):
    on CPU, in bf16 or fp32, where our kernels load; else torch's forms of the same."""
    if config.torch_device.type != "cpu" or config.torch_dtype not in (torch.bfloat16, torch.float32):
        return False
    try:
        load_lora_kernel()
    except Exception:  # noqa: BLE001 - native.load has logged why, once
        logger.info("LoRA: our C++ kernel is not available; each row's update runs on torch ops")
        return False
    return True


def use_forced_linear(config: EngineConfig, model: GPT2LMHead) -> GPT2LMHead:
    """The model; with small_batch_linear: brgemm, every small step of every packed linear on
    oneDNN's brgemm ukernel, an error where it cannot run (no bf16 panels, or no avx512_core)."""
    if config.small_batch_linear != "brgemm":
        return model
    if not (isinstance(model.lm_head, PackedLinear) and runs_brgemm(model.lm_head)):
        raise ValueError("small_batch_linear: brgemm needs bf16 weights in panels (AVX-512 BF16) on a CPU where "
                         "oneDNN's brgemm ukernel runs bf16 (avx512_core or newer)")
    _set_linear_limits(model, 0, 64)
    logger.info("small_batch_linear: small steps on oneDNN's brgemm ukernel")
    return model


def apply_measured_choices(config: EngineConfig, model: GPT2LMHead, step_threads: StepThreads,
                           graph: DecodeGraph | None = None, kv_pool: torch.Tensor | None = None,
                           sampler: Sampler | None = None) -> Tuning | None:
    """The `auto` choices the tuner measures (engine/core/tuner.py: small_batch_linear's
    crossover, one_thread_max_tokens, the decode graph's attention on kv_pool, and the
    draw of the graph's sampler, where ours runs), from its cache or measured now, set on
    the model's linears, the engine's step threads and the graph (not yet compiled; the
    caller swaps the sampler where tuning.sampler is "torch"); None where nothing is `auto` here.

    Called before the decode graph is traced, on the thread that compiles it, beside steps
    that may be running: each value is one attribute the step loop reads whole, and the old
    value and the new are both correct, the new one faster."""
    linears = config.small_batch_linear == "auto" and isinstance(model.lm_head, PackedLinear) and model.lm_head.few_rows
    on_cpu = config.torch_device.type == "cpu"
    threads = config.cpu_threads if config.one_thread_max_tokens == "auto" and on_cpu else None
    attention = (config.decode_attention == "auto" and graph is not None and kv_pool is not None
                 and graph.attention is not decode_attention_with_own)  # where ours built: both run
    draws = config.sampler == "auto" and graph is not None and sampler is not None and sampler.native is not None
    if not linears and threads is None and not attention and not draws:
        return None
    hf = model.config
    key = tuning_cache.tuning_key(
        config.torch_dtype, config.cpu_threads,
        _model_shapes(hf),
        {"small_batch_linear": linears, "one_thread_max_tokens": threads is not None, "decode_attention": attention,
         "kv_pool": list(kv_pool.shape) if attention else None, "sampler": draws})
    tuning = _load_or_measure(key, lambda: tune(model, linears, threads, kv_pool if attention else None,
                                                draw_vocab=hf.vocab_size if draws else None))
    _apply(tuning, model, step_threads, graph)
    return tuning


def choose_graph_or_eager(config: EngineConfig, model: GPT2LMHead, graph: DecodeGraph, kv_pool: torch.Tensor,
                          measure: bool) -> Tuning | None:
    """Where compile_decode is auto on CPU, per step size the compiled graph or its step run
    eagerly (tuner.graph_or_eager), set on the graph: from the cache, or measured now where
    `measure` (the graph has compiled) and the cache has none; None where nothing is chosen.
    Keyed by what shapes the graph: the linears' and attention's choices already applied."""
    if config.compile_decode != "auto" or config.torch_device.type != "cpu":
        return None
    limits = sorted({(layer.max_rows, layer.brgemm_rows) for layer in model.modules() if isinstance(layer, PackedLinear)})
    key = tuning_cache.tuning_key(
        config.torch_dtype, config.cpu_threads,
        _model_shapes(model.config),
        {"graph_or_eager": True, "linears": config.linears, "small_batch_linear": config.small_batch_linear,
         "linear_limits": limits, "decode_attention": "torch" if graph.attention is decode_attention_with_own else "ours",
         "argmax_in_graph": graph.argmax_in_graph, "max_loras": config.max_loras, "max_num_seqs": config.max_num_seqs,
         "kv_pool": list(kv_pool.shape)})
    tuning = _load_or_measure(key, (lambda: graph_or_eager(graph, kv_pool, config.max_num_seqs)) if measure else None)
    if tuning is not None and tuning.graph_or_eager:
        graph.use_eager_at(tuning.graph_or_eager)
    return tuning


def _load_or_measure(key: tuning_cache.TuningKey, measure: Callable[[], Tuning] | None) -> Tuning | None:
    """The table saved under `key`, or measure()'s (under no grad; saved where complete), each
    logged; None where none is saved and measure is None."""
    tuning = tuning_cache.load(key)
    if tuning is not None:
        tuning.log("loaded from the cache")
    elif measure is not None:
        with torch.no_grad():
            tuning = measure()
        where = f"saved to {tuning_cache.save(key, tuning)}" if tuning.complete else "over its time budget, not cached"
        tuning.log(f"measured, {where}")
    return tuning


def _model_shapes(hf) -> dict[str, int]:
    return {"n_layer": hf.n_layer, "n_embd": hf.n_embd, "n_inner": hf.n_inner or 4 * hf.n_embd, "vocab": hf.vocab_size}


def _apply(tuning: Tuning, model: GPT2LMHead, step_threads: StepThreads, graph: DecodeGraph | None) -> None:
    if tuning.decode_attention == "torch" and graph is not None:
        graph.use_attention(decode_attention_with_own)
    if tuning.sampler == "torch" and graph is not None:
        graph.use_argmax_in_graph(True)
    if tuning.linear_max_rows is not None:
        _set_linear_limits(model, tuning.linear_max_rows, tuning.linear_brgemm_rows or 0)
    if tuning.one_thread_max_tokens is not None:
        step_threads.one_thread_max_tokens = tuning.one_thread_max_tokens


def _set_linear_limits(model: GPT2LMHead, max_rows: int, brgemm_rows: int) -> None:
    for layer in model.modules():
        if isinstance(layer, PackedLinear):
            layer.max_rows, layer.brgemm_rows = max_rows, brgemm_rows


def _wants_native(option: str, choice: KernelChoice | LinearChoice, fits: bool, why_not: str) -> bool:
    if choice in ("native", "brgemm") and not fits:
        raise ValueError(f"{option}: {choice} {why_not}")
    return choice != "torch" and fits


def _fall_back(option: str, choice: KernelChoice | LinearChoice, exc: Exception, instead: str) -> None:
    if choice in ("native", "brgemm"):
        raise ValueError(f"{option}: {choice}: the C++ kernel did not build here ({exc!r})") from exc
    logger.info("%s: our C++ kernel is not available; %s", option, instead)
