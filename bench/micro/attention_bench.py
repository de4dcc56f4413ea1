"""Decode attention alone, as the decode graph runs it: each layer of GPT-2-small over pools
of the engine's size, 32 sequences at a given number of cached tokens, our C++ kernel
against the expression inductor compiles (engine/model/attention.py decode_attention_with_own).

    python -m bench.micro.attention_bench --dtype bfloat16 --cached 50

Prints the median time of all layers in turn (the pools far outgrow the caches, as in a
step) at 2 threads and at 1.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from engine.kernels import native_attention
from engine.model.attention import decode_attention_with_own
from engine.kernels.inductor import compile_for

LAYERS, HEADS, HEAD_DIM, BLOCK_SIZE, NUM_BLOCKS = 12, 12, 64, 16, 3640


def layers_ms(attention, pool: torch.Tensor, qkv: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor,
              repeats: int) -> float:
    q, k, v = qkv.unbind(1)
    times = []
    for _ in range(repeats + 5):
        start = time.perf_counter()
        for layer in range(LAYERS):
            attention(q, k, v, pool[layer, 0], pool[layer, 1], tables, lens)
        times.append(time.perf_counter() - start)
    return statistics.median(times[5:]) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--cached", type=int, default=50, help="cached tokens per sequence")
    parser.add_argument("--repeats", type=int, default=50)
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    pool = torch.randn(LAYERS, 2, HEADS, NUM_BLOCKS, BLOCK_SIZE, HEAD_DIM).to(dtype)
    width = args.cached // BLOCK_SIZE + 1
    tables = torch.randperm(NUM_BLOCKS)[: args.batch * width].view(args.batch, width)
    lens = torch.full((args.batch,), args.cached)
    qkv = torch.randn(args.batch, 3, HEADS, HEAD_DIM).to(dtype)
    variants = {"our kernel": native_attention.load(),
                "inductor's expression": compile_for(torch.device("cpu"), decode_attention_with_own, dynamic=True)}
    with torch.inference_mode():
        for threads in (2, 1):
            torch.set_num_threads(threads)
            for name, attention in variants.items():
                ms = layers_ms(attention, pool, qkv, tables, lens, args.repeats)
                print(f"{name:22s} {threads} thread(s): {LAYERS} layers {ms:.2f} ms ({ms / LAYERS:.3f} ms a layer)")


if __name__ == "__main__":
    main()
