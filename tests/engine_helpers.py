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
