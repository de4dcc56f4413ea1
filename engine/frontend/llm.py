"""The offline API: LLM(model).generate(prompts, sampling_params)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Sequence as Seq

from engine.config import EngineConfig
from engine.request.detokenizer import IncrementalDetokenizer, TokenVocab
from engine.core.llm_engine import LLMEngine
from engine.model.loader import load_tokenizer
from engine.request.token_logprob import TokenLogprob
from engine.request.outputs import StepOutput
from engine.request.sampling_params import SamplingParams

Prompt = str | list[int]


@dataclass
class CompletionOutput:
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    # Where the params ask (engine/sampling/logprobs.py says what they are): one per token_ids entry,
    # their sum, and one per prompt token (the first None).
    logprobs: list[TokenLogprob] | None = None
    cumulative_logprob: float | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None


class LLM:
    def __init__(self, model: str = "gpt2", *, weights: str = "auto", dtype: str = "auto",
                 device: str = "auto", seed: int = 0, **engine_config):
        self.engine = LLMEngine(EngineConfig(model=model, weights=weights, dtype=dtype, device=device,
                                             seed=seed, **engine_config))
        self.tokenizer = load_tokenizer(model)
        self.vocab = TokenVocab.from_tokenizer(self.tokenizer)
        self._ids = itertools.count()

    def generate(self, prompts: Prompt | Seq[Prompt],
                 sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                 lora_name: str | None | Seq[str | None] = None) -> list[CompletionOutput]:
        """Run every prompt to completion, batched continuously; results in prompt order.
        lora_name: the LoRA adapter (LLMEngine.add_lora) of every prompt, or one per prompt
        (None: the base model)."""
        prompts = [prompts] if _is_single(prompts) else list(prompts)
        params = _per_prompt(sampling_params or SamplingParams(), len(prompts))
        loras = _per_prompt_lora(lora_name, len(prompts))
        requests = {}
        for prompt, p, lora in zip(prompts, params, loras):
            ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
            self.engine.check_lora_name(lora)
            self.engine.validate_request(ids, p)
            requests[str(next(self._ids))] = (CompletionOutput(ids), IncrementalDetokenizer(self.vocab, p.stop), p)
        for (request_id, (out, _, p)), lora in zip(requests.items(), loras):
            self.engine.add_request(request_id, out.prompt_token_ids, p, lora_name=lora)
        while self.engine.has_unfinished_requests():
            for step in self.engine.step():
                self._apply(step, requests)
        return [out for out, _, _ in requests.values()]

    def _apply(self, step: StepOutput, requests: dict) -> None:
        out, detokenizer, _ = requests[step.request_id]
        if out.finish_reason is not None:
            return
        if step.prompt_logprobs is not None:
            out.prompt_logprobs = list(step.prompt_logprobs)
        if step.token_id is not None:
            _append(out, step)
            delta = detokenizer.push([step.token_id])
            out.text += delta.text
            if delta.stopped:
                out.finish_reason = "stop"
                self.engine.abort_request(step.request_id)
                return
        if step.finish_reason is not None:
            out.text += detokenizer.finish()
            out.finish_reason = step.finish_reason


def _append(out: CompletionOutput, step: StepOutput) -> None:
    out.token_ids.append(step.token_id)
    if step.logprob is not None:
        out.logprobs = out.logprobs if out.logprobs is not None else []
        out.logprobs.append(step.logprob)
        out.cumulative_logprob = step.cumulative_logprob


def _is_single(prompts) -> bool:
    return isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int))


def _per_prompt_lora(lora_name: str | None | Seq[str | None], n: int) -> list[str | None]:
    if lora_name is None or isinstance(lora_name, str):
        return [lora_name] * n
    if len(lora_name) != n:
        raise ValueError(f"got {len(lora_name)} LoRA names for {n} prompts")
    return list(lora_name)


def _per_prompt(params: SamplingParams | Seq[SamplingParams], n: int) -> list[SamplingParams]:
    if isinstance(params, SamplingParams):
        return [params] * n
    if len(params) != n:
        raise ValueError(f"got {len(params)} sampling params for {n} prompts")
    return list(params)
