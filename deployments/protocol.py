"""The OpenAI wire format's request side: the bodies the routes accept, validated strictly.

Each body knows what it asks of the tokenizer (`encode_request`) and of the engine
(`sampling_params`); the response side is deployments/responses.py and deployments/sse.py.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt

from deployments.encoding import ChatMessage, EncodeRequest
from engine import SamplingParams
from engine.sampling_params import MAX_STOP_STRINGS

MAX_N = 8


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Body):
    include_usage: bool = False


class SamplingBody(_Body):
    """What completions and chat share: everything but the prompt and its length limit."""

    model: str | None = None
    temperature: Annotated[float, Field(ge=0, allow_inf_nan=False)] = 1.0
    top_p: Annotated[float, Field(gt=0, le=1)] = 1.0
    top_k: Annotated[int, Field(ge=-1)] = 0
    # torch seeds are 64-bit; seed + choice index must stay one.
    seed: Annotated[int, Field(ge=-(2**63), lt=2**63)] | None = None
    stop: str | Annotated[list[Annotated[str, Field(min_length=1)]], Field(max_length=MAX_STOP_STRINGS)] | None = None
    n: Annotated[int, Field(ge=1, le=MAX_N)] = 1
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None

    def sampling_params(self, max_tokens: int, index: int) -> SamplingParams:
        stop = [self.stop] if isinstance(self.stop, str) else self.stop or []
        seed = None if self.seed is None else self.seed + index  # n choices must differ
        return SamplingParams(max_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p,
                              top_k=self.top_k, seed=seed, stop=tuple(stop), ignore_eos=self.ignore_eos)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionBody(SamplingBody):
    prompt: Annotated[str, Field(min_length=1)] | Annotated[list[StrictInt], Field(min_length=1)]
    max_tokens: Annotated[int, Field(ge=1)] = 16

    def encode_request(self, max_model_len: int) -> EncodeRequest:
        return EncodeRequest(prompt=self.prompt, max_tokens=self.max_tokens, max_model_len=max_model_len)


class MessageBody(_Body):
    role: Literal["system", "developer", "user", "assistant"]
    content: str


class ChatBody(SamplingBody):
    messages: Annotated[list[MessageBody], Field(min_length=1)]
    max_tokens: Annotated[int, Field(ge=1)] | None = None  # None: the rest of the context
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None

    def encode_request(self, max_model_len: int) -> EncodeRequest:
        messages = [ChatMessage(m.role, m.content) for m in self.messages]
        return EncodeRequest(messages=messages, max_tokens=self.max_completion_tokens or self.max_tokens,
                             max_model_len=max_model_len)


class GenerateBody(_Body):
    prompt: Annotated[str, Field(min_length=1)]
    max_new_tokens: Annotated[int, Field(ge=1)] = 16
    stream: bool = False
    temperature: Annotated[float, Field(ge=0, allow_inf_nan=False)] = 1.0
    top_k: Annotated[int, Field(ge=-1)] = 0
    top_p: Annotated[float, Field(gt=0, le=1)] = 1.0
    stop_on_eos: bool = True

    def encode_request(self, max_model_len: int) -> EncodeRequest:
        return EncodeRequest(prompt=self.prompt, max_tokens=self.max_new_tokens, max_model_len=max_model_len)

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        return SamplingParams(max_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p,
                              top_k=self.top_k, ignore_eos=not self.stop_on_eos)


OpenAIBody = CompletionBody | ChatBody  # the bodies whose routes share one body of code
