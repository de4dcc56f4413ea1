"""The hot path's `auto` choices are measured (engine/core/tuner.py): the faster candidate wins
(linears, threads, attention), with slowness injected into the other (50 ms a call, far past
any machine's noise); the table is cached on disk under a key of what decides it
(engine/core/tuning_cache.py), loaded by a later start and measured again when the key
changes; the engine sets the measured choices before its decode graph is traced; per step
size the compiled graph or its step run eagerly, whichever is faster (a later start that
found eager faster everywhere compiles nothing); and every linear the tuner may pick, and the
graph's step run eagerly, computes what the reference path computes, at GPT-2-small's size,
teacher-forced."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import pytest
import torch

import engine.core.kernel_choice as kernel_choice
import engine.core.tuner as tuner
import engine.core.tuning_cache as tuning_cache
from engine import LLM, SamplingParams
from engine.core.kernel_choice import apply_measured_choices
from engine.core.tuner import Tuning, cheaper, race, segments, threshold, tune
from engine.model.attention import decode_attention_with_own
from engine.model.decode_graph import DecodeGraph
from engine.model.packed_linear import PackedLinear, can_pack, own_max_rows, runs_brgemm
from tests.engine_helpers import mixed_prompts
from tests.test_decode_graph import assert_fast_scores_close

# bf16 where oneDNN runs it; fp32 on an AVX2-only CPU (or one capped to it)
DTYPE = "bfloat16" if can_pack(torch.device("cpu"), torch.bfloat16) else "float32"
ATOL = {"bfloat16": 0.15, "float32": 1e-3}[DTYPE]  # test_decode_graph's, eager against eager
SLOW_S = 0.05
NUM_KV_BLOCKS = 64  # GPT-2-small's engines: the prompts need ~16 blocks; the default is ~2 GB each

pytestmark = pytest.mark.skipif(not can_pack(torch.device("cpu"), torch.float32),
                                reason="needs oneDNN's linear ops on x86-64")


def tiny_llm(model_dir: Path, **options) -> LLM:
    return LLM(str(model_dir), weights="pretrained", dtype=DTYPE, device="cpu", compile_decode=False, **options)


def packed_layers(llm: LLM) -> list[PackedLinear]:
    return [m for m in llm.engine.runner.model.modules() if isinstance(m, PackedLinear)]


def slowed(run, seconds: float = SLOW_S):
    def slow() -> None:
        time.sleep(seconds)
        run()
    return slow


def fake(is_slow: bool):
    """A candidate that only takes time where it is the slow one: the decision is under test,
    not the machine (a real step on two threads of a busy machine stalls for tens of ms)."""
    return slowed(lambda: None) if is_slow else (lambda: None)


def test_the_race_times_every_candidate_and_the_slowed_one_loses():
    ms = race({"fast": lambda: None, "slow": slowed(lambda: None)}, repeats=2)
    assert ms["slow"] >= SLOW_S * 1000 > ms["fast"]


def test_one_attention_for_every_count_is_the_one_that_costs_less_over_all_counts():
    assert cheaper([(2, 1.0, 2.0), (8, 1.0, 2.0), (32, 1.5, 1.0)])
    assert not cheaper([(2, 1.0, 1.1), (8, 2.0, 1.0), (32, 3.0, 1.0)])


def test_the_threshold_is_where_the_candidates_cross_and_one_noisy_count_does_not_move_it():
    ours_then_theirs = [(1, 1.0, 2.0), (2, 1.0, 2.0), (4, 3.0, 1.0), (8, 3.0, 1.0)]  # (rows, below, above)
    assert threshold(ours_then_theirs) == 2
    assert threshold([(1, 3.0, 1.0), (2, 3.0, 1.0)]) == 0
    assert threshold([(1, 1.0, 2.0), (2, 1.0, 2.0)]) == 2
    assert threshold([(1, 1.0, 2.0), (2, 1.0, 2.0), (4, 1.2, 1.0), (8, 1.0, 2.0), (16, 1.0, 2.0)]) == 16


@pytest.mark.parametrize("slow", ["ours", "oneDNN"])
def test_the_tuner_picks_the_faster_linear(tiny_gpt2_dir, monkeypatch, slow):
    layers = packed_layers(tiny_llm(tiny_gpt2_dir))
    monkeypatch.setattr(tuner, "LINEAR_ROWS", (1, 2, 4))
    monkeypatch.setattr(tuner, "runs_brgemm", lambda layer: False)  # two candidates here; three below
    monkeypatch.setattr(tuner, "_step", lambda layers, rows, max_rows, brgemm_rows=0:
                        fake((max_rows == -1) == (slow == "ours")))
    measured = [rows for rows in (1, 2, 4) if rows <= own_max_rows(layers[0])]
    tuning = tune(torch.nn.ModuleList(layers), linears=True, threads=None)
    assert tuning.linear_max_rows == (0 if slow == "ours" else measured[-1])
    assert {(t.rows, t.candidate) for t in tuning.timings} == {(r, c) for r in measured for c in ("ours", "oneDNN")}


@pytest.mark.parametrize("fast", ["ours", "brgemm", "oneDNN"])
def test_the_tuner_picks_brgemm_where_it_runs_and_is_the_faster(tiny_gpt2_dir, monkeypatch, fast):
    layers = packed_layers(tiny_llm(tiny_gpt2_dir))
    candidates = {(-1, 0): "ours", (0, 0): "oneDNN", (0, 64): "brgemm"}
    monkeypatch.setattr(tuner, "LINEAR_ROWS", (1, 2, 4, 64))
    monkeypatch.setattr(tuner, "runs_brgemm", lambda layer: True)
    monkeypatch.setattr(tuner, "_step", lambda layers, rows, max_rows, brgemm_rows=0:
                        fake(candidates[max_rows, brgemm_rows] != fast))
    tuning = tune(torch.nn.ModuleList(layers), linears=True, threads=None)
    measured = [rows for rows in (1, 2, 4, 64) if rows <= own_max_rows(layers[0])]
    expected = {"ours": (measured[-1], 0), "brgemm": (0, measured[-1]), "oneDNN": (0, 0)}[fast]
    assert (tuning.linear_max_rows, tuning.linear_brgemm_rows) == expected
    assert {t.candidate for t in tuning.timings} == {"ours", "brgemm", "oneDNN"}


def test_the_segments_are_where_the_three_cross_and_ties_keep_brgemm_out():
    # ours fastest at 1-2 rows, brgemm at 8-32, oneDNN's at 64
    times = [(1, 1.0, 3.0, 4.0), (2, 1.0, 3.0, 4.0), (8, 3.0, 1.0, 2.0), (32, 3.0, 1.0, 2.0), (64, 3.0, 2.0, 1.0)]
    assert segments(times) == (2, 32)
    assert segments([(1, 1.0, 1.0, 2.0), (2, 1.0, 1.0, 2.0)]) == (2, 2)  # brgemm only ties ours: not taken
    assert segments([(1, 2.0, 1.0, 3.0)]) == (0, 1)


@pytest.mark.parametrize("slow", ["1 thread", "2 threads"])
def test_the_tuner_picks_one_thread_where_it_is_not_slower(tiny_gpt2_dir, monkeypatch, restore_torch_threads, slow):
    layers = packed_layers(tiny_llm(tiny_gpt2_dir))
    monkeypatch.setattr(tuner, "THREAD_ROWS", (1, 2))
    monkeypatch.setattr(tuner, "_on_threads", lambda step, threads: fake((threads == 1) == (slow == "1 thread")))
    tuning = tune(torch.nn.ModuleList(layers), linears=False, threads=2)
    assert tuning.linear_max_rows is None
    assert tuning.one_thread_max_tokens == (0 if slow == "1 thread" else 2)


def test_a_later_start_loads_the_table_and_a_changed_key_tunes_again(tiny_gpt2_dir, tmp_path, monkeypatch,
                                                                     restore_torch_threads):
    monkeypatch.setenv(tuning_cache.TUNING_DIR_ENV, str(tmp_path))
    calls = []
    monkeypatch.setattr(kernel_choice, "tune", lambda *args, **kwargs: calls.append(args) or tune(*args, **kwargs))
    llm = tiny_llm(tiny_gpt2_dir, num_threads=2)
    engine = llm.engine
    first = apply_measured_choices(engine.config, engine.runner.model, engine.step_threads)
    assert len(calls) == 1 and len(list(tmp_path.glob("*.json"))) == 1
    assert {layer.max_rows for layer in packed_layers(llm)} == {first.linear_max_rows}
    assert {layer.brgemm_rows for layer in packed_layers(llm)} == {first.linear_brgemm_rows or 0}
    assert engine.step_threads.one_thread_max_tokens == first.one_thread_max_tokens
    assert apply_measured_choices(engine.config, engine.runner.model, engine.step_threads) == first
    assert len(calls) == 1  # loaded, not measured
    monkeypatch.setattr(tuning_cache.kernel_sources, "library_stem", lambda *_: "_kernels_of_edited_sources")
    apply_measured_choices(engine.config, engine.runner.model, engine.step_threads)
    assert len(calls) == 2
    one_core = dataclasses.replace(engine.config, num_threads=1)
    apply_measured_choices(one_core, engine.runner.model, engine.step_threads)
    assert len(calls) == 3 and len(list(tmp_path.glob("*.json"))) == 3


def test_a_tuner_past_its_budget_keeps_the_defaults_and_caches_nothing(tiny_gpt2_dir, tmp_path, monkeypatch,
                                                                      restore_torch_threads):
    monkeypatch.setenv(tuning_cache.TUNING_DIR_ENV, str(tmp_path))
    monkeypatch.setattr(tuner, "BUDGET_S", 0.0)
    llm = tiny_llm(tiny_gpt2_dir, num_threads=2)
    engine = llm.engine
    assert apply_measured_choices(engine.config, engine.runner.model, engine.step_threads) == Tuning(complete=False)
    assert {layer.max_rows for layer in packed_layers(llm)} == {-1} and not list(tmp_path.iterdir())


def test_options_set_by_hand_are_not_measured(tiny_gpt2_dir, monkeypatch):
    monkeypatch.setattr(kernel_choice, "tune", lambda *_, **__: pytest.fail("measured an option set by hand"))
    llm = tiny_llm(tiny_gpt2_dir, small_batch_linear="native", one_thread_max_tokens=1)
    engine = llm.engine
    assert apply_measured_choices(engine.config, engine.runner.model, engine.step_threads) is None
    assert {layer.max_rows for layer in packed_layers(llm)} == {-1}  # the kernel's own limit


def test_the_engine_sets_the_measured_choices_before_its_graph_is_traced(tiny_gpt2_dir, tmp_path, monkeypatch):
    monkeypatch.setenv(tuning_cache.TUNING_DIR_ENV, str(tmp_path))  # no table yet: it measures
    tuned, seen = [], []
    monkeypatch.setattr(kernel_choice, "tune", lambda model, *_, **__: tuned.append(model)
                        or Tuning(2, 5, "ours", linear_brgemm_rows=8, sampler="ours"))
    monkeypatch.setattr(DecodeGraph, "warm_up", lambda *_: seen.append(
        {(m.max_rows, m.brgemm_rows) for m in tuned[0].modules() if isinstance(m, PackedLinear)}))
    llm = LLM(str(tiny_gpt2_dir), weights="pretrained", dtype=DTYPE, device="cpu", compile_decode=True,
              num_threads=2)
    assert tuned == [llm.engine.runner.model] and seen == [{(2, 8)}]
    assert llm.engine.step_threads.one_thread_max_tokens == 5


@pytest.mark.parametrize("slow", ["ours", "torch"])
def test_the_tuner_picks_the_faster_attention_and_the_graph_is_traced_on_it(tiny_gpt2_dir, tmp_path, monkeypatch,
                                                                            slow):
    monkeypatch.setenv(tuning_cache.TUNING_DIR_ENV, str(tmp_path))
    monkeypatch.setattr(tuner, "compile_for", lambda _device, fn, **_: fn)  # the choice is under test, not inductor
    monkeypatch.setattr(tuner, "_attention_step", lambda attention, pool, rows: fake(
        (attention is decode_attention_with_own) == (slow == "torch")))
    monkeypatch.setattr(DecodeGraph, "warm_up", lambda *_: None)
    llm = LLM(str(tiny_gpt2_dir), weights="pretrained", dtype=DTYPE, device="cpu", compile_decode=True,
              small_batch_linear="native", one_thread_max_tokens=1)  # decode_attention alone is auto
    graph = llm.engine.runner.decode_graph
    assert graph.attention is (decode_attention_with_own if slow == "ours" else torch.ops.rayinfer.decode_attention)
    assert graph.native_write is (slow == "torch")


@pytest.mark.parametrize("slow", ["ours", "torch"])
def test_the_tuner_picks_the_faster_draw_and_the_engine_samples_with_it(tiny_gpt2_dir, tmp_path, monkeypatch, slow):
    """Torch's draw, where faster, replaces ours in the sampler, and greedy rows then take the
    graph's argmax (ours computes its own); the same seeded request draws the same tokens."""
    monkeypatch.setenv(tuning_cache.TUNING_DIR_ENV, str(tmp_path))
    monkeypatch.setattr(tuner, "_draw_step", lambda run, vocab, dtype, rows, to_float: fake(
        to_float == (slow == "torch")))  # to_float: torch's draw
    llm = LLM(str(tiny_gpt2_dir), weights="pretrained", dtype="float32", device="cpu", compile_decode=True,
              small_batch_linear="native", one_thread_max_tokens=1, decode_attention="native")  # sampler alone is auto
    runner = llm.engine.runner
    assert (runner.sampler.native is None, runner.sampler.is_compiled) == ((True, True) if slow == "ours" else (False, False))
    assert runner.decode_graph._argmax is (slow == "ours")
    params = SamplingParams(max_tokens=12, temperature=0.8, seed=7, ignore_eos=True)
    eager = LLM(str(tiny_gpt2_dir), weights="pretrained", dtype="float32", device="cpu", compile_decode=False)
    assert llm.generate([[5, 6, 7]], params)[0].token_ids == eager.generate([[5, 6, 7]], params)[0].token_ids


@pytest.fixture(scope="module")
def gpt2_small_reference(peaked_gpt2_small_dir) -> LLM:
    return LLM(str(peaked_gpt2_small_dir), weights="pretrained", dtype=DTYPE, device="cpu", linears="reference",
               compile_decode=False, num_kv_blocks=NUM_KV_BLOCKS)


# Each linear the tuner may choose: oneDNN's for every step (and small_batch_linear: torch),
# ours for every step it takes (its own limit), a crossover between, and, where oneDNN's
# brgemm ukernel runs, brgemm for every step (and small_batch_linear: brgemm) or after ours.
@pytest.mark.parametrize("option, max_rows, brgemm_rows", [
    ("torch", None, 0), ("auto", 0, 0), ("auto", 2, 0), ("auto", -1, 0), ("auto", 0, 64), ("auto", 2, 4)])
def test_every_linear_the_tuner_may_pick_matches_the_reference_at_gpt2_small_size(
        peaked_gpt2_small_dir, gpt2_small_reference, option, max_rows, brgemm_rows):
    fast = LLM(str(peaked_gpt2_small_dir), weights="pretrained", dtype=DTYPE, device="cpu", compile_decode=False,
               small_batch_linear=option, num_kv_blocks=NUM_KV_BLOCKS)
    if brgemm_rows and not runs_brgemm(fast.engine.runner.model.lm_head):
        pytest.skip("oneDNN's brgemm ukernel does not run bf16 on our panels here (no AVX-512 BF16 / avx512_core)")
    for layer in packed_layers(fast):
        assert layer.few_rows == (option == "auto")
        layer.max_rows, layer.brgemm_rows = (-1 if max_rows is None else max_rows), brgemm_rows
    prompts = mixed_prompts(6)  # decodes of 1 to 6 rows
    assert_fast_scores_close(fast, gpt2_small_reference, prompts[:1], ATOL)
    assert_fast_scores_close(fast, gpt2_small_reference, prompts, ATOL)


# Every other `auto` choice set by hand: the graph against its eager step alone is measured.
GRAPH_ONLY = dict(weights="pretrained", dtype=DTYPE, device="cpu", compile_decode="auto", small_batch_linear="native",
                  one_thread_max_tokens=1, decode_attention="native", sampler="native")


def graph_race(monkeypatch, slow: str, calls: list | None = None) -> None:
    """The graph's scratch steps faked: `slow` ("graph" or "eager") takes SLOW_S a call."""
    def scratch_step(graph, kv_pool, rows, context, eager):
        if calls is not None and not eager:
            calls.append(rows)  # one a count measured
        return fake(eager == (slow == "eager"))
    monkeypatch.setattr(DecodeGraph, "scratch_step", scratch_step)


@pytest.mark.parametrize("slow", ["graph", "eager"])
def test_each_step_size_runs_the_faster_of_the_graph_and_its_step_run_eagerly(tiny_gpt2_dir, tmp_path, monkeypatch,
                                                                              slow):
    monkeypatch.setenv(tuning_cache.TUNING_DIR_ENV, str(tmp_path))
    monkeypatch.setattr(tuner, "GRAPH_ROWS", (2, 8))
    graph_race(monkeypatch, slow)
    monkeypatch.setattr(DecodeGraph, "warm_up", lambda *_: None)  # the choice is under test, not inductor
    llm = LLM(str(tiny_gpt2_dir), **GRAPH_ONLY)
    graph = llm.engine.runner.decode_graph
    eager = slow == "graph"
    assert graph.eager_at == ((2, "eager" if eager else "graph"), (8, "eager" if eager else "graph"))
    assert [graph.runs_eager(rows) for rows in (1, 2, 5, 8, 64)] == [eager] * 5  # past the last count: its winner
    if eager:  # steps through the graph's own step, uncompiled, give the eager path's tokens
        reference = LLM(str(tiny_gpt2_dir), weights="pretrained", dtype=DTYPE, device="cpu", compile_decode=False)
        params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
        prompts = mixed_prompts(3)
        assert [o.token_ids for o in llm.generate(prompts, params)] == \
            [o.token_ids for o in reference.generate(prompts, params)]
        assert graph.num_steps > 0


def test_the_choice_is_per_step_size_each_count_taking_the_rows_up_to_it():
    graph = DecodeGraph.__new__(DecodeGraph)
    graph.use_eager_at(((2, "graph"), (8, "eager"), (32, "graph")))
    assert [graph.runs_eager(rows) for rows in (1, 2, 3, 8, 9, 32, 64)] == [False, False, True, True, False, False, False]
    assert not graph.is_eager_everywhere and "rows up to 8" in graph.describe()


def test_a_later_start_loads_the_graph_choice_and_eager_everywhere_compiles_nothing(tiny_gpt2_dir, tmp_path,
                                                                                    monkeypatch):
    monkeypatch.setenv(tuning_cache.TUNING_DIR_ENV, str(tmp_path))
    monkeypatch.setattr(tuner, "GRAPH_ROWS", (2, 8))
    calls: list[int] = []
    graph_race(monkeypatch, "graph", calls)
    compiled: list[DecodeGraph] = []
    monkeypatch.setattr(DecodeGraph, "warm_up", lambda graph, *_: compiled.append(graph))
    first = LLM(str(tiny_gpt2_dir), **GRAPH_ONLY).engine.runner.decode_graph
    assert calls == [2, 8] and compiled == [first] and first.is_eager_everywhere
    later = LLM(str(tiny_gpt2_dir), **GRAPH_ONLY).engine.runner.decode_graph  # the same key: loaded
    assert calls == [2, 8] and compiled == [first] and later.is_eager_everywhere
    LLM(str(tiny_gpt2_dir), **GRAPH_ONLY, num_kv_blocks=40)  # another pool: another key, measured again
    assert calls == [2, 8, 2, 8] and len(compiled) == 2


def test_the_graphs_step_run_eagerly_matches_the_reference_at_gpt2_small_size(
        peaked_gpt2_small_dir, gpt2_small_reference, monkeypatch):
    monkeypatch.setattr(DecodeGraph, "warm_up", lambda *_: None)  # never compiled: every step size runs eagerly
    fast = LLM(str(peaked_gpt2_small_dir), **{**GRAPH_ONLY, "compile_decode": True}, num_kv_blocks=NUM_KV_BLOCKS)
    graph = fast.engine.runner.decode_graph
    graph.use_eager_at(((64, "eager"),))
    prompts = mixed_prompts(6)
    assert_fast_scores_close(fast, gpt2_small_reference, prompts, ATOL)
    assert graph.num_steps > 0
