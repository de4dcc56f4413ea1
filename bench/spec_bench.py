"""Speculative decoding by prompt lookup, one stream: the engine's time a token with and
without it, and vLLM's CPU build offline with and without its n-gram speculation, on the
same checkpoint and prompts, greedy.

    python -m bench.spec_bench /tmp/gpt2-random            # outputs repeat (initializer_range 0.02)
    python -m bench.spec_bench /tmp/gpt2-random-08         # they hardly do (0.08)
    python -m bench.spec_bench /tmp/gpt2-random --skip-vllm --streams 32   # 32 streams, tok/s

A token's time is (t(max_tokens) - t(1)) / (max_tokens - 1), each t the median of
--repeats single-request runs, averaged over the prompts: the same method for both engines
(bench/peers/vllm_spec.py). --streams N runs N prompts at once instead and prints tok/s.
The checkpoints: `python -m loadtest.make_checkpoint DIR --arch gpt2 [--init-range 0.08]`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from bench.engine_bench import make_prompts
from bench.peers.vllm_peer import require_vllm
from engine import EngineConfig, LLMEngine, SamplingParams
from engine.speculative.config import SpeculativeConfig

SPEC = SpeculativeConfig()  # the engine's default
VLLM_SPEC = {"method": "ngram", "num_speculative_tokens": SPEC.num_speculative_tokens,
             "prompt_lookup_max": SPEC.prompt_lookup_max, "prompt_lookup_min": SPEC.prompt_lookup_min}
VLLM_SCRIPT = Path(__file__).resolve().parent / "peers" / "vllm_spec.py"


def generate(engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> tuple[float, list[list[int]]]:
    """Seconds to run the prompts together to the end, and each one's tokens."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    started = time.perf_counter()
    ids = [f"spec-{time.monotonic_ns()}-{i}" for i in range(len(prompts))]
    for request_id, prompt in zip(ids, prompts):
        engine.add_request(request_id, prompt, params)
    tokens: dict[str, list[int]] = {request_id: [] for request_id in ids}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.token_id is not None:
                tokens[out.request_id].append(out.token_id)
    return time.perf_counter() - started, [tokens[request_id] for request_id in ids]


def engine_ms_per_token(engine: LLMEngine, prompts: list[list[int]], max_tokens: int, repeats: int,
                        ) -> tuple[float, list[list[int]]]:
    generate(engine, prompts[:1], max_tokens)  # warm-up
    ms, outputs = [], []
    for prompt in prompts:
        first = statistics.median(generate(engine, [prompt], 1)[0] for _ in range(repeats))
        runs = [generate(engine, [prompt], max_tokens) for _ in range(repeats)]
        ms.append((statistics.median(t for t, _ in runs) - first) / (max_tokens - 1) * 1e3)
        outputs.append(runs[0][1][0])
    return statistics.mean(ms), outputs


def vllm_ms_per_token(model_dir: Path, prompts: list[list[int]], max_tokens: int, repeats: int, dtype: str,
                      speculative: dict | None) -> tuple[float, list[list[int]]]:
    setup = require_vllm()
    with tempfile.TemporaryDirectory(prefix="vllm-spec-") as tmp:
        request, result = Path(tmp) / "request.json", Path(tmp) / "result.json"
        request.write_text(json.dumps({"model_dir": str(model_dir.resolve()), "dtype": dtype, "prompts": prompts,
                                       "max_tokens": max_tokens, "repeats": repeats,
                                       "speculative_config": speculative}))
        done = subprocess.run([str(setup.python), str(VLLM_SCRIPT), str(request), str(result)], env=setup.env(),
                              capture_output=True, text=True, timeout=1800)
        if done.returncode != 0:
            raise RuntimeError(f"vLLM failed:\n{(done.stdout + done.stderr)[-3000:]}")
        out = json.loads(result.read_text())
    return statistics.mean(out["ms_per_token"]), out["outputs"]


def acceptance(engine: LLMEngine) -> str:
    stats = engine.stats()
    rate = stats.num_spec_accepted_tokens / max(stats.num_spec_proposed_tokens, 1)
    return f"{stats.num_spec_accepted_tokens}/{stats.num_spec_proposed_tokens} proposals kept ({rate:.0%})"


def one_stream(args: argparse.Namespace, prompts: list[list[int]]) -> None:
    rows = {}
    for label, spec in (("without", None), ("with", SPEC)):
        engine = LLMEngine(EngineConfig(model=str(args.model_dir), weights="pretrained", speculative=spec))
        rows[f"rayinfer {label}"] = engine_ms_per_token(engine, prompts, args.max_tokens, args.repeats)
        if spec:
            print(f"rayinfer: {acceptance(engine)}")
        dtype = engine.model_info.dtype
        del engine
    if not args.skip_vllm:
        for label, spec in (("without", None), ("with", VLLM_SPEC)):
            rows[f"vLLM {label}"] = vllm_ms_per_token(args.model_dir, prompts, args.max_tokens, args.repeats, dtype, spec)
    base = rows["rayinfer without"][1]
    for name, (ms, outputs) in rows.items():
        same = sum(a == b for a, b in zip(outputs, base))
        print(f"{name:18s} {ms:7.2f} ms a token   outputs equal to rayinfer without: {same}/{len(base)}")
    print(f"rayinfer with / without: {rows['rayinfer with'][0] / rows['rayinfer without'][0]:.2f}")
    if not args.skip_vllm:
        print(f"vLLM with / without: {rows['vLLM with'][0] / rows['vLLM without'][0]:.2f}; "
              f"rayinfer with / vLLM with: {rows['rayinfer with'][0] / rows['vLLM with'][0]:.2f}")


def many_streams(args: argparse.Namespace, prompts: list[list[int]]) -> None:
    for label, spec in (("without", None), ("with", SPEC), ("without", None), ("with", SPEC)):
        engine = LLMEngine(EngineConfig(model=str(args.model_dir), weights="pretrained", speculative=spec))
        generate(engine, prompts[:4], 8)  # warm-up
        seconds, outputs = generate(engine, prompts, args.max_tokens)
        extra = f", {acceptance(engine)}" if spec else ""
        print(f"rayinfer {label}: {sum(map(len, outputs)) / seconds:.1f} tok/s{extra}")
        del engine


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model_dir", type=Path)
    parser.add_argument("--num-prompts", type=int, default=3)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--streams", type=int, default=1)
    parser.add_argument("--skip-vllm", action="store_true")
    args = parser.parse_args(argv)
    vocab = json.loads((args.model_dir / "config.json").read_text())["vocab_size"]
    if args.streams > 1:
        many_streams(args, make_prompts(args.streams, args.prompt_len, vocab))
    else:
        one_stream(args, make_prompts(args.num_prompts, args.prompt_len, vocab))


if __name__ == "__main__":
    main()
