"""The engine against its ceiling: offline engine, Hugging Face static-batch `generate` and
the model's matmuls alone at the same batch, side by side in one run; then one decode step
of the whole batch, and one sequence's time per token, against their matmuls alone.

    python -m bench.micro.ceiling --dtype float32 --num-requests 32 --prompt-len 16 --max-tokens 64
    python -m bench.micro.ceiling --dtype bfloat16 --linears auto --compile-decode
    python -m bench.micro.ceiling --dtype bfloat16 --linears auto --compile-decode --compiled-only \
        --decode-attention native torch

"Matmuls alone" runs the engine's own linear modules (prepacked or F.linear, as the engine
built them) on inputs of the step's row counts: one prefill of every prompt, then
max_tokens - 1 decode steps of num_requests rows. It is the time no scheduling, attention,
layer norm or sampling could go below. `compile_decode`'s graph runs the engine's own
linears too. Each engine's construction time (compile_decode compiles in it) is printed.

The engine and HF `generate` run `--repeats` times each, alternating, and each row is the
median run, with every run's figure beside it: on a shared 2-core machine one run of
either can be 10% off.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import GPT2LMHeadModel

from engine.config import EngineConfig
from engine.core.llm_engine import LLMEngine
from engine.model.gpt2 import GPT2LMHead
from engine.request.sampling_params import SamplingParams
from bench.engine_bench import Result, decode_ms_per_token, hf_model, make_prompts, run_engine, run_hf


def decode_step_ms(engine: LLMEngine, prompts: list[list[int]], num_steps: int) -> float:
    """Median time of a step that decodes every prompt at once (after their prefill)."""
    params = SamplingParams(max_tokens=num_steps + 2, temperature=0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"step-{time.monotonic_ns()}-{i}", prompt, params)
    engine.step()  # every prefill
    times = []
    for _ in range(num_steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    while engine.has_unfinished_requests():
        engine.step()
    return statistics.median(times) * 1000


def linears_ms(model: GPT2LMHead, rows: int, lm_rows: int | None = None, repeats: int = 5) -> float:
    """One forward's linears (every block's four on `rows` rows, the LM head on `lm_rows`,
    default `rows`), median ms."""
    dtype = model.wte.weight.dtype
    lm_head = model.lm_head or (lambda x: torch.nn.functional.linear(x, model.wte.weight))
    layers = [m for block in model.h for m in (block.attn_qkv, block.attn_out, block.mlp_fc, block.mlp_proj)]
    inputs = {n: torch.randn(rows, n, dtype=dtype) for n in {m.in_features for m in layers}}
    lm_input = torch.randn(lm_rows or rows, model.config.n_embd, dtype=dtype)
    times = []
    with torch.inference_mode():
        for _ in range(repeats + 1):
            start = time.perf_counter()
            for layer in layers:
                layer(inputs[layer.in_features])
            lm_head(lm_input)
            times.append(time.perf_counter() - start)
    return statistics.median(times[1:]) * 1000


def matmuls_alone(model: GPT2LMHead, num: int, prompt_len: int, max_tokens: int) -> Result:
    # Prefill samples one row per prompt through the LM head; the block linears see every token.
    seconds = (linears_ms(model, num * prompt_len, num) + (max_tokens - 1) * linears_ms(model, num)) / 1000
    return Result("matmuls alone (ceiling)", num * max_tokens, seconds)


def hf_static(config: EngineConfig, prompts: list[list[int]]) -> GPT2LMHeadModel:
    """HF's model on the engine's weights, warmed up."""
    model = hf_model(config)
    run_hf(model, prompts[:4], 4)
    return model


def median_run(runs: list[Result]) -> Result:
    """The median run (by time), named with every run's tokens/s."""
    median = sorted(runs, key=lambda r: r.seconds)[len(runs) // 2]
    if len(runs) == 1:
        return median
    figures = ", ".join(f"{r.tokens_per_s:.0f}" for r in runs)
    return Result(f"{median.name} (median of {figures})", median.num_tokens, median.seconds)


def variants(args: argparse.Namespace) -> list[tuple[str, dict]]:
    """(label, EngineConfig fields) of each engine run, in order."""
    runs = [] if args.compiled_only else [(f"linears={linears}", {"linears": linears}) for linears in args.linears]
    if args.compile_decode:  # one per --linears: the graph runs the engine's own linears
        runs += [(f"compiled decode graph, linears={linears}" + ("" if attention == "auto" else f", {attention} attention"),
                  {"linears": linears, "compile_decode": True, "decode_attention": attention})
                 for linears in args.linears for attention in args.decode_attention]
    return runs


def warm_up(engine: LLMEngine, prompts: list[list[int]]) -> None:
    """Compile (where the engine compiles) for the shapes the timed runs meet, outside them."""
    run_engine(engine, prompts[:4], 4, "warm-up")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gpt2")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--linears", nargs="*", default=["auto", "reference"], help="engine variants to run")
    parser.add_argument("--compile-decode", action="store_true", help="also run the compiled decode graph (compile_decode)")
    parser.add_argument("--compiled-only", action="store_true", help="with --compile-decode: leave out the eager engine rows")
    parser.add_argument("--decode-attention", nargs="+", default=["auto"],
                        help="the compiled graph's attention, one engine row each: auto, native, torch")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each engine and of HF, alternating")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    rows, steps, hf, hf_runs = [], [], None, []
    for label, fields in variants(args):
        config = EngineConfig(model=args.model, weights="random", dtype=args.dtype, device="cpu", **fields)
        start = time.perf_counter()
        engine = LLMEngine(config)
        print(f"engine, {label}: constructed in {time.perf_counter() - start:.1f} s", flush=True)
        prompts = make_prompts(args.num_requests, args.prompt_len, engine.model_info.vocab_size)
        warm_up(engine, prompts)
        hf = hf or hf_static(config, prompts)
        engine_runs = []
        for _ in range(args.repeats):
            engine_runs.append(run_engine(engine, prompts, args.max_tokens, f"engine, {label}"))
            hf_runs.append(run_hf(hf, prompts, args.max_tokens))
        rows.append(median_run(engine_runs))
        model = engine.runner.model
        rows.append(matmuls_alone(model, args.num_requests, args.prompt_len, args.max_tokens))
        rows[-1].name += f", {label}"
        steps.append((label, decode_step_ms(engine, prompts, 16), linears_ms(model, args.num_requests, repeats=9),
                      decode_ms_per_token(engine, prompts[0], args.max_tokens), linears_ms(model, 1, repeats=9)))
    rows.append(median_run(hf_runs))
    report(args, config, rows, steps)


def report(args: argparse.Namespace, config: EngineConfig, rows: list[Result], steps: list[tuple]) -> None:
    print(f"model={args.model} dtype={config.torch_dtype} threads={torch.get_num_threads()} "
          f"requests={args.num_requests} prompt_len={args.prompt_len} max_tokens={args.max_tokens}")
    hf = rows[-1].tokens_per_s
    for r in rows:
        print(f"{r.name:60s} {r.num_tokens:6d} tokens in {r.seconds:6.2f} s = {r.tokens_per_s:7.1f} tok/s "
              f"({r.tokens_per_s / hf:.2f}x HF)")
    for label, step, mm, single, single_mm in steps:
        print(f"{label}: decode step of {args.num_requests} {step:.1f} ms, its matmuls alone {mm:.1f} ms, "
              f"ratio {step / mm:.2f}; one sequence {single:.2f} ms/token, its matmuls {single_mm:.2f} ms")


if __name__ == "__main__":
    main()
