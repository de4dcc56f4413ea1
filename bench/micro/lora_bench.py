"""A step's LoRA updates alone, one GPT-2-small layer's four linears at 32 rows (--rows), each row under
one of max_loras adapters or the base model: three ways to run Punica's BGMV on the CPU,
eager and compiled, beside the base linears themselves (oneDNN-prepacked, as the engine runs them).

    python -m bench.micro.lora_bench --dtype bfloat16 --max-loras 4

    bgmv     gather each row's A and B from the stacked slots, two bmm (Punica's BGMV as torch ops)
    grouped  rows grouped by adapter: per adapter present, index, two mm, index_copy
    dense    every slot at once: x @ [A_0..A_S], a one-hot row mask, @ [B_0..B_S] (eager, where our kernels do not load)
    kernel   our op (engine/kernels/csrc/lora_delta.cpp), on the engine's slot layout (what the engine runs on CPU)

Prints the fastest call's microseconds of each at 1 and 2 threads.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from transformers import GPT2Config

from engine.lora.lora_linear import load_kernel
from engine.model.packed_linear import PackedLinear, can_pack

HIDDEN = 768
SHAPES = [(HIDDEN, 3 * HIDDEN), (HIDDEN, HIDDEN), (HIDDEN, 4 * HIDDEN), (4 * HIDDEN, HIDDEN)]  # (in, out)


def write_random_adapter(directory: Path, model: GPT2Config, rank: int, seed: int) -> Path:
    """A PEFT-format adapter of random weights on every GPT-2 target, for timing (not for output)."""
    from engine.lora.adapter import HF_MODULES, module_shape

    directory.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(model.n_layer):
        for hf_name, kind in HF_MODULES.items():
            fan_in, fan_out = module_shape(model, kind)
            prefix = f"base_model.model.transformer.h.{layer}.{hf_name}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, fan_in, generator=generator) * 0.01
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(fan_out, rank, generator=generator) * 0.01
    save_file(tensors, directory / "adapter_model.safetensors")
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": ["c_attn", "c_proj", "c_fc"],
              "fan_in_fan_out": True, "bias": "none"}
    (directory / "adapter_config.json").write_text(json.dumps(config))
    return directory


def bgmv(xs, slots, a_stacks, b_stacks, _mask):
    return [torch.bmm(torch.bmm(x.unsqueeze(1), a[slots]), b[slots]).squeeze(1)
            for x, a, b in zip(xs, a_stacks, b_stacks)]


def grouped(xs, slots, a_stacks, b_stacks, _mask):
    groups = [(s, (slots == s).nonzero().squeeze(1)) for s in slots.unique().tolist() if s]
    out = []
    for x, a, b in zip(xs, a_stacks, b_stacks):
        y = x.new_zeros(x.shape[0], b.shape[2])
        for slot, rows in groups:
            y.index_copy_(0, rows, x[rows] @ a[slot] @ b[slot])
        out.append(y)
    return out


def dense(xs, _slots, a_cats, b_cats, mask):
    num_slots = mask.shape[1]
    return [((x @ a).view(x.shape[0], num_slots, -1) * mask).flatten(1) @ b for x, a, b in zip(xs, a_cats, b_cats)]


def kernel(xs, slots, a_slots, b_stacks, _mask):
    return [torch.ops.rayinfer.lora_delta(x, slots, a, b) for x, a, b in zip(xs, a_slots, b_stacks)]


def best_us(fn: Callable[[], object], repeats: int) -> float:
    """The fastest of `repeats` calls: on a machine other processes share, the least disturbed."""
    for _ in range(5):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--max-loras", type=int, default=4)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=200)
    args = parser.parse_args()
    dtype, num_slots, rank = getattr(torch, args.dtype), args.max_loras + 1, args.rank
    load_kernel()
    generator = torch.Generator().manual_seed(0)
    slots = torch.randint(0, num_slots, (args.rows,), generator=generator)
    xs = [torch.randn(args.rows, fan_in, generator=generator).to(dtype) for fan_in, _ in SHAPES]
    a_stacks = [torch.randn(num_slots, fan_in, rank, generator=generator).to(dtype) for fan_in, _ in SHAPES]
    b_stacks = [torch.randn(num_slots, rank, fan_out, generator=generator).to(dtype) for _, fan_out in SHAPES]
    for stack in a_stacks + b_stacks:
        stack[0] = 0  # slot 0: the base model's
    a_slots = [a.permute(1, 0, 2).contiguous() for a in a_stacks]  # [in, S, R], as engine/lora/slots.py
    a_cats = [a.flatten(1) for a in a_slots]  # [in, S * R]
    b_cats = [b.flatten(0, 1) for b in b_stacks]
    mask = F.one_hot(slots, num_slots).to(dtype).unsqueeze(2)
    base = [PackedLinear(torch.randn(fan_out, fan_in).to(dtype), None) if can_pack(torch.device("cpu"), dtype)
            else torch.nn.Linear(fan_in, fan_out, bias=False).to(dtype) for fan_in, fan_out in SHAPES]
    for threads in (1, 2):
        torch.set_num_threads(threads)
        with torch.inference_mode():
            results = {"base linears": best_us(lambda: [f(x) for f, x in zip(base, xs)], args.repeats)}
            for name, fn in (("bgmv", bgmv), ("grouped", grouped), ("dense", dense), ("kernel", kernel)):
                stacks = {dense: (a_cats, b_cats), kernel: (a_slots, b_stacks)}.get(fn, (a_stacks, b_stacks))
                results[name] = best_us(lambda: fn(xs, slots, *stacks, mask), args.repeats)
                if fn is not grouped:  # data-dependent shapes: no one graph
                    compiled = torch.compile(fn, dynamic=False)
                    results[f"{name} compiled"] = best_us(lambda: compiled(xs, slots, *stacks, mask), args.repeats)
        print(f"{args.dtype}, {args.rows} rows, max_loras {args.max_loras}, rank {rank}, {threads} thread(s): "
              + ", ".join(f"{k} {v:.0f} us" for k, v in results.items()), flush=True)


if __name__ == "__main__":
    main()
