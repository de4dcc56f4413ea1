"""vLLM's offline `LLM.generate` on bench.py's prompts. Runs in vLLM's own venv (stdlib and
vllm only: nothing from this repository), started by bench/peers/vllm_peer.py:

    VENV/bin/python bench/peers/vllm_offline.py REQUEST.json RESULT.json

REQUEST.json holds vllm_peer.OfflineRequest's fields: one sampling setup for every prompt,
or, where `structured_outputs` (and `seeds`) list one per prompt, each prompt its own
`StructuredOutputsParams(**entry)` (and seed); a null `max_num_seqs` keeps vLLM's default. A warm-up generate runs first, on the first
prompts' sampling setups (it compiles their grammars); the measured call submits every
prompt at once, as `LLM.generate` does. RESULT.json holds OfflineResult's fields. The entry
is guarded by `__main__` because vLLM spawns its engine process.
"""

import json
import sys
import time


def sampling_params(request: dict) -> list:
    """One SamplingParams per prompt."""
    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    num_prompts = len(request["prompts"])
    structured = request.get("structured_outputs") or [None] * num_prompts
    seeds = request.get("seeds") or [None] * num_prompts
    return [SamplingParams(max_tokens=request["max_tokens"], temperature=request["temperature"],
                           ignore_eos=request["ignore_eos"], seed=seed,
                           structured_outputs=None if entry is None else StructuredOutputsParams(**entry))
            for entry, seed in zip(structured, seeds)]


def run(request: dict) -> dict:
    from vllm import LLM

    running = {"max_num_seqs": request["max_num_seqs"]} if request.get("max_num_seqs") else {}
    llm = LLM(model=request["model_dir"], dtype=request["dtype"], max_model_len=request["max_model_len"],
              seed=request["seed"], enforce_eager=request["enforce_eager"], **running)
    params = sampling_params(request)
    prompts = lambda key: [{"prompt_token_ids": ids} for ids in request[key]]  # noqa: E731
    warmup = prompts("warmup_prompts")
    llm.generate(warmup, [params[i % len(params)] for i in range(len(warmup))], use_tqdm=False)
    started = time.perf_counter()
    outputs = llm.generate(prompts("prompts"), params, use_tqdm=False)
    duration = time.perf_counter() - started
    completions = [out.outputs[0] for out in outputs]
    return {"duration_s": duration, "output_tokens": [len(c.token_ids) for c in completions],
            "texts": [c.text for c in completions], "finish_reasons": [c.finish_reason for c in completions]}


if __name__ == "__main__":
    with open(sys.argv[1], encoding="utf-8") as file:
        result = run(json.load(file))
    with open(sys.argv[2], "w", encoding="utf-8") as file:
        json.dump(result, file)
