"""The OpenAI wire format's request side: the bodies the routes accept, validated strictly.

Each body knows what it asks of the tokenizer (`encode_requests`: one per prompt) and of
the engine (`choice_params`), and checks its rules across fields (`check`); the fields it
refuses are in deployments/api/unsupported.py. The response side is deployments/api/responses.py
and deployments/api/sse.py.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field
from pydantic.fields import FieldInfo

from deployments.api.encoding import ChatMessage, EncodeRequest, apply_chat_template
from deployments.api.errors import ApiError
from deployments.api.structured_outputs import StructuredOutputFields
from deployments.api.unsupported import NO_CHAT_TEMPLATE, NO_TOOLS, ChatRefusals, CompletionRefusals, refused
from engine import SamplingParams
from engine.request.sampling_params import nth_seed
from engine.request import sampling_limits as limits
from engine.request.sampling_limits import MAX_STOP_STRINGS, Bound

MAX_N = 8


class _Body(BaseModel):
    # An unknown field is a 400 naming it (deployments/api/errors.py): never silently dropped.
    model_config = ConfigDict(strict=True, extra="forbid")


class StreamOptions(_Body):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False  # vLLM's: usage on every chunk too


def within(bound: Bound, **tighter: float) -> FieldInfo:
    """A field's limits from engine/request/sampling_limits.py (the engine checks the same ones),
    optionally narrowed for HTTP clients (e.g. n <= MAX_N)."""
    return Field(**{**bound.constraints(), **tighter})


Penalty = Annotated[float, within(limits.PENALTY)]
TokenId = Annotated[int, within(limits.TOKEN_ID)]
Logprobs = Annotated[int, within(limits.LOGPROBS)]
# A token id as JSON object keys must be: ASCII decimal digits, no sign, no leading zero (so
# two keys never name one token), at most int64's 19 digits. Python's int() would also take
# " 7", "+7", "07" and Unicode digits such as "٧", and fail on "²".
TokenIdKey = Annotated[str, Field(pattern=r"^(0|[1-9][0-9]{0,18})$")]


class SamplingBody(StructuredOutputFields):
    """What completions and chat share: everything but the prompt, its length limit and
    the logprobs fields (whose shapes differ). Structured outputs' fields:
    deployments/api/structured_outputs.py."""

    model: str | None = None
    temperature: Annotated[float, within(limits.TEMPERATURE)] | None = None  # None: 1
    top_p: Annotated[float, within(limits.TOP_P)] | None = None  # None: 1
    top_k: Annotated[int, within(limits.TOP_K)] | None = None
    min_p: Annotated[float, within(limits.MIN_P)] | None = None
    seed: Annotated[int, within(limits.SEED)] | None = None
    stop: str | Annotated[list[Annotated[str, Field(min_length=1)]], Field(max_length=MAX_STOP_STRINGS)] | None = None
    stop_token_ids: list[TokenId] | None = None
    include_stop_str_in_output: bool = False
    n: Annotated[int, within(limits.NUM_SEQUENCES, le=MAX_N)] | None = None
    ignore_eos: bool = False
    min_tokens: Annotated[int, within(limits.MIN_TOKENS)] = 0
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: Annotated[float, within(limits.REPETITION_PENALTY)] | None = None
    logit_bias: dict[TokenIdKey, Annotated[float, within(limits.LOGIT_BIAS)]] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    # OpenAI: an end-user id for abuse monitoring; no effect on output. It names the tenant
    # where the operator opts in (tenant_by_user) and no API keys are set.
    user: str | None = None
    # vLLM's: lower runs earlier; within the engine's priority_range (only 0 under fcfs).
    priority: int = 0
    add_special_tokens: bool | None = None  # GPT-2's tokenizer adds none either way

    @property
    def num_choices(self) -> int:
        return self.n or 1

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return self.include_usage and bool(self.stream_options.continuous_usage_stats)

    def check(self) -> None:
        """The rules across fields, each a 400 naming the field."""
        if self.stream_options is not None and not self.stream:
            raise ApiError(400, "stream_options: only allowed with stream true", param="stream_options")
        if self.constraint is not None and self.min_tokens:
            raise ApiError(400, f"min_tokens: must be 0 with structured outputs ({self.constraint.param}): "
                                "the constraint says where the output ends", param="min_tokens")

    def sampling_params(self, max_tokens: int, index: int, logprobs: int | None = None,
                        prompt_logprobs: int | None = None) -> SamplingParams:
        stop = [self.stop] if isinstance(self.stop, str) else self.stop or []
        seed = nth_seed(self.seed, index)  # n choices must differ
        return SamplingParams(
            max_tokens=max_tokens, temperature=_or(self.temperature, 1.0), top_p=_or(self.top_p, 1.0),
            top_k=_or(self.top_k, 0), min_p=_or(self.min_p, 0.0), seed=seed, stop=tuple(stop),
            stop_token_ids=tuple(self.stop_token_ids or ()), ignore_eos=self.ignore_eos,
            min_tokens=self.min_tokens, presence_penalty=_or(self.presence_penalty, 0.0),
            frequency_penalty=_or(self.frequency_penalty, 0.0), repetition_penalty=_or(self.repetition_penalty, 1.0),
            logit_bias={int(k): v for k, v in self.logit_bias.items()} if self.logit_bias else None,
            logprobs=logprobs, prompt_logprobs=prompt_logprobs, constraint=self.constraint)


def _or(value, default):
    return default if value is None else value


TextPrompt = Annotated[str, Field(min_length=1)]
IdsPrompt = Annotated[list[TokenId], Field(min_length=1)]


class CompletionBody(SamplingBody, CompletionRefusals):
    # OpenAI's four shapes: a string, a list of strings, token ids, a list of token-id lists.
    prompt: (TextPrompt | Annotated[list[TextPrompt], Field(min_length=1)] | IdsPrompt
             | Annotated[list[IdsPrompt], Field(min_length=1)])
    max_tokens: Annotated[int, within(limits.MAX_TOKENS)] | None = 16  # 0 only with echo: the prompt alone
    echo: bool | None = False
    logprobs: Logprobs | None = None
    best_of: Annotated[int, within(limits.NUM_SEQUENCES)] | None = None

    @property
    def prompts(self) -> list[str | list[int]]:
        one = isinstance(self.prompt, str) or isinstance(self.prompt[0], int)
        return [self.prompt] if one else list(self.prompt)

    def check(self) -> None:
        super().check()
        if self.max_tokens == 0 and not self.echo:
            raise ApiError(400, "max_tokens: 0 is only allowed with echo (the prompt alone)", param="max_tokens")
        if self.best_of is not None and self.best_of != self.num_choices:
            raise ApiError(400, f"best_of: only best_of == n ({self.num_choices}) is supported: rayinfer does "
                           "not rank extra sequences", param="best_of")

    def encode_requests(self, max_model_len: int) -> list[EncodeRequest]:
        return [EncodeRequest(prompt=p, max_tokens=_or(self.max_tokens, 16), max_model_len=max_model_len)
                for p in self.prompts]

    def choice_params(self, max_tokens: int, index: int) -> SamplingParams:
        # echo with logprobs scores the prompt too; max_tokens 0 needs the engine to score it anyway.
        prompt_logprobs = self.logprobs if self.echo else None
        if self.echo and max_tokens == 0 and prompt_logprobs is None:
            prompt_logprobs = 0
        return self.sampling_params(max_tokens, index, self.logprobs, prompt_logprobs)


class TextPart(_Body):
    type: Literal["text"]
    text: str


class MessageBody(_Body):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | Annotated[list[TextPart], Field(min_length=1)]

    @property
    def text(self) -> str:
        """Text parts joined by newlines, as vLLM joins them."""
        return self.content if isinstance(self.content, str) else "\n".join(p.text for p in self.content)


class ChatBody(SamplingBody, ChatRefusals):
    messages: Annotated[list[MessageBody], Field(min_length=1)]
    max_tokens: Annotated[int, within(limits.NEW_TOKENS)] | None = None  # None: the rest of the context
    max_completion_tokens: Annotated[int, within(limits.NEW_TOKENS)] | None = None
    logprobs: bool | None = False
    top_logprobs: Logprobs | None = None
    # Accepted, with no effect on the output by their definitions: tools are refused, nothing
    # is stored, there is one service tier, the prefix cache needs no key, GPT-2 has no reasoning.
    parallel_tool_calls: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: Literal["auto", "default"] | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    include_reasoning: bool | None = None

    def check(self) -> None:
        super().check()
        if self.top_logprobs is not None and not self.logprobs:
            raise ApiError(400, "top_logprobs: needs logprobs true", param="top_logprobs")

    def encode_requests(self, max_model_len: int) -> list[EncodeRequest]:
        messages = [ChatMessage(m.role, m.text) for m in self.messages]
        named = "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"
        return [EncodeRequest(messages=messages, max_tokens=self.max_completion_tokens or self.max_tokens,
                              max_model_len=max_model_len, max_tokens_param=named)]

    def choice_params(self, max_tokens: int, index: int) -> SamplingParams:
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self.sampling_params(max_tokens, index, logprobs)


class GenerateBody(_Body):
    prompt: Annotated[str, Field(min_length=1)]
    max_new_tokens: Annotated[int, within(limits.NEW_TOKENS)] = 16
    stream: bool = False
    temperature: Annotated[float, within(limits.TEMPERATURE)] = 1.0
    top_k: Annotated[int, within(limits.TOP_K)] = 0
    top_p: Annotated[float, within(limits.TOP_P)] = 1.0
    stop_on_eos: bool = True

    def encode_request(self, max_model_len: int) -> EncodeRequest:
        return EncodeRequest(prompt=self.prompt, max_tokens=self.max_new_tokens, max_model_len=max_model_len,
                             max_tokens_param="max_new_tokens")

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        return SamplingParams(max_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p,
                              top_k=self.top_k, ignore_eos=not self.stop_on_eos)


OpenAIBody = CompletionBody | ChatBody  # the bodies whose routes share one body of code


class TokenizeBody(_Body):
    """vLLM's POST /tokenize: a prompt, or chat messages through rayinfer's chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[MessageBody], Field(min_length=1)] | None = None
    add_special_tokens: bool | None = None  # GPT-2's tokenizer adds none either way
    return_token_strs: bool | None = False
    add_generation_prompt: refused(NO_CHAT_TEMPLATE, True) = None
    continue_final_message: refused(NO_CHAT_TEMPLATE, False) = None
    chat_template: refused(NO_CHAT_TEMPLATE) = None
    chat_template_kwargs: refused(NO_CHAT_TEMPLATE, {}) = None
    tools: refused(NO_TOOLS, []) = None

    def text(self) -> str:
        if (self.prompt is None) == (self.messages is None):
            raise ApiError(400, "prompt: give exactly one of prompt and messages", param="prompt")
        if self.messages is None:
            return self.prompt
        return apply_chat_template([ChatMessage(m.role, m.text) for m in self.messages])


class DetokenizeBody(_Body):
    model: str | None = None
    tokens: list[TokenId]


class LoadLoraBody(_Body):
    """vLLM's POST /v1/load_lora_adapter (its `load_inplace` is not taken: unload, then load)."""

    lora_name: Annotated[str, Field(min_length=1)]
    lora_path: Annotated[str, Field(min_length=1)]  # inside the app's lora_dir (deployments/api/lora_catalog.py)


class UnloadLoraBody(_Body):
    """vLLM's POST /v1/unload_lora_adapter (by name; vLLM's `lora_int_id` is not taken)."""

    lora_name: Annotated[str, Field(min_length=1)]
