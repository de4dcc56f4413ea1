"""The decode graph compiled on a thread of its own (LLMEngine's compile_in_background, which
the served engine's step loop uses): the engine answers on eager steps before the graph is
ready, takes the graph at a step boundary once it is, and stays eager, with one warning,
where it cannot compile. The compiled graph is kept by inductor's disk caches: an engine of
the same config in a fresh process loads it rather than compiling it."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from engine import EngineConfig, SamplingParams
from engine.model.decode_graph import DecodeGraph
from engine.core.llm_engine import LLMEngine
from tests.engine_helpers import mixed_prompts, record_threads

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
CONFIG = dict(weights="pretrained", dtype="float32", device="cpu", compile_decode=True)

pytestmark = pytest.mark.usefixtures("restore_torch_threads")


def generate(engine: LLMEngine, prompts: list[list[int]], tag: str) -> list[list[int]]:
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", prompt, GREEDY)
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            tokens.setdefault(output.request_id, []).append(output.token_id)
    return [tokens[f"{tag}-{i}"] for i in range(len(prompts))]


@pytest.fixture
def slow_compile(monkeypatch) -> threading.Event:
    """The fault: a compile that lasts until the test sets the returned event."""
    warm_up, release = DecodeGraph.warm_up, threading.Event()

    def slow_warm_up(graph, kv_pool, batch):
        release.wait(timeout=120)
        warm_up(graph, kv_pool, batch)

    monkeypatch.setattr(DecodeGraph, "warm_up", slow_warm_up)
    return release


def compiling(config: EngineConfig) -> tuple[LLMEngine, threading.Event]:
    """An engine compiling its decode graph in the background, and the event its compile sets
    when it ends (done or failed)."""
    ended = threading.Event()
    return LLMEngine(config, compile_in_background=True, on_compiled=ended.set), ended


def test_the_engine_answers_on_eager_steps_before_the_graph_is_ready(tiny_gpt2_dir, slow_compile):
    engine, compiled = compiling(EngineConfig(model=str(tiny_gpt2_dir), **CONFIG))
    prompts = mixed_prompts(3)
    try:
        assert engine.runner.decode_graph is None
        assert engine.scheduler.max_num_batched_tokens == 512  # the budget of eager steps
        eager = generate(engine, prompts, "eager")
        assert [len(tokens) for tokens in eager] == [8, 8, 8]
        assert engine.runner.decode_graph is None
    finally:
        slow_compile.set()
        assert compiled.wait(300)
    engine.check_integrity()


def test_steps_take_the_graph_once_it_is_ready_with_the_same_tokens(tiny_gpt2_dir, slow_compile, caplog):
    engine, compiled = compiling(EngineConfig(model=str(tiny_gpt2_dir), **CONFIG))
    prompts = mixed_prompts(3)
    eager = generate(engine, prompts, "eager")
    slow_compile.set()
    assert compiled.wait(300)
    with caplog.at_level(logging.INFO, logger="engine.core.llm_engine"):
        graph_tokens = generate(engine, prompts, "compiled")
    assert engine.runner.decode_graph.num_steps >= 7  # every decode step after the switch
    assert "steps now compiled" in caplog.text
    assert engine.scheduler.max_num_batched_tokens == 128  # the graph's budget
    assert graph_tokens == eager  # fp32, greedy: the graph's tokens are the eager path's
    engine.check_integrity()


def test_steps_keep_their_torch_threads_while_the_graph_compiles_and_after(tiny_gpt2_dir, slow_compile):
    """The compile's thread sets its own torch threads, never the step loop's: one-token steps
    on one thread, the rest on the engine's two, before the switch and after."""
    config = EngineConfig(model=str(tiny_gpt2_dir), num_threads=2, one_thread_max_tokens=1, **CONFIG)
    engine, compiled = compiling(config)
    seen = record_threads(engine)
    prompts = mixed_prompts(3)
    generate(engine, prompts[2:], "before")
    slow_compile.set()
    assert compiled.wait(300)
    generate(engine, prompts[2:], "after")
    assert engine.runner.decode_graph.num_steps >= 7
    assert seen and all(threads == (1 if tokens == 1 else 2) for tokens, threads in seen), seen


def test_a_background_compile_that_fails_leaves_steps_eager_with_one_warning(tiny_gpt2_dir, monkeypatch, caplog):
    def no_compiler(*_args):
        raise RuntimeError("no C++ compiler")  # the fault: what inductor raises without one

    monkeypatch.setattr(DecodeGraph, "warm_up", no_compiler)
    engine, compiled = compiling(EngineConfig(model=str(tiny_gpt2_dir), **CONFIG))
    assert compiled.wait(60)
    assert [len(tokens) for tokens in generate(engine, mixed_prompts(2), "eager")] == [8, 8]
    assert engine.runner.decode_graph is None
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "decode steps run eagerly" in warnings[0].getMessage()


_BUILD_AND_REPORT = """
import json, sys
from torch._dynamo.utils import counters
from engine import LLM
LLM(sys.argv[1], weights="pretrained", dtype="float32", device="cpu", compile_decode=True)
print(json.dumps({"inductor": dict(counters["inductor"]), "aot_autograd": dict(counters["aot_autograd"])}))
"""


def build_in_fresh_process(model_dir: Path, cache_dir: Path) -> dict:
    """Build an engine with a compiled graph in a new Python process on `cache_dir` as inductor's
    cache; that process's cache counters."""
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache_dir)}
    done = subprocess.run([sys.executable, "-c", _BUILD_AND_REPORT, str(model_dir)], env=env, capture_output=True,
                          text=True, timeout=600, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_an_engine_in_a_fresh_process_loads_the_graph_the_first_one_compiled(tiny_gpt2_dir, tmp_path):
    first = build_in_fresh_process(tiny_gpt2_dir, tmp_path)
    assert first["inductor"].get("fxgraph_cache_miss", 0) >= 1 and not first["inductor"].get("fxgraph_cache_hit")
    second = build_in_fresh_process(tiny_gpt2_dir, tmp_path)
    assert second["aot_autograd"].get("autograd_cache_hit", 0) >= 1
    assert not second["aot_autograd"].get("autograd_cache_miss") and not second["inductor"].get("fxgraph_cache_miss")
