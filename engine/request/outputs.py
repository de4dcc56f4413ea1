"""What the engine hands out: per-step outputs, stream chunks and their timings, model info, stats."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine.request.token_logprob import TokenLogprob

if TYPE_CHECKING:
    from engine.core.sequence import RequestTimings


class EngineDeadError(RuntimeError):
    """The engine's step loop crashed; every in-flight and future request fails with this."""


class RequestFailedError(RuntimeError):
    """One request failed inside a step (its grammar could not fill its mask or refused the
    token drawn): it alone ended, finish_reason "error"; the engine and the step's other
    requests go on. The engine's log names the failure's type under the request's id."""


class EngineOverloadedError(RuntimeError):
    """The engine's waiting bounds are full; retry after retry_after_s seconds."""

    def __init__(self, message: str, retry_after_s: float):
        super().__init__(message)
        self.retry_after_s = retry_after_s

    def __reduce__(self):  # keep retry_after_s across Ray's pickling
        return (type(self), (str(self), self.retry_after_s))


@dataclass(frozen=True, slots=True)
class StepOutput:
    """One request's result from one engine step: a new token, a finish, or both.

    A prompt-only request (max_tokens=0 with prompt_logprobs) has one output: no token,
    finish_reason "length". Logprobs: see engine/sampling/logprobs.py for what they are."""

    request_id: str
    token_id: int | None
    finish_reason: str | None  # "stop" | "length" | "abort" | "error" (RequestFailedError) | None while running
    num_prompt_tokens: int
    timings: RequestTimings
    logprob: TokenLogprob | None = None  # of token_id, where params.logprobs is set
    cumulative_logprob: float | None = None  # of the output so far, where params.logprobs is set
    # On the request's first output only, where params.prompt_logprobs is set: one entry per
    # prompt token, the first None (it has no prefix).
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None


@dataclass(frozen=True)
class ModelInfo:
    name: str
    weights: str  # "pretrained" | "random"
    max_model_len: int
    vocab_size: int
    eos_token_id: int
    dtype: str
    device: str
    # The engine's overload bounds (EngineConfig's): what a request of several prompts must fit at once.
    max_waiting_requests: int | None = None
    max_waiting_tokens: int | None = None
    priority_range: tuple[int, int] = (0, 0)  # the priorities a request may ask for (EngineConfig's, resolved)


@dataclass(frozen=True)
class EngineStats:
    num_running: int
    num_waiting: int
    num_kv_blocks_used: int
    num_kv_blocks_total: int
    prefix_cache_hit_rate: float
    num_preemptions: int
    num_prompt_tokens: int  # totals since start
    num_generated_tokens: int
    num_prefix_queried_tokens: int
    num_prefix_hit_tokens: int
    # Work still ahead of the live requests: prompt tokens not yet computed (a waiting
    # request's cached prefix counts until it is admitted) and tokens still to decode (up
    # to max_tokens): what a work-bounded router weighs replicas by.
    num_pending_prompt_tokens: int = 0
    num_pending_decode_tokens: int = 0
    # Structured outputs, totals since start: requests constrained, grammars compiled (not
    # found in the replica's cache) and the seconds compiling them took.
    num_constrained_requests: int = 0
    num_grammar_compiles: int = 0
    grammar_compile_s: float = 0.0
    # Speculative decoding, totals since start: proposed tokens verified, and those kept.
    num_spec_proposed_tokens: int = 0
    num_spec_accepted_tokens: int = 0
    taken_at: float = 0.0  # time.time() when these were read

    @property
    def kv_cache_usage(self) -> float:
        return self.num_kv_blocks_used / max(self.num_kv_blocks_total, 1)

    @property
    def spec_acceptance_rate(self) -> float:
        return self.num_spec_accepted_tokens / max(self.num_spec_proposed_tokens, 1)


@dataclass(frozen=True)
class ChunkTimings:
    """Where a request's time to first token went, in seconds, measured in the engine."""

    queue_wait_s: float  # arrival -> first scheduled
    prefill_s: float  # first scheduled -> first token
    ttft_s: float  # arrival -> first token

    @classmethod
    def of(cls, timings: RequestTimings) -> ChunkTimings | None:
        """None until the request has its first token."""
        if timings.first_token is None or timings.first_scheduled is None:
            return None
        return cls(timings.queue_wait_s, timings.prefill_s, timings.ttft_s)


@dataclass(frozen=True)
class GenerationChunk:
    """Every token of one request that was ready since the consumer's last chunk."""

    request_id: str
    token_ids: list[int]
    finish_reason: str | None  # set on the last chunk
    num_prompt_tokens: int
    timings: ChunkTimings | None = None  # on the first and the last chunk
    # Where params.logprobs is set: one per token_ids entry, and the output's total so far.
    logprobs: list[TokenLogprob] | None = None
    cumulative_logprob: float | None = None
    # On the first chunk, where params.prompt_logprobs is set: one per prompt token, the first None.
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None
