"""A short prefill's step, eager against the compiled graph (`graph_prefill_tokens`), in one
engine and interleaved, so this machine's drift falls on both alike:

    python -m bench.micro.prefill_step_bench --dtype bfloat16

Two steps, each timed `--rounds` times per side (the order alternating round by round):
`alone`, one new prompt of `--prompt-tokens` with nothing else running; `beside decodes`,
the same prompt arriving while `--decodes` sequences decode, one step computing all of them.
Prints each side's median step and the graph's over eager. GPT-2-small architecture in
random weights unless --model names a checkpoint.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time

from engine.config import EngineConfig
from engine.core.llm_engine import LLMEngine
from engine.request.sampling_params import SamplingParams
from bench.engine_bench import make_prompts

_SIDES = {"eager": 0, "graph": 64}  # graph_prefill_tokens
_WARM_ROUNDS = 2  # left out of the medians


def timed_step(engine: LLMEngine) -> float:
    start = time.perf_counter()
    engine.step()
    return (time.perf_counter() - start) * 1000


def alone(engine: LLMEngine, prompt: list[int], request_id: str) -> float:
    engine.add_request(request_id, prompt, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
    elapsed = timed_step(engine)
    drain(engine)
    return elapsed


def beside_decodes(engine: LLMEngine, prompts: list[list[int]], prompt: list[int], request_id: str) -> float:
    params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    ids = [f"{request_id}-{i}" for i in range(len(prompts) + 1)]
    for rid, decoding in zip(ids, prompts):
        engine.add_request(rid, decoding, params)
    engine.step()  # their prefill
    engine.step()  # a decode step, so the next is a decode step plus the new prompt
    engine.add_request(ids[-1], prompt, params)
    elapsed = timed_step(engine)
    for rid in ids:
        engine.abort_request(rid)
    drain(engine)
    return elapsed


def drain(engine: LLMEngine) -> None:
    while engine.has_unfinished_requests():
        engine.step()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gpt2")
    parser.add_argument("--weights", default="random")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--prompt-tokens", type=int, default=16)
    parser.add_argument("--decodes", type=int, default=31)
    parser.add_argument("--rounds", type=int, default=12)
    args = parser.parse_args()
    engine = LLMEngine(EngineConfig(model=args.model, weights=args.weights, dtype=args.dtype, device="cpu",
                                    compile_decode=True, enable_prefix_caching=False))
    vocab_size = engine.model_info.vocab_size
    times: dict[tuple[str, str], list[float]] = {}
    request_ids = (f"p{i}" for i in itertools.count())
    for rounds in range(args.rounds):
        for side in (_SIDES if rounds % 2 else reversed(_SIDES)):
            engine.runner.graph_prefill_tokens = _SIDES[side]
            prompt = make_prompts(1, args.prompt_tokens, vocab_size, seed=rounds)[0]
            times.setdefault(("alone", side), []).append(alone(engine, prompt, next(request_ids)))
            decoding = make_prompts(args.decodes, args.prompt_tokens, vocab_size, seed=1000 + rounds)
            times.setdefault(("beside decodes", side), []).append(
                beside_decodes(engine, decoding, prompt, next(request_ids)))
    for step in ("alone", "beside decodes"):
        eager, graph = (statistics.median(times[(step, side)][_WARM_ROUNDS:]) for side in _SIDES)
        print(f"{args.dtype}, {args.prompt_tokens}-token prompt {step}: eager {eager:.2f} ms, "
              f"graph {graph:.2f} ms, graph / eager {graph / eager:.2f}")


if __name__ == "__main__":
    main()
