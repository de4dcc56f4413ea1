"""rayinfer's inference engine: GPT-2 over a paged KV cache with continuous batching.

Knows nothing of Ray or HTTP. The public API:

    LLM(model, weights=..., dtype=..., device=..., seed=..., **EngineConfig fields)
        .generate(prompts, sampling_params) -> [CompletionOutput(token_ids, text, finish_reason)]
    SamplingParams(max_tokens, temperature, top_p, top_k, seed, stop, ignore_eos, ...)
    AsyncEngine(EngineConfig(...)).generate(request_id, prompt_token_ids, params) -> chunks
"""

from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.llm import LLM, CompletionOutput
from engine.llm_engine import LLMEngine
from engine.outputs import (
    ChunkTimings, EngineDeadError, EngineOverloadedError, EngineStats, GenerationChunk, ModelInfo,
)
from engine.sampling_params import SamplingParams

__all__ = [
    "LLM",
    "AsyncEngine",
    "ChunkTimings",
    "CompletionOutput",
    "EngineConfig",
    "EngineDeadError",
    "EngineOverloadedError",
    "EngineStats",
    "GenerationChunk",
    "LLMEngine",
    "ModelInfo",
    "SamplingParams",
]
