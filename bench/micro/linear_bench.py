"""A decode step's linears alone, as the engine runs them: GPT-2-small's four projections
(12 layers' worth, every layer's weights distinct, so they stream from memory as in a step)
and its LM head, at each number of rows, on oneDNN's prepacked product against our op
(torch.ops.rayinfer.linear: the weights in panels in bf16 on AVX-512 BF16, else the plain
kernel for one to three rows and oneDNN's past them) and, where it runs, oneDNN's brgemm
ukernel on the same panels (engine/kernels/csrc/brgemm_linear.cpp).

    python -m bench.micro.linear_bench --dtype bfloat16 --rows 1,8,32,64 --threads 1,2
    python -m bench.micro.linear_bench --layers 1 --no-lm-head  # one block's four, cache-resident

Prints, per thread count and row count, the best time of one step's linears on each (the
tuner's race: the kernels interleaved, a call of each a round, so a busy machine's drift
falls on all alike; best, as the others' load only ever adds time), and its ratio to oneDNN's.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch

from engine.core.tuner import race
from engine.model.packed_linear import PackedLinear, load_few_rows, runs_brgemm

LAYERS = 12
SHAPES = [(768, 2304), (768, 768), (768, 3072), (3072, 768)]  # (in, out): qkv, attn_out, mlp_fc, mlp_proj
VOCAB = 50257


def step_layers(dtype: torch.dtype, num_layers: int = LAYERS, lm_head: bool = True) -> list[PackedLinear]:
    """Every linear of a GPT-2-small step in the order a step runs them, with distinct weights."""
    generator = torch.Generator().manual_seed(0)

    def layer(n_in: int, n_out: int, bias: bool = True) -> PackedLinear:
        weight = (torch.randn(n_out, n_in, generator=generator) * 0.02).to(dtype)
        return PackedLinear(weight, torch.zeros(n_out, dtype=dtype) if bias else None, few_rows=True)

    return [layer(*shape) for _ in range(num_layers) for shape in SHAPES] + ([layer(768, VOCAB, bias=False)] * lm_head)


LIMITS = {"ours": (-1, 0), "brgemm": (0, 64)}  # kernel: (max_rows, brgemm_rows)


def step(layers: list[PackedLinear], rows: int, kernel: str) -> Callable[[], None]:
    """One step's linears on `kernel`: oneDNN, ours or brgemm."""
    inputs = {n_in: torch.randn(rows, n_in).to(layers[0].packed_weight.dtype) for n_in, _ in SHAPES}

    def run() -> None:
        for layer in layers:
            x = inputs[layer.in_features]
            if kernel == "oneDNN":
                torch.ops.mkldnn._linear_pointwise(x, layer.packed_weight, layer.bias, "none", [], "")
            else:
                torch.ops.rayinfer.linear(x, layer.packed_weight, layer.weight, layer.bias, "none", None,
                                          *LIMITS[kernel])
    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--rows", default="1,2,4,8,16,32,64")
    parser.add_argument("--threads", default=str(torch.get_num_threads()))
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--layers", type=int, default=LAYERS)
    parser.add_argument("--no-lm-head", action="store_true")
    args = parser.parse_args()
    load_few_rows()
    layers = step_layers(getattr(torch, args.dtype), args.layers, not args.no_lm_head)
    kernels = ["oneDNN", "ours", *(["brgemm"] if runs_brgemm(layers[0]) else [])]
    print(f"{args.dtype}, our weights {'in panels' if layers[0].weight.dim() == 4 else 'plain'}, "
          f"brgemm {'runs' if 'brgemm' in kernels else 'does not run'} here")
    with torch.inference_mode():
        for threads in (int(t) for t in args.threads.split(",")):
            torch.set_num_threads(threads)
            for rows in (int(r) for r in args.rows.split(",")):
                print(f"{threads} threads {rows:3d} rows: " + row_line(layers, rows, kernels, args.repeats))


def row_line(layers: list[PackedLinear], rows: int, kernels: list[str], repeats: int) -> str:
    times = race({kernel: step(layers, rows, kernel) for kernel in kernels}, repeats)
    return ", ".join(f"{kernel} {best:7.2f} ms ({times['oneDNN'] / best:.2f}x)" for kernel, best in times.items())


if __name__ == "__main__":
    main()
