"""lm-evaluation-harness, unchanged and in its defaults, against rayinfer and against its own
`hf` backend on the same fp32 checkpoint: every loglikelihood within 1e-3, the same
is_greedy, identical generations.

Two tasks of our own on local data (no hub): `rayinfer_ll`, multiple choice (lm-eval scores
each choice by loglikelihood: `local-completions` sends token-id prompts with echo,
logprobs 1 and max_tokens 1, and reads prompt logprobs), and `rayinfer_gen`, generate_until
(greedy, stop strings). lm-eval's `local-completions` probes /tokenizer_info and /tokenize
and, finding them, tokenizes through the server (its default tokenizer_backend "auto").

    python -m loadtest.make_checkpoint /tmp/tiny-ckpt --arch tiny
    python -m bench.lmeval_check /tmp/tiny-ckpt --lm-eval /work/.venvs/lmeval/bin/lm_eval

lm-eval lives in its own virtual environment (it pins packages the app does not need).
The script starts `serve run` on the checkpoint itself and stops it at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from loadtest.client import serve_process

TOLERANCE = 1e-3
SERVED_NAME = "tiny"
PORT = 8011

QUESTIONS = [
    ("The capital of France is", [" Paris", " London", " Rome", " a large city on the Seine"]),
    ("Two plus two equals", [" four", " five", " 22"]),
    ("The opposite of hot is", [" cold", " warm", " very, very hot indeed"]),
    ("Water freezes at zero degrees", [" Celsius", " Fahrenheit", " Kelvin"]),
    ("def add(a, b):\n    return", [" a + b", " a - b", " None"]),
    ("Once upon a time, there was a", [" princess", " dragon", " small village by the sea"]),
]
PROMPTS = ["Once upon a time", "The quick brown fox", "import numpy as np\n", "Q: What is 2+2?\nA:",
           "Dear Sir or Madam,", "In 1492, Columbus"]

LL_TASK = """task: rayinfer_ll
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: 0
target_delimiter: ""
metric_list:
  - metric: acc
"""
GEN_TASK = """task: rayinfer_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{prompt}}}}"
doc_to_target: ""
target_delimiter: ""
generation_kwargs:
  until: ["\\n\\n", "."]
  max_gen_toks: 24
  do_sample: false
metric_list:
  - metric: exact_match
"""


def greedy_choices(checkpoint: Path, num_tokens: int = 3) -> list[str]:
    """Each question's greedy continuation on this checkpoint, decoded, so that some choices
    are the model's argmax and lm-eval's is_greedy is true for them (random weights make
    every hand-written choice non-greedy)."""
    import torch
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(checkpoint)
    model = transformers.GPT2LMHeadModel.from_pretrained(checkpoint, dtype=torch.float32).eval()
    texts = []
    for question, _ in QUESTIONS:
        ids = tokenizer(question, return_tensors="pt").input_ids
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=num_tokens, do_sample=False, pad_token_id=0)
        texts.append(tokenizer.decode(out[0, ids.shape[1]:]))
    return texts


def write_tasks(directory: Path, checkpoint: Path) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    ll_data, gen_data = directory / "ll.jsonl", directory / "gen.jsonl"
    greedy = greedy_choices(checkpoint)
    rows = [{"question": q, "choices": [*c, g]} for (q, c), g in zip(QUESTIONS, greedy)]
    ll_data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    gen_data.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    (directory / "rayinfer_ll.yaml").write_text(LL_TASK.format(data=ll_data))
    (directory / "rayinfer_gen.yaml").write_text(GEN_TASK.format(data=gen_data))


def serve_config(checkpoint: Path, path: Path) -> Path:
    path.write_text(f"""http_options: {{host: 127.0.0.1, port: {PORT}}}
applications:
  - name: rayinfer
    route_prefix: /
    import_path: deployments.app:build_app
    args:
      model: {checkpoint}
      served_model_name: {SERVED_NAME}
      weights: pretrained
      dtype: float32
      engine: {{max_num_seqs: 16, max_num_batched_tokens: 512, num_kv_blocks: 256}}
""")
    return path


class ServeRun:
    """`serve run` on the checkpoint, stopped with Ctrl-C as a user stops it."""

    def __init__(self, config: Path, log: Path) -> None:
        self._log = log
        with log.open("w") as out:
            self.proc = subprocess.Popen(["serve", "run", "--address", "local", str(config)], stdout=out,
                                         stderr=subprocess.STDOUT, env=os.environ | {"HF_HUB_OFFLINE": "1"},
                                         preexec_fn=serve_process.restore_sigint)

    def wait_ready(self, timeout_s: float = 240) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                sys.exit(f"serve run exited:\n{self._log.read_text()[-3000:]}")
            try:
                if httpx.get(f"http://127.0.0.1:{PORT}/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(1)
        sys.exit("serve run not ready in time")

    def stop(self) -> None:
        serve_process.stop(self.proc)


def run_lm_eval(lm_eval: str, model: str, model_args: str, tasks: Path, out: Path) -> dict[str, list[dict]]:
    """Runs lm_eval; returns each task's logged samples, in document order."""
    cmd = [lm_eval, "--model", model, "--model_args", model_args, "--tasks", "rayinfer_ll,rayinfer_gen",
           "--include_path", str(tasks), "--output_path", str(out), "--log_samples", "--batch_size", "1"]
    env = os.environ | {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    print("$", " ".join(cmd), flush=True)
    result = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if result.returncode != 0:
        sys.exit(f"lm_eval failed ({result.returncode}):\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}")
    samples = {}
    for task in ("rayinfer_ll", "rayinfer_gen"):
        [path] = out.rglob(f"samples_{task}_*.jsonl")
        samples[task] = sorted((json.loads(line) for line in path.read_text().splitlines()), key=lambda s: s["doc_id"])
    return samples


def compare(served: dict[str, list[dict]], reference: dict[str, list[dict]]) -> list[str]:
    """Every disagreement, as a line; an empty list means they agree."""
    problems, worst = [], 0.0
    for ours, theirs in zip(served["rayinfer_ll"], reference["rayinfer_ll"], strict=True):
        for i, ((ll, greedy), (ref_ll, ref_greedy)) in enumerate(zip(_ll(ours), _ll(theirs), strict=True)):
            worst = max(worst, abs(ll - ref_ll))
            if abs(ll - ref_ll) > TOLERANCE or greedy != ref_greedy:
                problems.append(f"doc {ours['doc_id']} choice {i}: ({ll:.6f}, {greedy}) "
                                f"vs hf ({ref_ll:.6f}, {ref_greedy})")
    for ours, theirs in zip(served["rayinfer_gen"], reference["rayinfer_gen"], strict=True):
        if ours["resps"] != theirs["resps"]:
            problems.append(f"generation doc {ours['doc_id']}: {ours['resps']!r} vs hf {theirs['resps']!r}")
    num_ll = sum(len(s["resps"]) for s in served["rayinfer_ll"])
    num_greedy = sum(greedy for s in served["rayinfer_ll"] for _, greedy in _ll(s))
    print(f"{num_ll} loglikelihoods ({num_greedy} is_greedy), largest difference {worst:.2e} (tolerance {TOLERANCE}); "
          f"{len(served['rayinfer_gen'])} generations compared")
    return problems


def _ll(sample: dict) -> list[tuple[float, bool]]:
    return [(float(r[0][0]), r[0][1] in (True, "True")) for r in sample["resps"]]  # logged as a string


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", type=Path)
    parser.add_argument("--lm-eval", default="lm_eval", help="the lm_eval executable (its own venv)")
    parser.add_argument("--workdir", type=Path, default=None)
    args = parser.parse_args(argv)
    work = args.workdir or Path(tempfile.mkdtemp(prefix="lmeval-check-"))
    write_tasks(work / "tasks", args.checkpoint.resolve())
    server = ServeRun(serve_config(args.checkpoint.resolve(), work / "serve.yaml"), work / "serve.log")
    try:
        server.wait_ready()
        url = f"http://127.0.0.1:{PORT}/v1/completions"
        served = run_lm_eval(args.lm_eval, "local-completions", f"model={SERVED_NAME},base_url={url}",
                             work / "tasks", work / "served")
    finally:
        server.stop()
    reference = run_lm_eval(args.lm_eval, "hf", f"pretrained={args.checkpoint.resolve()},dtype=float32",
                            work / "tasks", work / "hf")
    problems = compare(served, reference)
    print("\n".join(problems) if problems else "rayinfer and lm-eval's hf backend agree")
    sys.exit(1 if problems else 0)


if __name__ == "__main__":
    main()
