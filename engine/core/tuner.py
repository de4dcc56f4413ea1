"""The hot path's `auto` choices, measured on this machine rather than guessed from its ISA
flags: each candidate timed on the model's own layers, at the step sizes the engine runs.

What it decides (each only where its option is `auto`):
- small_batch_linear: up to how many rows a step's linears run on our kernel, oneDNN's
  product past them (PackedLinear.max_rows). Both are timed on every linear of the model,
  in step order (so the weights stream from memory as in a step), at 1 to 64 rows. Where
  oneDNN runs on AMX tiles its product wins from a few rows on, where it does not ours may
  win at every count it takes: the measurement finds either, with no ISA flag read. Where
  oneDNN's brgemm ukernel runs bf16 on our panels (engine/kernels/csrc/brgemm_linear.cpp: AMX
  tiles where the CPU has them) it is a third candidate, for the counts between ours and
  oneDNN's product (PackedLinear.brgemm_rows). SGLang's CPU GEMM fixes that split (its own
  AVX-512 BF16 kernel up to 4 rows, brgemm past them, sgl-kernel/csrc/cpu/gemm.h); here it is
  measured, and may be empty.
- decode_attention: our kernel or the expression inductor compiles, one for the graph:
  both timed on the engine's KV pool at a few decode batches (the expression compiled
  alone first, outside the time budget).
- sampler: the draw of a sampled step's tokens (argmax, softmax and an inverse-CDF draw per
  row): our kernel (engine/kernels/csrc/sampling.cpp) or torch's ops compiled by inductor,
  both timed on the model's vocabulary at a few batches (the torch draw compiled first,
  outside the time budget). Where torch's wins, greedy rows take the decode graph's argmax too.
- decode_graph (compile_decode: auto): per step size, the compiled decode graph or the same
  step run eagerly, each timed on scratch inputs at a few decode batches once the graph has
  compiled (graph_or_eager; on some CPUs oneDNN's eager products beat the fused graph).
- one_thread_max_tokens: the largest step (in rows) that runs on one torch thread. Measured
  offline, a second thread almost always helps; in a server the engine's cores are shared
  with the path to the client, whose preemptions stall a small step's barriers
  (engine/core/step_threads.py). So one thread is chosen where it costs at most
  SHARED_CORES_MARGIN over all threads: there a second thread buys less than it risks.

It runs with the decode graph's compile, on its thread (off the serving path: steps run on
the defaults meanwhile), before the graph is traced, so the graph holds the measured
limits; the table is cached on disk (engine/core/tuning_cache.py), so a later start with
the same key loads it in milliseconds.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

import engine.kernels.onednn_linear as onednn
from engine.kernels.inductor import compile_for
from engine.model.attention import decode_attention_with_own
from engine.model.decode_graph import DecodeGraph, scratch_block_tables
from engine.model.packed_linear import PackedLinear, own_max_rows, runs_brgemm
from engine.sampling.sampler import draw

logger = logging.getLogger(__name__)

LINEAR_ROWS = (1, 2, 4, 8, 16, 32, 64)  # a stream's decode (padded to 2 by the graph) to a batch of 64
THREAD_ROWS = (1, 2, 4, 8)
ATTENTION_ROWS = (2, 8, 32)  # decodes a step; 2, not 1: the graph pads one row to two
ATTENTION_CONTEXT = 200  # cached tokens each row attends to
DRAW_ROWS = (2, 8, 32)  # sampled rows a step; 2, not 1: the compiled draw pads one row to two
GRAPH_ROWS = (2, 8, 32, 64)  # decodes a step, up to max_num_seqs; 2, not 1: the graph pads one row to two
SHARED_CORES_MARGIN = 1.3
# The graph's step runs eagerly only where that is this much faster: the two are within a few
# percent of each other on some CPUs, where a run's noise would flip the choice from start to start.
EAGER_MARGIN = 1.15
GRAPH_REPEATS = 5
REPEATS = 3
# Past it the tuner stops: a machine busy enough to stretch a few seconds' measuring this far
# gives timings that mean little. What it measured by then is used, not cached.
BUDGET_S = 20.0


@dataclass(frozen=True)
class Timing:
    choice: str  # the option it decides: small_batch_linear, one_thread_max_tokens, decode_attention
    rows: int
    candidate: str
    ms: float  # the best of REPEATS


@dataclass(frozen=True)
class Tuning:
    """The measured choices (None: not tuned, the option's value or default stands) and the
    table they came from."""
    linear_max_rows: int | None = None
    one_thread_max_tokens: int | None = None
    decode_attention: str | None = None  # "ours" or "torch"
    timings: tuple[Timing, ...] = ()
    complete: bool = True  # every candidate measured within BUDGET_S
    linear_brgemm_rows: int | None = None  # past linear_max_rows, up to it: oneDNN's brgemm ukernel
    sampler: str | None = None  # "ours" or "torch"
    graph_or_eager: tuple[tuple[int, str], ...] | None = None  # (rows, "graph" or "eager"): DecodeGraph.use_eager_at

    def log(self, source: str) -> None:
        """The table, each candidate's time a line, and the winners, once per engine."""
        winners = [f"{name} {value}" for name, value in (("small_batch_linear: ours up to rows", self.linear_max_rows),
                                                          ("brgemm up to rows", self.linear_brgemm_rows),
                                                          ("one_thread_max_tokens", self.one_thread_max_tokens),
                                                          ("decode_attention", self.decode_attention),
                                                          ("sampler", self.sampler),
                                                          ("decode_graph:", self.graph_or_eager and ", ".join(
                                                              f"{path} up to rows {rows}" for rows, path in self.graph_or_eager)))
                   if value is not None]
        logger.info("tuning (%s): %s", source, ", ".join(winners) or "nothing decided, the defaults stand")
        for t in self.timings:
            logger.info("tuning: %-22s %3d rows  %-8s %8.3f ms", t.choice, t.rows, t.candidate, t.ms)


def race(candidates: dict[str, Callable[[], object]], repeats: int = REPEATS) -> dict[str, float]:
    """Each candidate's best time in ms, the candidates interleaved (one call of each per
    round, after a warm-up round) so that a machine's drift falls on all of them alike. The
    best, not the median: the tuner runs beside a serving engine and other processes, whose
    preemptions only ever add time, and in bursts longer than a call."""
    times: dict[str, list[float]] = {name: [] for name in candidates}
    for round_ in range(repeats + 1):
        for name, run in candidates.items():
            start = time.perf_counter()
            run()
            if round_:
                times[name].append((time.perf_counter() - start) * 1000)
    return {name: min(ms) for name, ms in times.items()}


def threshold(times: Sequence[tuple[int, float, float]]) -> int:
    """(rows, below's ms, above's ms) for ascending row counts -> the row count up to which
    `below` runs and past which `above` does (0: above always), the one whose choices cost
    least, each row count's cost its time over the faster candidate's there: every count
    weighs alike, and one noisy count among many does not move the threshold far."""
    def cost(limit: int) -> float:
        return sum((below if rows <= limit else above) / min(below, above) for rows, below, above in times)
    return min((0, *(rows for rows, _, _ in times)), key=cost)


def tune(model: torch.nn.Module, linears: bool, threads: int | None, kv_pool: torch.Tensor | None = None,
         budget_s: float | None = None, draw_vocab: int | None = None) -> Tuning:
    """Measure what is asked: linears (the crossover of our kernel and oneDNN's), threads
    (the engine's thread count, to race one thread against), kv_pool (the engine's: our
    attention against inductor's), draw_vocab (the model's vocabulary: our draw against
    torch's, compiled). Call under no grad."""
    layers = [m for m in model.modules() if isinstance(m, PackedLinear)]
    deadline = time.monotonic() + (BUDGET_S if budget_s is None else budget_s)
    timings: list[Timing] = []
    max_rows = brgemm_rows = one_thread = None
    complete = True
    if linears and layers and layers[0].few_rows:
        (max_rows, brgemm_rows), found, done = _tune_linears(layers, deadline)
        timings, complete = timings + found, complete and done
    if threads is not None and threads > 1 and layers:
        limits = (-1 if max_rows is None else max_rows, brgemm_rows or 0)
        one_thread, found, done = _tune_threads(layers, limits, threads, deadline)
        timings, complete = timings + found, complete and done
    attention = None
    if kv_pool is not None:
        attention, found, done = _tune_attention(kv_pool, deadline)
        timings, complete = timings + found, complete and done
    sampler = None
    if draw_vocab is not None:
        dtype = next(model.parameters()).dtype
        sampler, found, done = _tune_draw(draw_vocab, dtype, deadline)
        timings, complete = timings + found, complete and done
    return Tuning(max_rows, one_thread, attention, tuple(timings), complete, brgemm_rows, sampler)


def graph_or_eager(graph: DecodeGraph, kv_pool: torch.Tensor, max_rows: int, budget_s: float | None = None) -> Tuning:
    """The compiled decode graph (compiled already) against its step run eagerly, at each of
    GRAPH_ROWS up to max_rows decode rows of ATTENTION_CONTEXT cached tokens: the faster at
    each count (Tuning.graph_or_eager), eager only where it is EAGER_MARGIN faster in two races
    (each candidate's worse best time of the two). Counts left unmeasured past the budget take the last
    measured count's winner, and the table is marked incomplete."""
    deadline = time.monotonic() + (BUDGET_S if budget_s is None else budget_s)
    counts = [rows for rows in GRAPH_ROWS if rows <= max(max_rows, GRAPH_ROWS[0])]
    timings, choices = [], []
    for rows in counts:
        if time.monotonic() > deadline:
            break
        steps = {path: graph.scratch_step(kv_pool, rows, ATTENTION_CONTEXT, eager=path == "eager")
                 for path in ("graph", "eager")}
        ms = race(steps, GRAPH_REPEATS)
        if ms["eager"] * EAGER_MARGIN < ms["graph"]:  # eager only where a second race agrees
            again = race(steps, GRAPH_REPEATS)
            ms = {path: max(ms[path], again[path]) for path in ms}
        timings += [Timing("decode_graph", rows, path, t) for path, t in ms.items()]
        choices.append((rows, "eager" if ms["eager"] * EAGER_MARGIN < ms["graph"] else "graph"))
    return Tuning(timings=tuple(timings), complete=len(choices) == len(counts), graph_or_eager=tuple(choices) or None)


Limits = tuple[int | None, int | None]  # (linear_max_rows, linear_brgemm_rows)


def _tune_linears(layers: list[PackedLinear], deadline: float) -> tuple[Limits, list[Timing], bool]:
    candidates = {"ours": (-1, 0), "oneDNN": (0, 0)}  # name: (max_rows, brgemm_rows)
    if runs_brgemm(layers[0]):
        candidates["brgemm"] = (0, LINEAR_ROWS[-1])
    timings, times = [], []
    for rows in (r for r in LINEAR_ROWS if r <= own_max_rows(layers[0])):
        if time.monotonic() > deadline:
            return _linear_limits(times, complete=False), timings, False
        ms = race({name: _step(layers, rows, *limits) for name, limits in candidates.items()})
        timings += [Timing("small_batch_linear", rows, name, t) for name, t in ms.items()]
        times.append((rows, ms["ours"], ms.get("brgemm", math.inf), ms["oneDNN"]))
    return _linear_limits(times, complete=True), timings, True


def _linear_limits(times: list[tuple[int, float, float, float]], complete: bool) -> Limits:
    """segments(times) where brgemm was measured, else threshold's; None each where the
    measuring stopped early and its limit is the last count: past it nothing is known."""
    if not times:
        return None, None
    if all(math.isinf(brgemm) for _, _, brgemm, _ in times):
        return _limit([(rows, ours, onednn) for rows, ours, _, onednn in times], complete), None
    ours, brgemm = segments(times)
    last = times[-1][0]
    if not complete and last in (ours, brgemm):
        return (None if ours == last else ours), None
    return ours, (brgemm if brgemm > ours else 0)


def segments(times: Sequence[tuple[int, float, float, float]]) -> tuple[int, int]:
    """(rows, ours' ms, brgemm's ms, oneDNN's ms) for ascending row counts -> (a, b): ours up to
    a rows, brgemm past a up to b, oneDNN's past b (b == a: no brgemm); the pair whose choices
    cost least, as threshold's cost. Ties keep the fewest rows on brgemm."""
    def cost(pair: tuple[int, int]) -> float:
        a, b = pair
        return sum((ms[0] if rows <= a else ms[1] if rows <= b else ms[2]) / min(ms) for rows, *ms in times)
    counts = (0, *(rows for rows, *_ in times))
    return min(((a, b) for a in counts for b in counts if b >= a), key=lambda pair: (cost(pair), pair[1] - pair[0]))


def _tune_threads(layers: list[PackedLinear], limits: tuple[int, int], threads: int,
                  deadline: float) -> tuple[int | None, list[Timing], bool]:
    timings, times = [], []
    before = torch.get_num_threads()
    try:
        for rows in THREAD_ROWS:
            if time.monotonic() > deadline:
                return _limit(times, complete=False), timings, False
            step = _step(layers, rows, *limits)
            ms = race({"1 thread": _on_threads(step, 1), f"{threads} threads": _on_threads(step, threads)})
            timings += [Timing("one_thread_max_tokens", rows, name, t) for name, t in ms.items()]
            times.append((rows, ms["1 thread"] / SHARED_CORES_MARGIN, ms[f"{threads} threads"]))
    finally:
        torch.set_num_threads(before)
    return _limit(times, complete=True), timings, True


def _tune_attention(kv_pool: torch.Tensor, deadline: float) -> tuple[str | None, list[Timing], bool]:
    compiled = compile_for(kv_pool.device, decode_attention_with_own, dynamic=True)
    return _ours_or_torch("decode_attention", ATTENTION_ROWS, deadline, lambda rows: {
        "ours": _attention_step(torch.ops.rayinfer.decode_attention, kv_pool, rows),
        "torch": _attention_step(compiled, kv_pool, rows)})


def _tune_draw(vocab: int, dtype: torch.dtype, deadline: float) -> tuple[str | None, list[Timing], bool]:
    compiled = compile_for(torch.device("cpu"), draw, dynamic=True)
    return _ours_or_torch("sampler", DRAW_ROWS, deadline, lambda rows: {
        "ours": _draw_step(torch.ops.rayinfer.draw, vocab, dtype, rows, to_float=False),
        "torch": _draw_step(compiled, vocab, dtype, rows, to_float=True)})


def _ours_or_torch(choice: str, counts: Sequence[int], deadline: float,
                   steps: Callable[[int], dict[str, Callable[[], None]]]) -> tuple[str | None, list[Timing], bool]:
    """Our kernel against torch's expression compiled by inductor, one choice for every count:
    the expression's first call (its compile) outside the budget, then both raced at each count."""
    if time.monotonic() > deadline:
        return None, [], False  # not even the compile
    started = time.monotonic()
    steps(counts[0])["torch"]()
    deadline += time.monotonic() - started
    timings, times = [], []
    for rows in counts:
        if time.monotonic() > deadline:
            return None, timings, False
        ms = race(steps(rows))
        timings += [Timing(choice, rows, name, t) for name, t in ms.items()]
        times.append((rows, ms["ours"], ms["torch"]))
    return ("ours" if cheaper(times) else "torch"), timings, True


def _draw_step(run: Callable[..., object], vocab: int, dtype: torch.dtype, rows: int,
               to_float: bool) -> Callable[[], None]:
    """A sampled step's draw at `rows` rows of the model's logits, as the sampler calls it:
    torch's on float32 logits (the conversion is part of its cost), ours on the model's dtype."""
    logits = torch.randn(rows, vocab).to(dtype)
    temperatures, uniforms = torch.full((rows,), 0.8), torch.rand(rows, 1)

    def step() -> None:
        with torch.inference_mode():
            run(logits.float() if to_float else logits, temperatures, uniforms)
    return step


def cheaper(times: Sequence[tuple[int, float, float]]) -> bool:
    """Whether the first candidate of (rows, first's ms, second's ms) costs no more than the
    second over every count, each count weighing alike (threshold's cost)."""
    return sum(a / min(a, b) for _, a, b in times) <= sum(b / min(a, b) for _, a, b in times)


def _attention_step(attention: Callable[..., torch.Tensor], kv_pool: torch.Tensor, rows: int) -> Callable[[], None]:
    """A decode step's attention, every layer's, at `rows` rows of ATTENTION_CONTEXT cached
    tokens each. One layer's pools serve every layer's call: the layers' views differ in
    offset, which a compiled expression would be compiled again for; they are static, as in
    the graph, and the block table's width is none of the other sizes, which dynamo would
    tie to it (DecodeGraph.warm_up)."""
    num_layers, _, heads, _, block_size, head_dim = kv_pool.shape
    k_cache, v_cache = kv_pool[0, 0], kv_pool[0, 1]
    for pool in (kv_pool, k_cache, v_cache):  # the views' base too: dynamo guards on it
        torch._dynamo.mark_static(pool)
    tables = scratch_block_tables(kv_pool, rows, ATTENTION_CONTEXT, avoid=(rows, heads, head_dim, block_size))
    context = torch.full((rows,), min(ATTENTION_CONTEXT, tables.shape[1] * block_size), dtype=torch.int64)
    q, k, v = (torch.randn(rows, heads, head_dim).to(kv_pool.dtype) for _ in range(3))

    def run() -> None:
        with torch.inference_mode():
            for _ in range(num_layers):
                attention(q, k, v, k_cache, v_cache, tables, context)
    return run


def _limit(times: list[tuple[int, float, float]], complete: bool) -> int | None:
    """threshold(times); None (the default stands) where the measuring stopped early and the
    threshold is its last count: past it nothing is known."""
    if not times:
        return None
    limit = threshold(times)
    return None if not complete and limit == times[-1][0] else limit


def _step(layers: list[PackedLinear], rows: int, max_rows: int, brgemm_rows: int = 0) -> Callable[[], None]:
    """A step's linears at `rows` rows, ours up to max_rows (-1: the kernel's limit; 0: none),
    then brgemm up to brgemm_rows (0: none)."""
    dtype = layers[0].packed_weight.dtype
    inputs = {n: torch.randn(rows, n).to(dtype) for n in {layer.in_features for layer in layers}}

    def run() -> None:
        for layer in layers:
            x = inputs[layer.in_features]
            if layer.few_rows:
                torch.ops.rayinfer.linear(x, layer.packed_weight, layer.weight, layer.bias, "none", None, max_rows,
                                          brgemm_rows)
            else:
                onednn.linear(x, layer.packed_weight, layer.bias)
    return run


def _on_threads(step: Callable[[], None], threads: int) -> Callable[[], None]:
    def run() -> None:
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
        step()
    return run
