"""Shared helpers for engine tests: Hugging Face reference generations on the same weights."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers


def hf_model(model_dir: Path, dtype: torch.dtype = torch.float32) -> transformers.GPT2LMHeadModel:
    return transformers.GPT2LMHeadModel.from_pretrained(model_dir, dtype=dtype).eval()


def hf_greedy(model: transformers.GPT2LMHeadModel, prompt: list[int], max_new_tokens: int) -> list[int]:
    """HF greedy continuation of one unpadded prompt, EOS ignored."""
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, do_sample=False,
            eos_token_id=None, pad_token_id=0,
        )
    return out[0, len(prompt):].tolist()


def mixed_prompts(num: int, seed: int = 0) -> list[list[int]]:
    """Prompts of mixed lengths (1 to ~120 tokens) of random token ids."""
    generator = torch.Generator().manual_seed(seed)
    lengths = [1, 3, 7, 16, 17, 33, 64, 120, 5, 48, 90, 2][:num]
    return [torch.randint(0, 50257, (n,), generator=generator).tolist() for n in lengths]


def greedy_logprobs(llm, prompt: list[int], max_new_tokens: int) -> tuple[list[int], list[torch.Tensor]]:
    """One prompt alone through an engine, greedy: its tokens and each step's full-vocabulary
    logprobs, read off the model's output (one sampling row per step)."""
    from engine import SamplingParams

    steps: list[torch.Tensor] = []
    hook = llm.engine.runner.model.register_forward_hook(lambda _m, _a, out: steps.extend(out.log_softmax(-1)))
    try:
        out = llm.generate([prompt], SamplingParams(max_tokens=max_new_tokens, temperature=0, ignore_eos=True))
    finally:
        hook.remove()
    return out[0].token_ids, steps


def record_steps(engine) -> list[list[int]]:
    """Each step's tokens per sequence, as the runner is handed them."""
    steps: list[list[int]] = []
    run = engine.runner.run

    def recording(batch):
        steps.append(list(batch.num_new_tokens))
        return run(batch)

    engine.runner.run = recording
    return steps


def record_threads(engine) -> list[tuple[int, int]]:
    """Each step's (tokens, torch threads of the thread running it)."""
    steps: list[tuple[int, int]] = []
    run = engine.runner.run

    def recording(batch):
        steps.append((sum(batch.num_new_tokens), torch.get_num_threads()))
        return run(batch)

    engine.runner.run = recording
    return steps
