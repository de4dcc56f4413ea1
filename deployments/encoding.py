"""The tokenizer deployment's contract: what the ingress asks (EncodeRequest) and gets back
(Encoded, or EncodeError for a prompt that can never run), and GPT-2's chat template.

Chat template (GPT-2 has none): one "role: content" line per message, then "assistant:"
for the model to continue, e.g.

    system: You are terse.
    user: Hi!
    assistant:
"""

from __future__ import annotations

from dataclasses import dataclass


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
