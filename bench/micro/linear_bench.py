"""A decode step's linears alone, as the engine runs them: GPT-2-small's four projections
(12 layers' worth, every layer's weights distinct, so they stream from memory as in a step)
and its LM head, at each number of rows, on oneDNN's prepacked product against our op
(torch.ops.rayinfer.linear: the weights in panels in bf16 on AVX-512 BF16, else the plain
kernel for one to three rows and oneDNN's past them).

    python -m bench.micro.linear_bench --dtype bfloat16 --rows 1,2,4,8,16,32,64

Prints, per row count, the median time of one step's linears on each and the ratio.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from engine.model.packed_linear import PackedLinear, load_few_rows

LAYERS = 12
SHAPES = [(768, 2304), (768, 768), (768, 3072), (3072, 768)]  # (in, out): qkv, attn_out, mlp_fc, mlp_proj
VOCAB = 50257


def step_layers(dtype: torch.dtype) -> list[PackedLinear]:
    """Every linear of a GPT-2-small step in the order a step runs them, with distinct weights."""
    generator = torch.Generator().manual_seed(0)

    def layer(n_in: int, n_out: int, bias: bool = True) -> PackedLinear:
        weight = (torch.randn(n_out, n_in, generator=generator) * 0.02).to(dtype)
        return PackedLinear(weight, torch.zeros(n_out, dtype=dtype) if bias else None, few_rows=True)

    return [layer(*shape) for _ in range(LAYERS) for shape in SHAPES] + [layer(768, VOCAB, bias=False)]


def step_ms(layers: list[PackedLinear], rows: int, ours: bool, repeats: int) -> float:
    inputs = {n_in: torch.randn(rows, n_in).to(layers[0].packed_weight.dtype) for n_in, _ in SHAPES}
    times = []
    for _ in range(repeats + 2):
        start = time.perf_counter()
        for layer in layers:
            x = inputs[layer.in_features]
            if ours:
                layer(x)
            else:
                torch.ops.mkldnn._linear_pointwise(x, layer.packed_weight, layer.bias, "none", [], "")
        times.append(time.perf_counter() - start)
    return statistics.median(times[2:]) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--rows", default="1,2,4,8,16,32,64")
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    load_few_rows()
    layers = step_layers(getattr(torch, args.dtype))
    print(f"{args.dtype}, our weights {'in panels' if layers[0].weight.dim() == 4 else 'plain'}")
    with torch.inference_mode():
        for rows in (int(r) for r in args.rows.split(",")):
            onednn, ours = (step_ms(layers, rows, flag, args.repeats) for flag in (False, True))
            print(f"{rows:3d} rows: oneDNN {onednn:7.2f} ms, ours {ours:7.2f} ms ({onednn / ours:.2f}x)")


if __name__ == "__main__":
    main()
