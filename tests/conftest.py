# Shared fixtures: a tiny but real GPT-2 checkpoint (2 layers, 64 wide, GPT-2's full
# 50257-token vocabulary and its real tokenizer) written the way transformers writes one,
# in safetensors and in pytorch_model.bin form, a GPT-2-small one made peaked, and the
# offline GPT-2 tokenizer. Tests use
# them wherever a user would meet real weights and a real tokenizer, without a model hub.
# And the clients of a served app: a module that serves one defines `base_url` (and
# `http_headers` where its app wants an API key) and gets `http` and `oai` from here.
from __future__ import annotations

import atexit
import os
import shutil
import tempfile

# The suite keeps both cores busy: two xdist workers, their Ray replicas and the clients of
# their servers. By default OpenMP's idle threads spin after every parallel region, on a core
# another of those processes is waiting for; passive waits leave it to them.
# libgomp reads this once, when torch loads it: so before torch is imported, here, for this
# process and every one it starts (Ray clusters, `serve run`, subprocesses). It changes how an
# idle thread waits, never what a step computes. The product keeps OpenMP's default (passive
# waits serve a stream slower: BENCHMARKS.md, "Designs tried and rejected"), and CI's
# fresh_serve serves the shipped config with it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# Serve gives a new HTTP proxy 5 s to answer its first ready check, then kills it and starts
# another; serve.start waits on the first one, so it fails ("killed by `ray.kill`", "never
# ran") instead of waiting for the replacement. With both cores busy on an AVX2-only machine,
# a proxy's worker process took longer than that to start (a whole module's setup failed):
# every Serve instance the suite starts gives its proxies 60 s, the time serve.start waits.
os.environ.setdefault("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", "60")
# The tuner's tables (engine/core/tuning_cache.py) in a directory of this run's, for it and
# every process it starts: a test engine tunes on this run's code, never loads a table an
# older checkout saved, and leaves the user's cache alone. Made once, by the process that
# starts the run (xdist's workers inherit it), and removed when that process exits.
if "RAYINFER_TUNING_DIR" not in os.environ:
    os.environ["RAYINFER_TUNING_DIR"] = tempfile.mkdtemp(prefix="rayinfer-tuning-")
    atexit.register(shutil.rmtree, os.environ["RAYINFER_TUNING_DIR"], ignore_errors=True)

from collections.abc import Iterator  # noqa: E402  (below the environment that torch's OpenMP reads)
from pathlib import Path

import httpx
import openai
import pytest
import torch
import transformers
from filelock import FileLock
from safetensors.torch import load_file

from engine.model.loader import load_tokenizer
from tests.engine_helpers import write_peaked_gpt2_small
from tests.serve_helpers import release_shared_serve


@pytest.fixture(scope="session")
def gpt2_tokenizer() -> transformers.PreTrainedTokenizerBase:
    return load_tokenizer("gpt2")


@pytest.fixture(scope="session")
def tiny_gpt2_dir(tmp_path_factory: pytest.TempPathFactory, gpt2_tokenizer) -> Path:
    directory = tmp_path_factory.mktemp("tiny-gpt2")
    # initializer_range 10x GPT-2's makes logit gaps wide, so greedy argmax is decisive.
    config = transformers.GPT2Config(
        n_layer=2, n_embd=64, n_head=4, n_positions=1024, vocab_size=50257, initializer_range=0.2
    )
    torch.manual_seed(0)
    transformers.GPT2LMHeadModel(config).save_pretrained(directory)
    gpt2_tokenizer.save_pretrained(directory)
    return directory


@pytest.fixture(scope="session")
def tiny_gpt2_bin_dir(tmp_path_factory: pytest.TempPathFactory, tiny_gpt2_dir: Path) -> Path:
    directory = tmp_path_factory.mktemp("tiny-gpt2-bin")
    for file in tiny_gpt2_dir.iterdir():
        if file.suffix != ".safetensors":
            shutil.copy(file, directory)
    # transformers 5.x always saves safetensors (save_pretrained ignores safe_serialization).
    torch.save(load_file(tiny_gpt2_dir / "model.safetensors"), directory / "pytorch_model.bin")
    return directory


@pytest.fixture(scope="session")
def peaked_gpt2_small_dir(tmp_path_factory: pytest.TempPathFactory, worker_id: str, gpt2_tokenizer) -> Path:
    """write_peaked_gpt2_small's checkpoint (500 MB, seconds to write), once a run: the
    run's xdist workers share it (their base temps sit in one directory of the run's), the
    first to ask writes it, and every test only reads it."""
    root = tmp_path_factory.getbasetemp()
    if worker_id != "master":
        root = root.parent
    directory = root / "gpt2-small-peaked"
    with FileLock(root / "gpt2-small-peaked.lock"):
        if not directory.exists():
            scratch = Path(tempfile.mkdtemp(dir=root))  # renamed whole: no worker sees half a checkpoint
            write_peaked_gpt2_small(scratch, gpt2_tokenizer)
            scratch.rename(directory)
    return directory


@pytest.fixture
def restore_torch_threads() -> Iterator[None]:
    """Torch's thread count as it was before the test: engines with `num_threads` and
    one-thread steps set it for the whole process."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def http_headers() -> dict[str, str]:
    """Headers every request of the module's `http` client carries (an API key, where the app has one)."""
    return {}


@pytest.fixture(scope="module")
def http(base_url: str, http_headers: dict[str, str]) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=base_url, timeout=60, headers=http_headers) as client:
        yield client


@pytest.fixture(scope="module")
def oai(base_url: str) -> openai.OpenAI:
    """The real `openai` SDK against the module's app (its served model is named "tiny")."""
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)


# The modules that take longest, longest first (measured under the whole suite on 2 cores,
# each 40 s or more). Under `-n 2 --dist loadfile` xdist hands modules out in collection order
# (--no-loadscope-reorder, pyproject.toml), each to whichever worker is free: these start first
# and the many short modules fill the end. By its own order, most tests first, it handed out
# test_serve_run and test_fuzz last, and one worker ran them while the other had nothing left.
LONGEST_FIRST = ("test_reliability.py", "test_scale_out.py", "test_lora.py", "test_serve_run.py",
                 "test_openai_fields.py", "test_scale_out_cluster.py", "test_structured_outputs_serve.py",
                 "test_chaos.py", "test_background_compile.py", "test_native_build.py", "test_tuner.py",
                 "test_fuzz.py", "test_speculative.py", "test_lora_serve.py", "test_decode_graph.py")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """In one process: tests without Ray first, then those that serve from the suite's shared
    Serve instance, then those that start a cluster of their own (`own_cluster`), which shut
    the shared one down first: in one process Ray starts twice in all, not once a module.
    Under xdist, LONGEST_FIRST's modules first. A stable sort: each module's tests keep their
    order."""
    def stage(item: pytest.Item) -> int:
        return 2 if item.get_closest_marker("own_cluster") else 1 if item.get_closest_marker("serve") else 0

    def rank(item: pytest.Item) -> int:
        name = item.path.name
        return LONGEST_FIRST.index(name) if name in LONGEST_FIRST else len(LONGEST_FIRST)

    if os.environ.get("PYTEST_XDIST_WORKER"):
        items.sort(key=lambda item: (rank(item), stage(item)))
    else:
        items.sort(key=stage)


@pytest.fixture(scope="session", autouse=True)
def shared_serve_released_at_the_end() -> Iterator[None]:
    yield
    release_shared_serve()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """A test that starts a Ray cluster of its own (in process, or by `serve run`) finds the
    shared one shut down before any of its fixtures start: one driver holds one Ray, and
    `serve run` must not find ours."""
    if item.get_closest_marker("own_cluster"):
        release_shared_serve()
