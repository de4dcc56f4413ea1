"""Prompts to checked token ids: what the ingress asks (EncodeRequest) and gets back
(Encoded, or EncodeError for a prompt that can never run), the Encoder that does it (in the
tokenizer deployment, and in the ingress for short prompts), and GPT-2's chat template.

Chat template (GPT-2 has none): one "role: content" line per message, then "assistant:"
for the model to continue, e.g.

    system: You are terse.
    user: Hi!
    assistant:
"""

from __future__ import annotations

from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

from engine.request.invalid_request import InvalidRequestError
from engine.request.request_rules import check_context, check_prompt


@dataclass(frozen=True)
class ChatMessage:
    role: str
    content: str


@dataclass(frozen=True)
class EncodeRequest:
    """Exactly one of `prompt` (text or token ids) and `messages` is set."""

    prompt: str | list[int] | None = None
    messages: list[ChatMessage] | None = None
    max_tokens: int | None = None  # None: the rest of the context
    max_model_len: int = 1024
    max_tokens_param: str = "max_tokens"  # the body's name for it, which an error names

    @property
    def param(self) -> str:
        return "messages" if self.messages is not None else "prompt"

    @property
    def text(self) -> str | None:
        if self.messages is not None:
            return apply_chat_template(self.messages)
        return self.prompt if isinstance(self.prompt, str) else None


@dataclass(frozen=True)
class Encoded:
    token_ids: list[int]
    max_tokens: int


@dataclass(frozen=True)
class EncodeError:
    message: str
    param: str
    code: str | None = None


def apply_chat_template(messages: list[ChatMessage]) -> str:
    return "".join(f"{m.role}: {m.content}\n" for m in messages) + "assistant:"


class Encoder:
    """A tokenizer and the engine's prompt rules, checked here so that a bad prompt is a 400
    naming its field. Each request gets its own result, so one bad prompt never fails the
    others encoded with it."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer
        self._vocab_size = len(tokenizer)

    def encode(self, requests: list[EncodeRequest]) -> list[Encoded | EncodeError]:
        texts = [r.text for r in requests]  # once each: a chat request's text is its template applied
        to_encode = [text for text in texts if text is not None]
        encoded = iter(self.tokenizer(to_encode, add_special_tokens=False)["input_ids"] if to_encode else ())
        return [self._check(r, r.prompt if text is None else next(encoded)) for r, text in zip(requests, texts)]

    def _check(self, request: EncodeRequest, token_ids: list[int] | None) -> Encoded | EncodeError:
        param, context = request.param, request.max_model_len
        try:
            check_prompt(token_ids or [], self._vocab_size, param)
            # None: the rest of the context, at least one token (none left: no room to generate).
            max_tokens = request.max_tokens if request.max_tokens is not None else max(context - len(token_ids), 1)
            check_context(len(token_ids), max_tokens, context, param, request.max_tokens_param)
        except InvalidRequestError as error:
            return EncodeError(str(error), error.param, error.code)
        return Encoded(list(token_ids), max_tokens)
