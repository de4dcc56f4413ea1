"""Every figure on the results page (BENCHMARKS.md), measured again by one command.

    python -m bench.results_page --checkpoint /tmp/gpt2-random --out bench_out/page [--areas engine,http]

Runs each row's command, the same ones the page names, one after another (one server up
at a time), under a progress bar over the rows; each command's output goes to
OUT/<area>-<row>.log and its closing table to OUT/results.md, grouped as the page is.
`--dry-run` prints the commands instead. Rows whose tools are not installed here (vLLM's
venv, the real clients' venvs) are skipped with the reason.
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from bench.peers.vllm_peer import find_vllm

# The AVX2-only CPU, emulated on this one (BENCHMARKS.md's `CAPS`).
CAPS = {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2",
        "RAYINFER_CPU_ISA": "avx2"}
PY = sys.executable


@dataclass(frozen=True)
class Row:
    area: str
    name: str
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    needs: str = ""  # "vllm": vLLM's venv; "clients": the real clients' venvs

    def command(self) -> str:
        argv = ["python" if arg == PY else shlex.quote(arg) for arg in self.argv]
        return " ".join([*(f"{k}={v}" for k, v in self.env.items()), *argv])


def rows(checkpoint: str, tiny_checkpoint: str, venvs: str) -> list[Row]:
    engine_bench = [PY, "-m", "bench.engine_bench", "--num-requests", "32", "--prompt-len", "16", "--max-tokens", "64"]
    peer_table = [PY, "-m", "bench.peers.peer_table", "--checkpoint", checkpoint, "--rounds", "3"]
    scale = [PY, "-m", "bench.scale.scale_bench", "--model", "gpt2", "--weights", "random",
             "--setups", "prefix-router,serve-default,serve-default,prefix-router"]
    return [
        Row("engine", "bf16-vs-hf-and-vllm", [*engine_bench, "--vllm", checkpoint], needs="vllm"),
        Row("engine", "avx2-vs-hf", engine_bench, env=CAPS),
        Row("engine", "structured", [PY, "-m", "bench.engine_bench", "--structured", "--max-num-seqs", "16", "--skip-hf",
                                     "--num-requests", "64", "--max-tokens", "64", "--model", checkpoint,
                                     "--vllm", checkpoint], needs="vllm"),
        Row("http", "vs-vllm", peer_table, needs="vllm"),
        Row("http", "vs-vllm-avx2", [*peer_table, "--dtype", "float32"], env=CAPS, needs="vllm"),
        Row("scale", "shared", [*scale, "--workload", "shared", "--num-requests", "192", "--num-prefixes", "24",
                                "--engine", "num_kv_blocks=288"]),
        Row("scale", "hot", [*scale, "--workload", "hot", "--concurrency", "16", "--num-requests", "192"]),
        Row("scale", "free", [*scale, "--workload", "free", "--concurrency", "16", "--num-requests", "128"]),
        Row("lora", "offline-vs-base-and-peft", [PY, "-m", "bench.lora_bench", "--hf-dtypes", "float32,bfloat16"]),
        Row("lora", "route-prefix-router", [PY, "-m", "bench.scale.lora_route_bench", "--design", "prefix-router",
                                            "--model", checkpoint]),
        Row("lora", "route-multiplex", [PY, "-m", "bench.scale.lora_route_bench", "--design", "multiplex",
                                        "--model", checkpoint]),
        Row("startup", "cold-vs-vllm", [PY, "-m", "bench.peers.startup_time", "--config", "configs/gpt2.yaml",
                                        "--cold", "--runs", "2", "--vllm-checkpoint", checkpoint], needs="vllm"),
        Row("startup", "warm-vs-vllm", [PY, "-m", "bench.peers.startup_time", "--config", "configs/gpt2.yaml",
                                        "--runs", "3", "--vllm-checkpoint", checkpoint], needs="vllm"),
        Row("clients", "lm-eval", [PY, "-m", "bench.lmeval_check", tiny_checkpoint, "--lm-eval",
                                   f"{venvs}/lmeval/bin/lm_eval"], needs="clients"),
        Row("clients", "guidellm-aiperf", ["bench/real_clients.sh", tiny_checkpoint, venvs, "bench_out/real-clients"],
            needs="clients"),
    ]


def missing(row: Row, venvs: str) -> str | None:
    """Why this row can't run here, or None."""
    if row.needs == "vllm" and find_vllm() is None:
        return "vLLM's CPU build is not installed (bench/README.md)"
    if row.needs == "clients" and not Path(venvs, "lmeval").is_dir():
        return f"no real-client venvs under {venvs}"
    return None


def closing_table(output: str) -> str:
    """The last markdown table a command printed (each prints its figures last), else its last lines."""
    lines = output.rstrip().splitlines()
    end = len(lines)
    while end and not lines[end - 1].startswith("|"):
        end -= 1
    start = end
    while start and lines[start - 1].startswith("|"):
        start -= 1
    return "\n".join(lines[start:end] if end else lines[-5:])


def run_row(row: Row, out: Path) -> str:
    log = out / f"{row.area}-{row.name}.log"
    done = subprocess.run(row.argv, env={**os.environ, **row.env}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True)
    log.write_text(done.stdout)
    status = "" if done.returncode == 0 else f"\n\n(exit {done.returncode}: see {log})"
    return closing_table(done.stdout) + status


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", default="/tmp/gpt2-random",
                        help="GPT-2-small checkpoint (python -m loadtest.make_checkpoint DIR --arch gpt2)")
    parser.add_argument("--tiny-checkpoint", default="/tmp/http-ckpt",
                        help="the real clients' checkpoint (python -m loadtest.make_checkpoint DIR --arch tiny)")
    parser.add_argument("--venvs", default="/work/.venvs", help="where the real clients' venvs are")
    parser.add_argument("--out", type=Path, default=Path("bench_out/page"))
    parser.add_argument("--areas", default="engine,http,scale,lora,startup,clients")
    parser.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    args = parser.parse_args(argv)
    chosen = [row for row in rows(args.checkpoint, args.tiny_checkpoint, args.venvs) if row.area in args.areas.split(",")]
    if args.dry_run:
        print("\n".join(f"{row.area}/{row.name}: {row.command()}" for row in chosen))
        return 0
    from tqdm import tqdm

    args.out.mkdir(parents=True, exist_ok=True)
    sections = []
    for row in (bar := tqdm(chosen, unit="row")):
        bar.set_description(f"{row.area}/{row.name}")
        reason = missing(row, args.venvs)
        result = f"skipped: {reason}" if reason else run_row(row, args.out)
        sections.append(f"## {row.area}: {row.name}\n\n`{row.command()}`\n\n{result}\n")
    (args.out / "results.md").write_text("\n".join(sections))
    print(f"wrote {args.out / 'results.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
