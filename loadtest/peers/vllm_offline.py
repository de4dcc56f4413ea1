"""vLLM's offline `LLM.generate` on bench.py's prompts. Runs in vLLM's own venv (stdlib and
vllm only: nothing from this repository), started by loadtest/peers/vllm_peer.py:

    VENV/bin/python loadtest/peers/vllm_offline.py REQUEST.json RESULT.json

REQUEST.json holds vllm_peer.OfflineRequest's fields. A warm-up generate runs first; the
measured call submits every prompt at once, as `LLM.generate` does. The entry is guarded by
`__main__` because vLLM spawns its engine process.
"""

import json
import sys
import time


def run(request: dict) -> dict:
    from vllm import LLM, SamplingParams

    llm = LLM(model=request["model_dir"], dtype=request["dtype"], max_model_len=request["max_model_len"],
              seed=request["seed"], enforce_eager=request["enforce_eager"])
    params = SamplingParams(max_tokens=request["max_tokens"], temperature=request["temperature"],
                            ignore_eos=request["ignore_eos"])
    prompts = lambda key: [{"prompt_token_ids": ids} for ids in request[key]]  # noqa: E731
    llm.generate(prompts("warmup_prompts"), params, use_tqdm=False)
    started = time.perf_counter()
    outputs = llm.generate(prompts("prompts"), params, use_tqdm=False)
    duration = time.perf_counter() - started
    return {"duration_s": duration, "output_tokens": [len(out.outputs[0].token_ids) for out in outputs]}


if __name__ == "__main__":
    with open(sys.argv[1], encoding="utf-8") as file:
        result = run(json.load(file))
    with open(sys.argv[2], "w", encoding="utf-8") as file:
        json.dump(result, file)
