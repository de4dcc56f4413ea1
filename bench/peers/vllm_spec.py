"""One stream's time a token in vLLM's offline `LLM.generate`, with and without n-gram
speculation. Runs in vLLM's own venv (stdlib and vllm only):

    VENV/bin/python vllm_spec.py REQUEST.json RESULT.json

REQUEST.json: model_dir, dtype, prompts (token-id lists), max_tokens, repeats and
speculative_config (null: none). A token's time is (t(max_tokens) - t(1)) / (max_tokens - 1),
each t the median of `repeats` single-prompt calls, over the prompts; RESULT.json holds the
per-prompt ms a token and the output token ids.
"""

import json
import statistics
import sys
import time


def timed(llm, prompt, params) -> tuple[float, list[int]]:
    started = time.perf_counter()
    out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    return time.perf_counter() - started, list(out[0].outputs[0].token_ids)


def run(request: dict) -> dict:
    from vllm import LLM, SamplingParams

    extra = {"speculative_config": request["speculative_config"]} if request.get("speculative_config") else {}
    llm = LLM(model=request["model_dir"], dtype=request["dtype"], max_model_len=1024, seed=0, **extra)
    one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    full = SamplingParams(max_tokens=request["max_tokens"], temperature=0, ignore_eos=True)
    timed(llm, request["prompts"][0], full)  # warm-up
    ms, outputs = [], []
    for prompt in request["prompts"]:
        first = statistics.median(timed(llm, prompt, one)[0] for _ in range(request["repeats"]))
        runs = [timed(llm, prompt, full) for _ in range(request["repeats"])]
        ms.append((statistics.median(t for t, _ in runs) - first) / (request["max_tokens"] - 1) * 1e3)
        outputs.append(runs[0][1])
    return {"ms_per_token": ms, "outputs": outputs}


if __name__ == "__main__":
    with open(sys.argv[1], encoding="utf-8") as file:
        result = run(json.load(file))
    with open(sys.argv[2], "w", encoding="utf-8") as file:
        json.dump(result, file)
