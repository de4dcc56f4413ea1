"""Offline throughput benchmark: the engine vs Hugging Face `generate` (static batch), same run.

    python -m bench.engine_bench                      # GPT-2-small, random weights, the engine's defaults
    python -m bench.engine_bench --num-requests 32 --prompt-len 16 --max-tokens 64 --dtype bfloat16
    python -m bench.engine_bench --device cuda --skip-hf --cuda-graphs false   # vs true, vs --compile-decode false
    python -m bench.engine_bench --vllm /tmp/gpt2-random   # and vLLM's CPU build offline, on the same prompts
    python -m bench.engine_bench --structured --max-num-seqs 16 --skip-hf   # structured outputs, 16 streams
    python -m bench.engine_bench --structured --max-num-seqs 16 --skip-hf --vllm /tmp/gpt2-random   # and vLLM's

--structured runs a mix of JSON-schema, JSON-object, regex and choice requests
(loadtest/client/structured_requests.py), sampled at temperature 1 with a seed each, then the
same requests unconstrained, and prints for each: the share that ended by itself, the share of
those that are valid, and tokens/s; grammars are compiled in a warm-up first (the compile time
is printed apart). With --vllm, vLLM's `LLM.generate` runs the same constrained requests
(the same prompts, limits and seeds, `structured_outputs` as vLLM takes it, --max-num-seqs
running), tallied the same way, and the table adds rayinfer's constrained tok/s over vLLM's.

--vllm runs vLLM's `LLM.generate` on a checkpoint directory of the same architecture (its own
venv: bench/peers/vllm_peer.py), greedy, after the engine and HF, in the engine's dtype.
The checkpoint's weights are its own, not the engine's random ones.

The engine runs with EngineConfig's defaults (what `LLM(model)` runs) but for the flags given.
Prints tokens/s for both and the engine's single-request decode latency per token.
"""

from __future__ import annotations

import argparse
import itertools
import time
from dataclasses import dataclass

import torch
from transformers import GPT2LMHeadModel

from engine.config import EngineConfig
from engine.core.llm_engine import LLMEngine, build_model
from engine.model.gpt2 import CONV1D_WEIGHTS, hf_to_own_name
from engine.model.loader import load_tokenizer, resolve_model
from engine.request.sampling_params import SamplingParams
from loadtest.client.structured_requests import StructuredRequest, StructuredTally, structured_mix
from bench.peers.vllm_peer import OfflineRequest, OfflineResult, require_vllm, run_vllm_offline


@dataclass
class Result:
    name: str
    num_tokens: int
    seconds: float

    @property
    def tokens_per_s(self) -> float:
        return self.num_tokens / self.seconds


def make_prompts(num_requests: int, prompt_len: int, vocab_size: int, seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (num_requests, prompt_len), generator=generator).tolist()


def run_engine(engine: LLMEngine, prompts: list[list[int]], max_tokens: int, name: str = "rayinfer engine") -> Result:
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"bench-{time.monotonic_ns()}-{i}", prompt, params)
    num_tokens = 0
    while engine.has_unfinished_requests():
        num_tokens += sum(out.token_id is not None for out in engine.step())
    return Result(name, num_tokens, time.perf_counter() - start)


def decode_ms_per_token(engine: LLMEngine, prompt: list[int], max_tokens: int) -> float:
    """Single request: mean time per token after the first (decode steps, several tokens a
    step where speculation's proposals are kept)."""
    engine.add_request(f"single-{time.monotonic_ns()}", prompt, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
    engine.step()  # prefill + first token
    start = time.perf_counter()
    num_tokens = 0
    while engine.has_unfinished_requests():
        num_tokens += sum(out.token_id is not None for out in engine.step())
    return (time.perf_counter() - start) / num_tokens * 1000


def hf_model(config: EngineConfig) -> GPT2LMHeadModel:
    """HF's GPT-2 with the same weights as the engine's model: the same random init, unpacked."""
    source = resolve_model(config.model, "random")
    ours = build_model(source, torch.float32, torch.device("cpu"), config.seed).state_dict()
    model = GPT2LMHeadModel(source.config).eval()
    for name, param in model.transformer.state_dict().items():
        own = hf_to_own_name(name)
        if own is None:  # buffers
            continue
        param.copy_(ours[own].t() if name.endswith(CONV1D_WEIGHTS) else ours[own])
    return model.to(config.torch_dtype)


def run_hf(model: GPT2LMHeadModel, prompts: list[list[int]], max_tokens: int) -> Result:
    input_ids = torch.tensor(prompts, device=model.device)
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=max_tokens,
                             min_new_tokens=max_tokens, do_sample=False, pad_token_id=0)
    if out.is_cuda:
        torch.cuda.synchronize()
    num_tokens = (out.shape[1] - input_ids.shape[1]) * out.shape[0]
    return Result("HF generate (static batch)", num_tokens, time.perf_counter() - start)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gpt2")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--compile-decode", choices=["auto", "true", "false"], default="auto",
                        help="decode steps through the compiled graph (EngineConfig.compile_decode)")
    parser.add_argument("--cuda-graphs", choices=["auto", "true", "false"], default="auto",
                        help="decode steps replayed from CUDA graphs (EngineConfig.cuda_graphs; auto: on CUDA)")
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--vllm", metavar="CHECKPOINT_DIR", help="also vLLM's CPU build offline, on this checkpoint")
    parser.add_argument("--structured", action="store_true",
                        help="structured output requests, constrained and not (no HF run; vLLM's constrained)")
    return parser.parse_args()



def main() -> None:
    args = parse_args()
    config = EngineConfig(model=args.model, weights="random", dtype=args.dtype, device=args.device,
                          max_num_seqs=args.max_num_seqs, compile_decode=_flag(args.compile_decode),
                          cuda_graphs=_flag(args.cuda_graphs))
    engine = LLMEngine(config)
    prompts = make_prompts(args.num_requests, args.prompt_len, engine.model_info.vocab_size)
    run_engine(engine, prompts[:4], 4)  # warm-up
    print(f"model={args.model} dtype={config.torch_dtype} device={config.torch_device} threads={torch.get_num_threads()} "
          f"compile_decode={engine.runner.decode_graph is not None} cuda_graphs={config.decode_graphed} requests={args.num_requests} prompt_len={args.prompt_len} max_tokens={args.max_tokens}")
    dtype = str(config.torch_dtype).removeprefix("torch.")
    if args.structured:
        return structured_bench(engine, prompts, args.max_tokens, args.vllm, dtype)
    results = [run_engine(engine, prompts, args.max_tokens)]
    single = decode_ms_per_token(engine, prompts[0], args.max_tokens)
    if not args.skip_hf:
        model = hf_model(config).to(config.torch_device)
        run_hf(model, prompts[:4], 4)  # warm-up
        results.append(run_hf(model, prompts, args.max_tokens))
    if args.vllm:
        results.append(run_vllm(args.vllm, prompts, args.max_tokens, dtype))
    for r in results:
        print(f"{r.name:28s} {r.num_tokens:6d} tokens in {r.seconds:6.2f} s = {r.tokens_per_s:7.1f} tok/s")
    for r in results[1:]:
        print(f"rayinfer vs {r.name}: {results[0].tokens_per_s / r.tokens_per_s:.2f}x")
    print(f"single-request decode: {single:.2f} ms/token")


def structured_bench(engine: LLMEngine, prompts: list[list[int]], max_tokens: int, vllm_dir: str | None = None,
                     dtype: str = "bfloat16") -> None:
    """The mix constrained, then the same requests unconstrained, each run to the length its
    constrained twin reached (EOS ignored): the same tokens, with and without the masks; then
    vLLM's run of the constrained requests where a checkpoint is given."""
    requests = structured_mix(len(prompts))
    run_structured(engine, prompts[:8], requests[:8], [max_tokens] * 8)  # compiles the grammars
    stats = engine.stats()
    print(f"{stats.num_grammar_compiles} grammars compiled in {stats.grammar_compile_s * 1000:.1f} ms")
    constrained, lengths = run_structured(engine, prompts, requests, [max_tokens] * len(prompts))
    free, _ = run_structured(engine, prompts, requests, lengths, constrained=False)
    vllm = None
    if vllm_dir:
        vllm = run_vllm_structured(vllm_dir, prompts, requests, max_tokens, dtype, engine.config.max_num_seqs)
    for tally in (constrained, free, vllm):
        if tally is not None:
            print(tally.line())
    print(f"constrained vs unconstrained tok/s: {constrained.tokens_per_s / free.tokens_per_s:.2f}x")
    if vllm is not None:
        print(f"rayinfer vs vLLM constrained tok/s: {constrained.tokens_per_s / vllm.tokens_per_s:.2f}x")


def run_structured(engine: LLMEngine, prompts: list[list[int]], requests: list[StructuredRequest],
                   max_tokens: list[int], constrained: bool = True) -> tuple[StructuredTally, list[int]]:
    """The requests at temperature 1, seeded, all at once (max_num_seqs of them running); the
    tally and each request's output length."""
    tokenizer = load_tokenizer(engine.config.model)
    ids = [f"structured-{time.monotonic_ns()}-{i}" for i in range(len(requests))]
    for request_id, prompt, request, limit, seed in zip(ids, prompts, requests, max_tokens, itertools.count()):
        engine.add_request(request_id, prompt, SamplingParams(
            max_tokens=limit, temperature=1.0, seed=seed, ignore_eos=not constrained,
            constraint=request.constraint if constrained else None))
    tokens: dict[str, list[int]] = {request_id: [] for request_id in ids}
    ended: set[str] = set()
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.request_id].append(out.token_id)
            if out.finish_reason == "stop":
                ended.add(out.request_id)
    seconds = time.perf_counter() - start
    texts = [tokenizer.decode(tokens[i], skip_special_tokens=True) for i in ids]
    name = "constrained" if constrained else "the same lengths, unconstrained"
    tally = StructuredTally.of_outputs(name, requests, texts, [i in ended for i in ids],
                                       sum(map(len, tokens.values())), seconds)
    return tally, [len(tokens[i]) for i in ids]


def vllm_structured_request(model_dir: str, prompts: list[list[int]], requests: list[StructuredRequest],
                            max_tokens: int, dtype: str, max_num_seqs: int) -> OfflineRequest:
    """run_structured's constrained requests as vLLM's: temperature 1, the same seed each,
    the grammars compiled in a warm-up on the first 8."""
    return OfflineRequest(model_dir, prompts, prompts[:8], max_tokens, temperature=1.0, ignore_eos=False, dtype=dtype,
                          max_num_seqs=max_num_seqs, structured_outputs=[r.structured_outputs for r in requests],
                          seeds=list(range(len(requests))))


def vllm_tally(requests: list[StructuredRequest], result: OfflineResult) -> StructuredTally:
    ended = [reason == "stop" for reason in result.finish_reasons]
    return StructuredTally.of_outputs("vLLM constrained (LLM.generate)", requests, result.texts, ended,
                                      sum(result.output_tokens), result.duration_s)


def run_vllm_structured(model_dir: str, prompts: list[list[int]], requests: list[StructuredRequest],
                        max_tokens: int, dtype: str, max_num_seqs: int) -> StructuredTally:
    request = vllm_structured_request(model_dir, prompts, requests, max_tokens, dtype, max_num_seqs)
    return vllm_tally(requests, run_vllm_offline(request, require_vllm()))


def run_vllm(model_dir: str, prompts: list[list[int]], max_tokens: int, dtype: str) -> Result:
    request = OfflineRequest(model_dir, prompts, prompts[:4], max_tokens, temperature=0.0, dtype=dtype)
    result = run_vllm_offline(request, require_vllm())
    return Result("vLLM offline (LLM.generate)", sum(result.output_tokens), result.duration_s)


def _flag(value: str) -> bool | str:
    return {"true": True, "false": False}.get(value, value)


if __name__ == "__main__":
    main()
