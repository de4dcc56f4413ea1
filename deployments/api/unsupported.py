"""Request fields that OpenAI or vLLM define and rayinfer cannot honour: each is accepted
only at its no-op value (null, or the value that asks for nothing), and anything else is a
400 naming the field and saying why. A field no one defines is a 400 too (the bodies
forbid extra fields). Never accepted and silently ignored: a client that asks for
something and silently gets something else gets wrong results.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict, WithJsonSchema
from pydantic_core import PydanticCustomError


def refused(reason: str, *no_ops: Any) -> Any:
    """A field type that takes null or one of `no_ops`, else fails naming `reason`; its JSON
    schema (in /openapi.json) says so, so that a client or a fuzzer reading it knows."""

    def check(value: Any) -> Any:
        if value is None or any(value == v and type(value) is type(v) for v in no_ops):
            return value
        raise PydanticCustomError("unsupported", "not supported: {reason}", {"reason": reason})

    schema = {"anyOf": [{"type": "null"}, *({"const": v} for v in no_ops)],
              "description": f"not supported: {reason}; only null or the value that asks for nothing"}
    return Annotated[Any, AfterValidator(check), WithJsonSchema(schema)]


NO_TOOLS = "GPT-2 has no tool calling"
NO_MULTIMODAL = "text only"
NO_CHAT_TEMPLATE = "GPT-2 has no chat template; rayinfer's fixed one is in docs/api.md"
NO_BEAM = "no beam search"


class CompletionRefusals(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    """Mixed into the completions body: its fields that must stay at their no-op values."""

    suffix: refused("GPT-2 has no fill-in-the-middle", "") = None
    use_beam_search: refused(NO_BEAM, False) = None
    length_penalty: refused(NO_BEAM, 1.0, 1) = None
    truncate_prompt_tokens: refused("prompts are never truncated: an over-long one is a 400") = None
    truncation_side: refused("prompts are never truncated: an over-long one is a 400") = None
    allowed_token_ids: refused("use logit_bias") = None
    bad_words: refused("use logit_bias", []) = None
    prompt_logprobs: refused("use echo with logprobs: the prompt's logprobs in the choice's logprobs") = None
    logprob_token_ids: refused("logprobs are the top-k only") = None
    return_tokens_as_token_ids: refused("tokens are returned as text", False) = None
    return_token_ids: refused("tokens are returned as text", False) = None
    skip_special_tokens: refused("special tokens are always skipped in text", True) = None
    spaces_between_special_tokens: refused("special tokens are always skipped in text", True) = None
    request_id: refused("rayinfer names its requests") = None
    cache_salt: refused("the prefix cache has no per-tenant salt") = None
    kv_transfer_params: refused("no disaggregated prefill") = None
    vllm_xargs: refused("no extension arguments") = None
    prompt_embeds: refused("prompts are text or token ids") = None


class ChatRefusals(CompletionRefusals):
    """The chat body's: the completions body's, plus chat's own."""

    tools: refused(NO_TOOLS, []) = None
    tool_choice: refused(NO_TOOLS, "none") = None
    functions: refused(NO_TOOLS, []) = None
    function_call: refused(NO_TOOLS, "none") = None
    echo: refused("chat echo is not supported; use /v1/completions with echo", False) = None
    add_generation_prompt: refused(NO_CHAT_TEMPLATE, True) = None
    continue_final_message: refused(NO_CHAT_TEMPLATE, False) = None
    chat_template: refused(NO_CHAT_TEMPLATE) = None
    chat_template_kwargs: refused(NO_CHAT_TEMPLATE, {}) = None
    documents: refused(NO_CHAT_TEMPLATE, []) = None
    store: refused("completions are not stored", False) = None
    audio: refused(NO_MULTIMODAL) = None
    modalities: refused(NO_MULTIMODAL, ["text"]) = None
    prediction: refused("no predicted outputs") = None
    reasoning_effort: refused("GPT-2 does not reason") = None
    verbosity: refused("GPT-2 has no verbosity control") = None
    web_search_options: refused("no web search") = None
    prompt_cache_retention: refused("the prefix cache keeps blocks while memory allows") = None
    mm_processor_kwargs: refused(NO_MULTIMODAL) = None
    media_io_kwargs: refused(NO_MULTIMODAL) = None
