"""Hugging Face PEFT as the LoRA peer: adapters made with its `save_pretrained`, and its own
mixed-adapter batch (`generate(..., adapter_names=[...])`), for bench/lora_bench.py and
bench/scale/lora_route_bench.py."""

from __future__ import annotations

import time
from pathlib import Path

import peft
import torch
from transformers import GPT2LMHeadModel

# The benchmark adapter: rank 16 on every module the engine serves.
TARGET_MODULES = ["c_attn", "c_proj", "c_fc"]


def save_adapters(base: GPT2LMHeadModel, directory: Path, num_adapters: int, rank: int = 16,
                  seed: int = 0) -> dict[str, Path]:
    """num_adapters PEFT adapters of base, random A and B (PEFT's init_lora_weights=False),
    as PEFT's save_pretrained writes them: name -> directory."""
    paths = {}
    for index in range(num_adapters):
        torch.manual_seed(seed + index)
        config = peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGET_MODULES, init_lora_weights=False)
        model = peft.get_peft_model(base, config)
        paths[f"adapter-{index}"] = directory / f"adapter-{index}"
        model.save_pretrained(paths[f"adapter-{index}"])
        base = model.unload()  # the base model back, without the adapter's layers
    return paths


def peft_model(base: GPT2LMHeadModel, adapters: dict[str, Path]) -> peft.PeftModel:
    """base with every adapter loaded under its name."""
    names = iter(adapters)
    first = next(names)
    model = peft.PeftModel.from_pretrained(base, adapters[first], adapter_name=first)
    for name in names:
        model.load_adapter(adapters[name], adapter_name=name)
    return model.eval()


def run_peft_mixed(model: peft.PeftModel, prompts: list[list[int]], names: list[str], max_tokens: int) -> tuple[int, float]:
    """PEFT's mixed-adapter batch: every prompt (equal lengths) in one static batch, each row
    under its adapter, greedy, max_tokens each; (tokens, seconds)."""
    input_ids = torch.tensor(prompts)
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=max_tokens,
                             min_new_tokens=max_tokens, do_sample=False, pad_token_id=0, adapter_names=names)
    return (out.shape[1] - input_ids.shape[1]) * out.shape[0], time.perf_counter() - start
