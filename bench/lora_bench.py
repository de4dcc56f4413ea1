"""LoRA offline: streams spread over adapters against the base model on the same prompts, and
against HF + PEFT's own mixed-adapter batch, same run; then the time from reading a new
adapter to the first token of the first request naming it.

    python -m bench.lora_bench                                  # GPT-2-small, random weights, 32 streams, 8 adapters
    python -m bench.lora_bench --hf-dtypes float32,bfloat16     # the peer in both dtypes
    python -m bench.lora_bench --skip-hf                        # the engine alone

The adapters: rank 16 on c_attn, c_proj and c_fc, random A and B, written by PEFT's
save_pretrained for the model (bench/peers/peft_peer.py). The engine runs EngineConfig's
defaults (the offline LLM's: bf16 where the CPU has it, the compiled decode graph) with
max_loras = the adapters; rows of every adapter share each step. The base run is the same
prompts with no adapter. Load to first token: LLMEngine.add_lora (the offline engine API,
what an engine replica calls on the first request naming an adapter), then that request's
steps until its first token, with every slot already taken (a slot evicted for it).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import tempfile
import time
from pathlib import Path

import torch

from bench.engine_bench import Result, hf_model, make_prompts, run_engine
from bench.peers.peft_peer import peft_model, run_peft_mixed, save_adapters
from engine.config import EngineConfig
from engine.core.llm_engine import LLMEngine
from engine.request.sampling_params import SamplingParams


def run_lora(engine: LLMEngine, prompts: list[list[int]], names: list[str | None], max_tokens: int) -> Result:
    """Every prompt at once, each under its adapter (None: the base model), greedy."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    start = time.perf_counter()
    for i, (prompt, name) in enumerate(zip(prompts, names)):
        engine.add_request(f"lora-{time.monotonic_ns()}-{i}", prompt, params, lora_name=name)
    num_tokens = 0
    while engine.has_unfinished_requests():
        num_tokens += sum(out.token_id is not None for out in engine.step())
    return Result(f"rayinfer, {len(set(names))} adapters", num_tokens, time.perf_counter() - start)


def load_to_first_token_s(engine: LLMEngine, name: str, path: Path, prompt: list[int]) -> float:
    """From add_lora to the first token of one request naming the adapter, on an idle engine."""
    start = time.perf_counter()
    engine.add_lora(name, str(path))
    request_id = f"load-{name}-{time.monotonic_ns()}"
    engine.add_request(request_id, prompt, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True), lora_name=name)
    first = None
    while engine.has_unfinished_requests():
        outputs = engine.step()
        if first is None and any(o.request_id == request_id and o.token_id is not None for o in outputs):
            first = time.perf_counter() - start
    return first


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gpt2")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--num-adapters", type=int, default=8)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2, help="base and LoRA runs, interleaved; the best of each")
    parser.add_argument("--num-loads", type=int, default=3, help="new adapters timed from load to first token")
    parser.add_argument("--hf-dtypes", default="float32", help="comma-separated dtypes for HF + PEFT")
    parser.add_argument("--skip-hf", action="store_true")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    config = EngineConfig(model=args.model, weights="random", dtype=args.dtype, max_loras=args.num_adapters,
                          max_lora_rank=args.rank, max_num_seqs=max(64, args.num_requests))
    base_fp32 = hf_model(dataclasses.replace(config, dtype="float32"))
    with tempfile.TemporaryDirectory() as tmp:
        adapters = save_adapters(base_fp32, Path(tmp), args.num_adapters + args.num_loads, args.rank)
        served = dict(list(adapters.items())[:args.num_adapters])
        engine = LLMEngine(config)
        for name, path in served.items():
            engine.add_lora(name, str(path))
        print(f"model={args.model} dtype={config.torch_dtype} threads={torch.get_num_threads()} "
              f"compile_decode={engine.runner.decode_graph is not None} requests={args.num_requests} "
              f"adapters={args.num_adapters} rank={args.rank} prompt_len={args.prompt_len} max_tokens={args.max_tokens}")
        prompts = make_prompts(args.num_requests, args.prompt_len, engine.model_info.vocab_size)
        names = [list(served)[i % len(served)] for i in range(len(prompts))]
        base, lora = engine_runs(engine, prompts, names, args.max_tokens, args.repeats)
        peers = [] if args.skip_hf else [hf_peft_run(config, served, prompts, names, args.max_tokens, dtype)
                                         for dtype in args.hf_dtypes.split(",")]
        loads = [load_to_first_token_s(engine, name, path, prompts[0])
                 for name, path in list(adapters.items())[args.num_adapters:]]
    report([lora, base, *peers])
    table(lora, base, peers, loads)


def table(lora: Result, base: Result, peers: list[Result], loads: list[float]) -> None:
    print("| row | rayinfer | peer, same run | ratio |\n|---|---|---|---|")
    print(f"| {lora.name} vs the base model, same prompts | {lora.tokens_per_s:.1f} tok/s | base {base.tokens_per_s:.1f} "
          f"| {lora.tokens_per_s / base.tokens_per_s:.2f}× |")
    for peer in peers:
        print(f"| vs {peer.name} | {lora.tokens_per_s:.1f} tok/s | {peer.tokens_per_s:.1f} "
              f"| {lora.tokens_per_s / peer.tokens_per_s:.2f}× |")
    print(f"| load to first token (LLMEngine.add_lora, every slot taken) | median {statistics.median(loads) * 1000:.0f} ms "
          f"({', '.join(f'{s * 1000:.0f}' for s in loads)}) | | |")


def engine_runs(engine: LLMEngine, prompts: list[list[int]], names: list[str], max_tokens: int,
                repeats: int) -> tuple[Result, Result]:
    """The best base run and the best LoRA run of `repeats` each, interleaved, after a warm-up of both."""
    run_engine(engine, prompts[:4], 4)
    run_lora(engine, prompts[:len(set(names))], names[:len(set(names))], 4)
    bases, loras = [], []
    for _ in range(repeats):
        bases.append(run_engine(engine, prompts, max_tokens, name="rayinfer, base model"))
        loras.append(run_lora(engine, prompts, names, max_tokens))
    return max(bases, key=lambda r: r.tokens_per_s), max(loras, key=lambda r: r.tokens_per_s)


def hf_peft_run(config: EngineConfig, adapters: dict[str, Path], prompts: list[list[int]], names: list[str],
                max_tokens: int, dtype: str) -> Result:
    """HF + PEFT's mixed-adapter batch on the engine's weights and the same adapters, after a warm-up."""
    model = peft_model(hf_model(dataclasses.replace(config, dtype="float32")), adapters).to(getattr(torch, dtype))
    run_peft_mixed(model, prompts[:4], names[:4], 4)
    num_tokens, seconds = run_peft_mixed(model, prompts, names, max_tokens)
    return Result(f"HF + PEFT mixed batch ({dtype})", num_tokens, seconds)


def report(results: list[Result]) -> None:
    for r in results:
        print(f"{r.name:34s} {r.num_tokens:6d} tokens in {r.seconds:6.2f} s = {r.tokens_per_s:7.1f} tok/s")


if __name__ == "__main__":
    main()
