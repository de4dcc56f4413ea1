"""Two engine configs' decode steps, interleaved step by step in one process, so that this
machine's drift (±20% between runs minutes apart) falls on both alike: the A/B for a change
inside the step, where two `loadtest.micro.ceiling` runs can't tell 5% from noise.

    python -m loadtest.micro.step_ab --dtype bfloat16 --a '{"compile_decode": true, "decode_attention": "torch"}' \\
        --b '{"compile_decode": true, "decode_attention": "native"}'

`--small-pages A` (or B) leaves that side's KV pool on 4 KB pages (engine/core/kv_pool.py), the
A/B for the pool's huge pages; `--python-wrapper A` compiles that side's decode graph with
inductor's Python wrapper rather than its C++ one (engine/kernels/inductor.py cpp_wrapper).

`--loras N`: a side whose fields set max_loras loads N random adapters (rank --lora-rank, every
target) and runs row i under adapter i % (N + 1), 0 the base model: the A/B of LoRA's cost,
`--a '{}' --b '{"max_loras": 4}' --loras 4`.

Each engine decodes the same prompts (num_requests rows, greedy unless --temperature); per
step, A then B or B then A (alternating). Prints each side's median step, and B's over A's.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import statistics
import tempfile
import time
from pathlib import Path
from unittest import mock

import engine.model.decode_graph as decode_graph
import engine.kernels.inductor as inductor
import engine.core.kv_pool as kv_pool
from engine.config import EngineConfig
from engine.core.llm_engine import LLMEngine
from engine.request.sampling_params import SamplingParams
from loadtest.engine_bench import make_prompts
from loadtest.micro.lora_bench import write_random_adapter


def start(engine: LLMEngine, prompts: list[list[int]], max_tokens: int, temperature: float = 0.0) -> None:
    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, ignore_eos=True)
    loras = [None] + [info.name for info in engine.list_loras()]
    for i, prompt in enumerate(prompts):
        engine.add_request(f"ab-{time.monotonic_ns()}-{i}", prompt, params, lora_name=loras[i % len(loras)])
    engine.step()  # every prefill


def timed_step(engine: LLMEngine) -> float:
    begin = time.perf_counter()
    engine.step()
    return (time.perf_counter() - begin) * 1000


def build(args: argparse.Namespace, fields: dict, small_pages: bool, python_wrapper: bool) -> LLMEngine:
    config = EngineConfig(model=args.model, weights="random", dtype=args.dtype, device="cpu",
                          num_kv_blocks=args.num_kv_blocks, **fields)
    with contextlib.ExitStack() as patches:
        if small_pages:
            patches.enter_context(mock.patch.object(kv_pool, "allocate",
                                                    functools.partial(kv_pool.allocate, huge_pages=False)))
        if python_wrapper:
            patches.enter_context(mock.patch.object(
                decode_graph, "compile_for", lambda *a, **k: inductor.compile_for(*a, **{**k, "cpp_wrapper": False})))
        return LLMEngine(config)


def add_loras(engines, num: int, rank: int) -> None:
    directory = Path(tempfile.mkdtemp(prefix="step-ab-loras-"))
    for engine in engines:
        if engine.loras is not None:
            for i in range(num):
                path = write_random_adapter(directory / str(i), engine.runner.model.config, rank, seed=i)
                engine.add_lora(f"lora{i}", str(path))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gpt2")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--a", type=json.loads, required=True, help="EngineConfig fields of A, JSON")
    parser.add_argument("--b", type=json.loads, required=True, help="EngineConfig fields of B, JSON")
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--steps", type=int, default=63, help="decode steps per round (the context grows over them)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy; OpenAI's default is 1")
    parser.add_argument("--small-pages", choices=["A", "B"], help="this side's KV pool on 4 KB pages")
    parser.add_argument("--python-wrapper", choices=["A", "B"], help="this side's decode graph without cpp_wrapper")
    parser.add_argument("--num-kv-blocks", type=int, default=1024)
    parser.add_argument("--loras", type=int, default=0, help="random adapters a side with max_loras spreads its rows over")
    parser.add_argument("--lora-rank", type=int, default=16)
    args = parser.parse_args()
    engines = {side: build(args, fields, small_pages=args.small_pages == side,
                           python_wrapper=args.python_wrapper == side)
               for side, fields in (("A", args.a), ("B", args.b))}
    add_loras(engines.values(), args.loras, args.lora_rank)
    prompts = make_prompts(args.num_requests, args.prompt_len, engines["A"].model_info.vocab_size)
    times: dict[str, list[float]] = {"A": [], "B": []}
    for round_ in range(args.rounds + 1):  # round 0 warms up
        for engine in engines.values():
            start(engine, prompts, args.steps + 1, args.temperature)
        for step in range(args.steps):
            order = ("A", "B") if step % 2 == 0 else ("B", "A")
            for side in order:
                ms = timed_step(engines[side])
                if round_:
                    times[side].append(ms)
        for engine in engines.values():
            while engine.has_unfinished_requests():
                engine.step()
    a, b = statistics.median(times["A"]), statistics.median(times["B"])
    print(f"A {args.a}: median decode step of {args.num_requests} {a:.2f} ms")
    print(f"B {args.b}: median decode step of {args.num_requests} {b:.2f} ms")
    print(f"B / A = {b / a:.3f} ({len(times['A'])} steps each, interleaved)")


if __name__ == "__main__":
    main()
