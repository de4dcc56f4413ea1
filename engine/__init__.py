"""rayinfer's inference engine: GPT-2 over a paged KV cache with continuous batching.

Knows nothing of Ray or HTTP. The public API:

    LLM(model, weights=..., dtype=..., device=..., seed=..., **EngineConfig fields)
        .generate(prompts, sampling_params) -> [CompletionOutput(token_ids, text, finish_reason,
                                                 logprobs, cumulative_logprob, prompt_logprobs)]
    SamplingParams(max_tokens, temperature, top_p, top_k, min_p, seed, stop, stop_token_ids,
                   ignore_eos, min_tokens, presence/frequency/repetition_penalty, logit_bias,
                   logprobs, prompt_logprobs, n, best_of)
        .fan_out() -> one SamplingParams per sequence to run; select_best(cumulative, n)
    AsyncEngine(EngineConfig(...)).generate(request_id, prompt_token_ids, params) -> GenerationChunks
    LoRA (EngineConfig max_loras > 0; docs/lora.md): add_lora(name, path), remove_lora(name),
        list_loras(), lora_stats() on LLMEngine and AsyncEngine; a request's lora_name=
    TokenLogprob(token_id, logprob, top): a logprob of the model's raw distribution
"""

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.frontend.async_engine import AsyncEngine
    from engine.config import EngineConfig
    from engine.frontend.llm import LLM, CompletionOutput
    from engine.core.llm_engine import LLMEngine
    from engine.request.token_logprob import TokenLogprob
    from engine.request.outputs import (
        ChunkTimings, EngineDeadError, EngineOverloadedError, EngineStats, GenerationChunk, ModelInfo,
    )
    from engine.request.sampling_params import SamplingParams, select_best

# Each name's module, imported on first use: the processes that only check requests or
# tokenize (the tokenizer replicas, an Ingress apart from the engine) import
# `engine.request.request_rules` and the like without paying for torch and the model's code.
_HOMES = {
    "AsyncEngine": "engine.frontend.async_engine",
    "EngineConfig": "engine.config",
    "LLM": "engine.frontend.llm",
    "CompletionOutput": "engine.frontend.llm",
    "LLMEngine": "engine.core.llm_engine",
    "TokenLogprob": "engine.request.token_logprob",
    "ChunkTimings": "engine.request.outputs",
    "EngineDeadError": "engine.request.outputs",
    "EngineOverloadedError": "engine.request.outputs",
    "EngineStats": "engine.request.outputs",
    "GenerationChunk": "engine.request.outputs",
    "ModelInfo": "engine.request.outputs",
    "SamplingParams": "engine.request.sampling_params",
    "select_best": "engine.request.sampling_params",
}


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    return getattr(importlib.import_module(_HOMES[name]), name)


__all__ = list(_HOMES)
