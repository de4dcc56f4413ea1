"""The rules a request must meet to ever run, each stated once.

The engine checks them when a request is added; the tokenizer deployment checks the
prompt rules before a request reaches the engine, so a bad prompt is a 400 naming its
field. A broken rule raises InvalidRequestError (engine/request/invalid_request.py) naming the field.
"""

from __future__ import annotations

from collections.abc import Container, Iterable, Sequence

from engine.request.invalid_request import InvalidRequestError
from engine.request.sampling_params import SamplingParams
from engine.request.scheduling import Scheduling

CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"


def check_request_id_free(request_id: str, in_use: Container[str]) -> None:
    if request_id in in_use:
        raise InvalidRequestError(f"request id {request_id!r} is already in use", "request_id")


def check_prompt(token_ids: Sequence[object], vocab_size: int, param: str = "prompt") -> None:
    if not token_ids:
        raise InvalidRequestError(f"{param} must not be empty", param)
    check_token_ids(token_ids, vocab_size, param)


def check_token_ids(token_ids: Iterable[object], vocab_size: int, param: str) -> None:
    """Every id a token of the vocabulary: prompts, stop_token_ids, logit_bias, /detokenize."""
    if any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size for t in token_ids):
        raise InvalidRequestError(f"{param}: token ids must be integers in [0, {vocab_size})", param)


def check_params(params: object, vocab_size: int) -> None:
    """Each field within its limit again (the params may not have been constructed here),
    then what SamplingParams cannot check alone: token ids against the vocabulary, and one
    sequence per engine request."""
    if not isinstance(params, SamplingParams):
        raise InvalidRequestError(f"params must be SamplingParams, got {type(params).__name__}", "params")
    params.validate()
    check_token_ids(params.stop_token_ids, vocab_size, "stop_token_ids")
    check_token_ids(params.logit_bias or (), vocab_size, "logit_bias")
    if params.num_sequences > 1 or params.best_of is not None:
        raise InvalidRequestError(f"n ({params.n}) and best_of ({params.best_of}) describe several sequences; "
                                  "the engine runs one per request: submit each of params.fan_out()", "n")


def check_context(num_prompt_tokens: int, max_tokens: int, max_model_len: int, param: str = "prompt",
                  max_tokens_param: str = "max_tokens") -> None:
    """Prompt and output within the context (max_tokens 0: the prompt alone, scored); the
    params name the request's fields for each (/generate calls max_tokens max_new_tokens)."""
    if num_prompt_tokens + max_tokens <= max_model_len:
        return
    if num_prompt_tokens >= max_model_len:
        raise InvalidRequestError(f"{param} is {num_prompt_tokens} tokens, the model's context is {max_model_len}: "
                                  "no room to generate", param, CONTEXT_LENGTH_EXCEEDED)
    raise InvalidRequestError(f"{param} ({num_prompt_tokens} tokens) + {max_tokens_param} ({max_tokens}) exceeds the "
                              f"model's context of {max_model_len} tokens", max_tokens_param, CONTEXT_LENGTH_EXCEEDED)


def check_scheduling(scheduling: object, priority_range: tuple[int, int]) -> None:
    """A priority within the configured range (fcfs: 0 only, it orders nothing), a tenant
    weight above zero."""
    if not isinstance(scheduling, Scheduling):
        raise InvalidRequestError(f"scheduling must be Scheduling, got {type(scheduling).__name__}", "scheduling")
    check_priority(scheduling.priority, priority_range)
    if not (isinstance(scheduling.weight, (int, float)) and scheduling.weight > 0):
        raise InvalidRequestError(f"tenant weight must be > 0, got {scheduling.weight!r}", "scheduling")


def check_priority(priority: object, priority_range: tuple[int, int]) -> None:
    low, high = priority_range
    if isinstance(priority, bool) or not isinstance(priority, int) or not low <= priority <= high:
        detail = "only 0: the scheduling policy is fcfs" if low == high == 0 else f"an integer in [{low}, {high}]"
        raise InvalidRequestError(f"priority must be {detail}, got {priority!r}", "priority")


def check_kv_blocks(num_tokens: int, block_size: int, num_blocks: int) -> None:
    needed = -(-num_tokens // block_size)
    if needed > num_blocks:
        raise InvalidRequestError(f"request needs {needed} KV blocks but the cache holds {num_blocks}; "
                                  "lower max_tokens or raise num_kv_blocks", "max_tokens")


def check_fits_waiting_bounds(num_requests: int, num_prompt_tokens: int, max_waiting_requests: int | None,
                              max_waiting_tokens: int | None, param: str = "prompt") -> None:
    """Whether a request of num_requests engine requests (prompts x n) and num_prompt_tokens
    prompt tokens in all could ever be admitted at once under the engine's overload bounds
    (engine/frontend/admission.py). One that could not is refused for good: a retry would only meet
    the same 429 again."""
    if max_waiting_requests is not None and num_requests > max_waiting_requests:
        raise InvalidRequestError(f"this request runs as {num_requests} engine requests (prompts x n), "
                                  f"more than max_waiting_requests ({max_waiting_requests}) admits at once; "
                                  "send fewer prompts or a lower n", param)
    if max_waiting_tokens is not None and num_prompt_tokens > max_waiting_tokens:
        raise InvalidRequestError(f"this request's prompts are {num_prompt_tokens} tokens in all "
                                  f"(prompts x n), more than max_waiting_tokens ({max_waiting_tokens}) admits "
                                  "at once; send shorter or fewer prompts or a lower n", param)
