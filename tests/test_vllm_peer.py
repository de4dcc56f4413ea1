# vLLM's CPU build as a bench peer (bench/peers/vllm_peer.py), the per-process CPU report and
# the peer table's config. The test against a real vLLM runs with RAYINFER_PEER_TESTS=1 where
# its venv is installed; everything else runs without vLLM.
from __future__ import annotations

import contextlib
import json
import os
import shlex
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import transformers
import yaml

from loadtest import bench
from loadtest.client.structured_requests import CHOICES, REGEX, SCHEMA, structured_mix
from bench.engine_bench import vllm_structured_request, vllm_tally
from loadtest.client.http_target import BenchConfig, run_benchmark
from loadtest.client.workload import Workload
from loadtest.client.cpu_usage import cpu_since, cpu_snapshot
from bench.peers.peer_table import parse_args, serve_config
from bench.peers.vllm_peer import (
    ISA_CAP_DIR, TCMALLOC, OfflineResult, VllmServer, VllmServerConfig, VllmSetup, find_vllm, require_vllm,
    run_vllm_offline, run_vllm_offline_target, start_vllm_target,
)  # fmt: skip

ROOT = Path(__file__).resolve().parents[1]


def _fake_venv(root: Path, python_script: str) -> Path:
    """A venv that looks installed, whose python runs `python_script` (to inject a failure)."""
    (root / "bin").mkdir(parents=True)
    (root / "lib" / "python3.11" / "site-packages" / "vllm").mkdir(parents=True)
    (root / "lib" / "python3.11" / "site-packages" / "vllm" / "__init__.py").write_text("")
    python = root / "bin" / "python"
    python.write_text(f"#!/bin/sh\n{python_script}\n")
    python.chmod(python.stat().st_mode | stat.S_IXUSR)
    return root


def test_no_vllm_venv_means_not_installed_and_a_clear_exit(tmp_path: Path) -> None:
    assert find_vllm(tmp_path) is None
    with pytest.raises(SystemExit, match=f"not installed at {tmp_path}"):
        require_vllm(tmp_path)


def test_the_vllm_environment_preloads_what_exists_binds_every_core_and_drops_our_pythonpath(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)
    venv = _fake_venv(tmp_path / "venv", "exit 0")
    (venv / "lib" / "libiomp5.so").write_bytes(b"")
    env = VllmSetup(venv).env()
    expected = [str(lib) for lib in (TCMALLOC, venv / "lib" / "libiomp5.so") if lib.is_file()]
    assert env["LD_PRELOAD"] == ":".join(expected)
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == f"0-{os.cpu_count() - 1}"
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "2"
    assert "PYTHONPATH" not in env


def test_a_run_capped_at_avx2_caps_vllms_own_kernel_choice_too(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # .ci/run's second step caps ATen at AVX2; a peer run under the same cap must not let
    # vLLM load its AVX-512 kernels from torch.cpu's hardware probes.
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    env = VllmSetup(_fake_venv(tmp_path / "venv", "exit 0")).env()
    assert env["PYTHONPATH"] == str(ISA_CAP_DIR)
    probes = ("_is_avx512_supported", "_is_avx512_bf16_supported", "_is_amx_tile_supported")
    code = f"import torch.cpu; print([getattr(torch.cpu, p)() for p in {probes!r}])"
    done = subprocess.run([sys.executable, "-c", code], env=env | {"LD_PRELOAD": ""}, capture_output=True,
                          text=True, check=True)
    assert done.stdout.strip() == "[False, False, False]"


def test_a_server_that_dies_at_start_fails_with_its_log_and_leaves_nothing(tmp_path: Path) -> None:
    venv = _fake_venv(tmp_path / "venv", "echo 'no model here' >&2; exit 3")
    server = VllmServer(VllmServerConfig(tmp_path, port=1), VllmSetup(venv), log_path=tmp_path / "server.log")
    with pytest.raises(RuntimeError, match="exited with 3:\n.*no model here"):
        server.start()
    assert server.pid is None


def test_cpu_since_counts_what_this_process_burns() -> None:
    before = cpu_snapshot()
    deadline = time.process_time() + 0.3
    while time.process_time() < deadline:
        pass
    mine = [row for row in cpu_since(before) if row.pid == os.getpid()]
    assert len(mine) == 1 and mine[0].cpu_s >= 0.25


def test_cpu_since_counts_a_process_that_retitled_itself_from_the_snapshot_not_from_its_start(monkeypatch) -> None:
    """Ray workers set their title to the task they run (EngineDeployment.record_routing_stats):
    the same process, whose CPU before the run must not count."""
    before = cpu_snapshot()
    mine = before[os.getpid()]
    monkeypatch.setattr("loadtest.client.cpu_usage._name", lambda name, cmdline: "ray::retitled")
    deadline = time.process_time() + 0.2
    while time.process_time() < deadline:
        pass
    row = next(row for row in cpu_since(before) if row.pid == os.getpid())
    assert row.name == "ray::retitled" and 0.15 <= row.cpu_s < mine.cpu_s  # this test's burn, not the process's life


def test_the_peer_table_config_serves_the_checkpoint_and_sets_the_engine_env(tmp_path: Path) -> None:
    base = yaml.safe_load((ROOT / "configs" / "gpt2.yaml").read_text())
    base["applications"][0]["args"]["engine"] = {"max_num_seqs": 48}  # a key of the file's own
    (tmp_path / "base.yaml").write_text(yaml.safe_dump(base))
    config = serve_config(tmp_path / "base.yaml", tmp_path, "bfloat16",
                          {"engine": {"num_threads": 1}}, {"KMP_BLOCKTIME": "1"})
    app = config["applications"][0]
    assert app["args"]["model"] == str(tmp_path.resolve()) and app["args"]["weights"] == "pretrained"
    assert app["args"]["engine"]["num_threads"] == 1
    assert app["args"]["engine"]["max_num_seqs"] == 48  # the file's other engine keys stay
    assert app["runtime_env"]["env_vars"] == {"KMP_BLOCKTIME": "1"}
    engine = next(d for d in app["deployments"] if d["name"] == "EngineDeployment")
    assert "ray_actor_options" not in engine  # build_app's, with the replica's own variables
    yaml.safe_dump(config)  # what serve run reads


def test_vllm_is_started_with_the_flags_a_comparison_asks_for(tmp_path: Path) -> None:
    setup = VllmSetup(tmp_path / "venv")
    plain = VllmServerConfig(tmp_path).command(setup)
    assert "--stream-interval" not in plain and "--enforce-eager" not in plain
    command = VllmServerConfig(tmp_path, extra_args=("--stream-interval", "8")).command(setup)
    assert command[:len(plain)] == plain and command[len(plain):] == ["--stream-interval", "8"]
    args = parse_args(["--checkpoint", str(tmp_path), "--vllm-args", "--stream-interval 8", "--skip-rayinfer"])
    assert shlex.split(args.vllm_args) == ["--stream-interval", "8"] and args.skip_rayinfer


def test_vllm_offline_is_handed_each_structured_request_its_structured_outputs_and_seed(tmp_path: Path) -> None:
    # The venv's python stands in for vllm_offline.py ($1): it keeps the request ($2) and
    # answers with a fixed result ($3), so the hand-over is read without vLLM.
    answer = {"duration_s": 2.0, "output_tokens": [5, 6, 7, 8], "texts": ["a", "b", "c", "d"],
              "finish_reasons": ["stop", "stop", "length", "stop"]}
    (tmp_path / "answer.json").write_text(json.dumps(answer))
    venv = _fake_venv(tmp_path / "venv", f'cp "$2" {tmp_path}/handed.json; cp {tmp_path}/answer.json "$3"')
    prompts = [[1, 2], [3], [4, 5, 6], [7]]
    request = vllm_structured_request("/ckpt", prompts, structured_mix(4), 32, "bfloat16", max_num_seqs=16)
    result = run_vllm_offline(request, VllmSetup(venv))
    handed = json.loads((tmp_path / "handed.json").read_text())
    assert handed["structured_outputs"] == [{"json": SCHEMA}, {"json_object": True}, {"regex": REGEX},
                                            {"choice": CHOICES}]
    assert handed["seeds"] == [0, 1, 2, 3] and handed["prompts"] == prompts
    assert (handed["temperature"], handed["ignore_eos"], handed["max_tokens"]) == (1.0, False, 32)
    assert (handed["dtype"], handed["max_num_seqs"]) == ("bfloat16", 16)
    assert result == OfflineResult(**answer)


def test_vllms_structured_outputs_are_tallied_as_rayinfers_are() -> None:
    """Only outputs vLLM ended itself ("stop") count, and of those only the valid ones."""
    texts = ['{"name": "Ada", "age": 36, "member": true}', "{", "ABC-1234", "positive"]
    result = OfflineResult(duration_s=2.0, output_tokens=[16, 1, 6, 2], texts=texts,
                           finish_reasons=["stop", "stop", "length", "stop"])
    tally = vllm_tally(structured_mix(4), result)
    assert (tally.num_requests, tally.num_ended, tally.num_valid) == (4, 3, 2)
    assert (tally.num_tokens, tally.tokens_per_s) == (25, 12.5)


@pytest.fixture(scope="module")
def vllm_tiny_dir(tmp_path_factory: pytest.TempPathFactory, gpt2_tokenizer) -> Path:
    """The tiny checkpoint's shape with 2 heads of 32: vLLM's CPU attention has no 16-wide heads."""
    directory = tmp_path_factory.mktemp("vllm-tiny-gpt2")
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=2, n_positions=1024, vocab_size=50257)
    torch.manual_seed(0)
    transformers.GPT2LMHeadModel(config).save_pretrained(directory)
    gpt2_tokenizer.save_pretrained(directory)
    return directory


# A minute of vLLM start-up and compiles: the peer harness's own check, not the product's,
# so it runs where asked (the results page's peer rows exercise the same path).
@pytest.mark.skipif(os.environ.get("RAYINFER_PEER_TESTS") != "1",
                    reason="opt-in: RAYINFER_PEER_TESTS=1 runs it against vLLM's CPU build")
@pytest.mark.skipif(find_vllm() is None, reason="vLLM's CPU build is not installed (bench/README.md "
                    "install, or $VLLM_VENV)")
def test_vllm_serves_and_runs_offline_the_same_workload(vllm_tiny_dir: Path) -> None:
    workload = Workload(num_requests=2, prompt_tokens=8, max_tokens=4, concurrency=2, temperature=0.0)
    with contextlib.ExitStack() as stack:
        target = start_vllm_target(stack, vllm_tiny_dir, port=8197, enforce_eager=True)  # no compile: quick
        result = run_benchmark(BenchConfig(target, workload, show_progress=False))
    assert (result.successes, result.total_output_tokens) == (2, 8), result.errors
    offline = run_vllm_offline_target(vllm_tiny_dir, workload, dtype="float32", enforce_eager=True)
    assert offline.total_output_tokens == 8 and offline.output_throughput > 0


def test_the_peer_table_measures_one_round_unless_asked_and_refuses_fewer_than_one(tmp_path: Path) -> None:
    assert parse_args(["--checkpoint", str(tmp_path)]).rounds == 1
    assert parse_args(["--checkpoint", str(tmp_path), "--rounds", "3"]).rounds == 3
    with pytest.raises(SystemExit):
        parse_args(["--checkpoint", str(tmp_path), "--rounds", "0"])
