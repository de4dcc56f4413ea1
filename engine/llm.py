"""The offline API: LLM(model).generate(prompts, sampling_params)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Sequence as Seq

from engine.config import EngineConfig
from engine.detokenizer import IncrementalDetokenizer, TokenVocab
from engine.llm_engine import LLMEngine
from engine.loader import load_tokenizer
from engine.sampling_params import SamplingParams

Prompt = str | list[int]


@dataclass
class CompletionOutput:
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None


class LLM:
    def __init__(self, model: str = "gpt2", *, weights: str = "auto", dtype: str = "auto",
                 device: str = "auto", seed: int = 0, **engine_config):
        self.engine = LLMEngine(EngineConfig(model=model, weights=weights, dtype=dtype, device=device,
                                             seed=seed, **engine_config))
        self.tokenizer = load_tokenizer(model)
        self.vocab = TokenVocab.from_tokenizer(self.tokenizer)
        self._ids = itertools.count()

    def generate(self, prompts: Prompt | Seq[Prompt],
                 sampling_params: SamplingParams | Seq[SamplingParams] | None = None) -> list[CompletionOutput]:
        """Run every prompt to completion, batched continuously; results in prompt order."""
        prompts = [prompts] if _is_single(prompts) else list(prompts)
        params = _per_prompt(sampling_params or SamplingParams(), len(prompts))
        requests = {}
        for prompt, p in zip(prompts, params):
            ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
            self.engine.validate_request(ids, p)
            requests[str(next(self._ids))] = (CompletionOutput(ids), IncrementalDetokenizer(self.vocab, p.stop), p)
        for request_id, (out, _, p) in requests.items():
            self.engine.add_request(request_id, out.prompt_token_ids, p)
        while self.engine.has_unfinished_requests():
            for step in self.engine.step():
                self._apply(step.request_id, step.token_id, step.finish_reason, requests)
        return [out for out, _, _ in requests.values()]

    def _apply(self, request_id: str, token_id: int | None, finish_reason: str | None, requests: dict) -> None:
        out, detokenizer, _ = requests[request_id]
        if out.finish_reason is not None:
            return
        if token_id is not None:
            delta = detokenizer.push([token_id])
            out.text += delta.text
            if delta.stopped:
                out.token_ids.append(token_id)
                out.finish_reason = "stop"
                self.engine.abort_request(request_id)
                return
            out.token_ids.append(token_id)
        if finish_reason is not None:
            out.text += detokenizer.finish()
            out.finish_reason = finish_reason


def _is_single(prompts) -> bool:
    return isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int))


def _per_prompt(params: SamplingParams | Seq[SamplingParams], n: int) -> list[SamplingParams]:
    if isinstance(params, SamplingParams):
        return [params] * n
    if len(params) != n:
        raise ValueError(f"got {len(params)} sampling params for {n} prompts")
    return list(params)
