"""The engine's logprobs (engine/sampling/logprobs.py: the model's own distribution, before any
sampling control) in OpenAI's two wire shapes, as vLLM writes them.

Completions: {"tokens", "token_logprobs", "top_logprobs", "text_offset"}, one entry per
token; top_logprobs maps token text to logprob for the k most likely tokens plus the token
itself (so up to k + 1 entries); a prompt's first token has neither (null). text_offset
counts characters from the start of the choice's text, across stream chunks.

Chat: {"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob",
"bytes"}] * k}]}.

A token's text is its bytes decoded alone, a partial UTF-8 character as U+FFFD; `bytes`
are the token's own bytes, so a client can join them back into exact text.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from engine.request.detokenizer import TokenVocab
from engine.request.token_logprob import TokenLogprob

_FLOOR = -9999.0  # OpenAI's JSON has no -inf: vLLM clamps to this


@dataclass(frozen=True, slots=True)
class Scored:
    """One token of a choice's text and what the engine said of it (None: a prompt's first)."""

    token_id: int
    logprob: TokenLogprob | None


def token_text(vocab: TokenVocab, token_id: int) -> str:
    return vocab.token_bytes[token_id].decode("utf-8", errors="replace")


def _value(logprob: float) -> float:
    return max(logprob, _FLOOR)


@dataclass
class CompletionLogprobs:
    """Builds one choice's completions logprobs, chunk by chunk (text_offset carries over)."""

    vocab: TokenVocab
    num_top: int
    next_offset: int = 0

    def format(self, scored: Sequence[Scored]) -> dict:
        out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for item in scored:
            token = token_text(self.vocab, item.token_id)
            out["tokens"].append(token)
            out["text_offset"].append(self.next_offset)
            self.next_offset += len(token)
            out["token_logprobs"].append(None if item.logprob is None else _value(item.logprob.logprob))
            out["top_logprobs"].append(None if item.logprob is None else self._top(token, item.logprob))
        return out

    def _top(self, token: str, logprob: TokenLogprob) -> dict[str, float]:
        top = {token_text(self.vocab, t): _value(lp) for t, lp in logprob.top[:self.num_top]}
        top.setdefault(token, _value(logprob.logprob))
        return top


def chat_logprobs(vocab: TokenVocab, num_top: int, scored: Sequence[Scored]) -> dict:
    def entry(token_id: int, logprob: float) -> dict:
        return {"token": token_text(vocab, token_id), "logprob": _value(logprob),
                "bytes": list(vocab.token_bytes[token_id])}

    content = [entry(s.token_id, s.logprob.logprob)
               | {"top_logprobs": [entry(t, lp) for t, lp in s.logprob.top[:num_top]]}
               for s in scored if s.logprob is not None]
    return {"content": content}
