"""Steps through the compiled whole-forward graph (`compile_decode: true`), decodes and short
steps with prefill chunks among them, give what the eager reference path gives, checked
teacher-forced: one token sequence per prompt (the reference's greedy continuation) is
scored on both paths, and at every position the two logprobs of its token are close and
each side's best token is in the other's top 5. The one graph (and the sampler's draw) is
compiled while the engine is built, leaving no trace, and batches of one and of many then
run on it without compiling."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
import yaml

from engine import LLM, EngineConfig, SamplingParams
from engine.kernels import native, native_attention
from engine.model.attention import decode_attention_with_own, write_kv
from engine.kernels.cpu import cpu_features
from engine.model.decode_graph import DecodeGraph, write_new_kv
from engine.sampling.sampler import Sampler
from tests.engine_helpers import mixed_prompts, record_steps, teacher_forced

GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
GREEDY_TOP5 = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=5)


def greedy_scores(reference: LLM, prompts: list[list[int]]) -> tuple[list[list[int]], list[list]]:
    """The reference's greedy continuations and their scores: greedy is teacher forcing on
    its own best tokens, so these are the reference's teacher-forced scores of them."""
    outputs = reference.generate(prompts, GREEDY_TOP5)
    return [o.token_ids for o in outputs], [o.logprobs for o in outputs]


def assert_scores_close(fast: LLM, prompts: list[list[int]], continuations: list[list[int]], expected: list[list],
                        atol: float) -> None:
    """The continuations scored teacher-forced on fast: at every position its logprob of the
    token within atol of the expected (the reference's) and each side's best token in the
    other's top 5."""
    for index, (ours, theirs) in enumerate(zip(teacher_forced(fast, prompts, continuations), expected, strict=True)):
        for position, (a, b) in enumerate(zip(ours, theirs, strict=True)):
            where = f"prompt {index}, position {position}"
            assert a.token_id == b.token_id, where
            assert abs(a.logprob - b.logprob) < atol, f"logprob at {where}: {a.logprob} vs {b.logprob}"
            assert a.top[0][0] in dict(b.top) and b.top[0][0] in dict(a.top), f"best tokens apart at {where}"


def assert_fast_scores_close(fast: LLM, reference: LLM, prompts: list[list[int]], atol: float) -> None:
    """The reference's greedy continuations, scored teacher-forced on fast, close to the reference's scores."""
    assert_scores_close(fast, prompts, *greedy_scores(reference, prompts), atol)


def assert_alone_and_together_close(fast: LLM, reference: LLM, prompts: list[list[int]], atol: float) -> None:
    """The first two prompts one at a time on fast (a batch of one, one block then two), then
    all together, scored teacher-forced: within atol of the reference's at every position."""
    continuations, expected = greedy_scores(reference, prompts)
    for i in range(2):
        assert_scores_close(fast, prompts[i:i + 1], continuations[i:i + 1], expected[i:i + 1], atol)
    assert_scores_close(fast, prompts, continuations, expected, atol)


def num_compiled_graphs() -> int:
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def assert_untouched(engine) -> None:
    """The engine as if nothing had run: every KV block free, no prefix cached, pools zero."""
    blocks = engine.block_manager
    assert blocks.num_free_blocks == blocks.num_blocks and not blocks.hash_to_block_id
    assert not any(k.any() or v.any() for k, v in engine.runner.kv_caches)
    assert engine.runner.decode_graph.num_steps == 0


def compare(model_dir, dtype: str, reference_linears: str, atol: float, fast_linears: str = "auto",
            attention: str = "native", small_batch_linear: str = "auto") -> None:
    """attention: native or torch, not auto: which one auto measured faster here is no test's business."""
    before = num_compiled_graphs()
    fast = LLM(str(model_dir), weights="pretrained", dtype=dtype, device="cpu", compile_decode=True,
               linears=fast_linears, decode_attention=attention, small_batch_linear=small_batch_linear)
    compiled_at_start = num_compiled_graphs()
    expected = decode_attention_with_own if attention == "torch" else torch.ops.rayinfer.decode_attention
    assert fast.engine.runner.decode_graph.attention is expected
    assert fast.engine.runner.decode_graph.native_write is (attention != "torch")  # the pool's write: ours with ours
    # The graph and the sampler's draw compiled during construction, unless an earlier engine
    # of the same shapes in this process compiled them: dynamo caches per function, and the
    # graph takes its weights as inputs, so that one serves this engine too ...
    assert compiled_at_start - before in (0, 1, 2)
    assert_untouched(fast.engine)  # ... on scratch inputs that leave no trace
    reference = LLM(str(model_dir), weights="pretrained", dtype=dtype, device="cpu", linears=reference_linears, compile_decode=False)
    prompts = mixed_prompts(6)
    assert_alone_and_together_close(fast, reference, prompts, atol)
    sampled = fast.generate(prompts[:3], SamplingParams(max_tokens=8, temperature=0.8, seed=1, ignore_eos=True))
    assert all(len(o.token_ids) == 8 for o in sampled)
    assert fast.engine.runner.decode_graph.num_steps >= 2 * 15 + 15 + 7  # every decode-only step took the graph
    assert num_compiled_graphs() == compiled_at_start  # and none compiled anything new
    fast.engine.check_integrity()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_our_kv_write_is_index_copy(dtype: torch.dtype):
    native.load()
    generator = torch.Generator().manual_seed(0)
    pool = torch.randn(2, 2, 3, 5, 4, 8, generator=generator).to(dtype)  # [layers, k/v, H, blocks, block_size, D]
    new_kv = torch.randn(2 * 2 * 3, 4, 8, generator=generator).to(dtype)
    slots = torch.tensor([19, 0, 7, 8])  # the last slot, the first, two in one block
    expected = pool.clone()
    write_new_kv(expected, new_kv, slots, native=False)
    write_new_kv(pool, new_kv[:, :4], slots, native=True)
    assert torch.equal(pool, expected)
    with pytest.raises(RuntimeError, match="slot 20 at index 3 is outside the pool's slots of 20"):
        write_new_kv(pool, new_kv, torch.tensor([1, 2, 3, 20]), native=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_prefill_layers_kv_write_on_ours_is_index_copy(dtype: torch.dtype):
    """engine/model/attention.py write_kv, as eager steps write a layer's k, v [T, H, D]: ours
    where the decode graph runs our kernels, index_copy_ elsewhere."""
    native.load()
    generator = torch.Generator().manual_seed(1)
    caches = torch.randn(2, 3, 5, 4, 8, generator=generator).to(dtype)  # [k/v, H, blocks, block_size, D]
    k, v = torch.randn(2, 6, 3, 8, generator=generator).to(dtype)  # 6 tokens
    slots = torch.tensor([4, 5, 6, 7, 19, 0])  # a whole block, the last slot, the first
    expected = caches.clone()
    write_kv(k, v, expected[0], expected[1], slots)
    write_kv(k, v, caches[0], caches[1], slots, native=True)
    assert torch.equal(caches, expected)
    assert torch.equal(caches[0].view(3, -1, 8)[:, 19], k[4]) and torch.equal(caches[1].view(3, -1, 8)[:, 0], v[5])


def test_compiled_decode_matches_the_reference_path_in_fp32(tiny_gpt2_dir):
    compare(tiny_gpt2_dir, "float32", "reference", atol=1e-3)


def test_compiled_decode_with_the_compiled_expression_for_attention_matches_the_reference_path(tiny_gpt2_dir):
    # decode_attention: torch, what auto falls back to where our kernel cannot build
    compare(tiny_gpt2_dir, "float32", "reference", atol=1e-3, attention="torch")


def test_compiled_decode_on_reference_linears_matches_the_reference_path_in_fp32(tiny_gpt2_dir):
    # linears: reference leaves nn.Linear in the graph, for inductor to pack itself.
    compare(tiny_gpt2_dir, "float32", "reference", atol=1e-3, fast_linears="reference")


@pytest.mark.skipif(not cpu_features().can_pack(torch.bfloat16),
                    reason=f"bf16 linears need oneDNN bf16 (AVX-512 BW/VL/DQ); this CPU: {cpu_features().summary()}")
def test_compiled_decode_matches_the_eager_path_in_bf16(tiny_gpt2_dir):
    # Inductor's fused kernels keep LayerNorm, GELU and residuals in fp32 where eager rounds
    # each to bf16, so logits differ by a bf16 step or two (0.0625 at this model's logit size).
    compare(tiny_gpt2_dir, "bfloat16", "auto", atol=0.15)


def test_compiled_decode_on_onednns_linears_alone_matches_the_eager_path(tiny_gpt2_dir):
    """small_batch_linear: torch, every step on oneDNN's prepacked product (bf16 where it runs
    bf16): inductor lowered mkldnn._linear_pointwise itself and asserted on a bf16 weight given
    as a graph input, so the graph fell back to eager; it calls the op opaquely now."""
    dtype = "bfloat16" if cpu_features().can_pack(torch.bfloat16) else "float32"
    compare(tiny_gpt2_dir, dtype, "auto", atol={"bfloat16": 0.15, "float32": 1e-3}[dtype],
            small_batch_linear="torch")


def test_steps_with_short_prefill_chunks_take_the_graph_and_match_the_reference_path(tiny_gpt2_dir):
    """With a 40-token step budget every step fits the graph: prompts alone, several in one
    step, chunks of long prompts after their earlier chunks, chunks beside decodes, and a
    prompt after a cached prefix; none compiles anything new."""
    config = dict(weights="pretrained", dtype="float32", device="cpu", max_num_batched_tokens=40, max_num_seqs=8)
    fast = LLM(str(tiny_gpt2_dir), compile_decode=True, **config)
    compiled = num_compiled_graphs()
    steps = record_steps(fast.engine)
    reference = LLM(str(tiny_gpt2_dir), linears="reference", **config, compile_decode=False)
    prompts = mixed_prompts(12)  # 1 to 120 tokens
    prompts.append(prompts[7][:96] + [11, 12, 13])  # shares six blocks with the 120-token prompt
    assert_fast_scores_close(fast, reference, prompts[:12], atol=1e-3)
    assert_fast_scores_close(fast, reference, prompts[12:], atol=1e-3)  # after its cached prefix
    assert fast.engine.runner.decode_graph.num_steps == len(steps)  # every step took the graph
    assert any(1 in step and max(step) > 1 for step in steps)  # decodes beside a chunk among them
    assert all(sum(step) <= 40 for step in steps)  # so the 48- to 120-token prompts went in chunks
    assert fast.engine.block_manager.num_prefix_hit_tokens >= 96  # the last prompt prefilled after its prefix
    assert num_compiled_graphs() == compiled
    fast.engine.check_integrity()


@pytest.mark.parametrize("dtype, reference_linears, atol", [
    ("float32", "reference", 1e-3),
    # the eager path: inductor keeps LayerNorm, GELU and residuals in fp32 (see above)
    pytest.param("bfloat16", "auto", 0.15, marks=pytest.mark.skipif(
        not cpu_features().can_pack(torch.bfloat16), reason="bf16 linears need oneDNN bf16 (AVX-512 BW/VL/DQ)")),
])
def test_by_default_a_wave_of_prompts_takes_the_graph_in_steps_of_up_to_128_tokens(tiny_gpt2_dir, dtype,
                                                                                    reference_linears, atol):
    """max_num_batched_tokens auto, on CPU with the graph: graph_prefill_tokens (128) a step,
    so prompts sent together are prefilled in groups on the graph, steps past our C++ linears'
    64 rows (oneDNN's products inside the graph) among them, and match the reference."""
    config = dict(weights="pretrained", dtype=dtype, device="cpu")
    fast = LLM(str(tiny_gpt2_dir), compile_decode=True, **config)
    assert fast.engine.scheduler.max_num_batched_tokens == 128
    compiled = num_compiled_graphs()
    steps = record_steps(fast.engine)
    prompts = mixed_prompts(12)  # 406 tokens in all
    reference = LLM(str(tiny_gpt2_dir), linears=reference_linears, **config, compile_decode=False)
    assert_fast_scores_close(fast, reference, prompts, atol)
    assert fast.engine.runner.decode_graph.num_steps == len(steps)  # every step took the graph
    assert any(sum(step) > 64 for step in steps) and all(sum(step) <= 128 for step in steps)
    assert num_compiled_graphs() == compiled
    fast.engine.check_integrity()


def test_the_step_budget_on_auto_is_the_graphs_bound_on_cpu_and_512_without_the_graph(tiny_gpt2_dir):
    assert EngineConfig(device="cpu", compile_decode=True).step_tokens(cpu_graph=True) == 128
    assert EngineConfig(graph_prefill_tokens=64, max_num_seqs=96).step_tokens(cpu_graph=True) == 96
    assert EngineConfig(device="cpu").step_tokens(cpu_graph=False) == 512  # eager steps: one big prefill step costs less
    assert EngineConfig(graph_prefill_tokens=0).step_tokens(cpu_graph=True) == 512
    assert EngineConfig(max_num_seqs=600).step_tokens(cpu_graph=False) == 600  # every sequence decodes each step
    assert EngineConfig(max_num_batched_tokens=300).step_tokens(cpu_graph=True) == 300
    no_graph = LLM(str(tiny_gpt2_dir), weights="pretrained", device="cpu", compile_decode=False)
    assert no_graph.engine.scheduler.max_num_batched_tokens == 512
    with pytest.raises(ValueError, match="max_num_batched_tokens must be a positive integer"):
        EngineConfig(max_num_batched_tokens="all")
    with pytest.raises(ValueError, match="max_num_batched_tokens must be >= max_num_seqs"):
        EngineConfig(max_num_batched_tokens=32, max_num_seqs=64)


def test_one_thread_steps_take_the_one_graph_compiled_with_the_engine(tiny_gpt2_dir, caplog, restore_torch_threads):
    """One-token steps on one torch thread (one_thread_max_tokens) run the graph compiled
    while the engine was built, at two threads: it takes the thread count at each call
    (engine/kernels/inductor.py), so it is compiled once, and a stream's decodes compile nothing."""
    with caplog.at_level(logging.INFO, logger="engine.model.decode_graph"):
        fast = LLM(str(tiny_gpt2_dir), weights="pretrained", dtype="float32", device="cpu", compile_decode=True,
                   num_threads=2, one_thread_max_tokens=1)
    compiled = [r.getMessage() for r in caplog.records if "decode graph compiled" in r.getMessage()]
    assert [message.rsplit("(", 1)[1] for message in compiled] == ["torch threads: 2)"]
    assert torch.get_num_threads() == 2
    graphs = num_compiled_graphs()
    steps = record_steps(fast.engine)
    prompt = mixed_prompts(3)[2]  # 7 tokens, then 15 one-token decodes
    fast.generate([prompt], GREEDY)
    assert torch.get_num_threads() == 1  # the decodes ran on one thread
    assert fast.engine.runner.decode_graph.num_steps == len(steps) == 16
    assert num_compiled_graphs() == graphs
    reference = LLM(str(tiny_gpt2_dir), weights="pretrained", dtype="float32", device="cpu", linears="reference", compile_decode=False)
    assert_fast_scores_close(fast, reference, [prompt], atol=1e-3)


def test_a_step_past_graph_prefill_tokens_runs_eagerly(tiny_gpt2_dir):
    fast = LLM(str(tiny_gpt2_dir), weights="pretrained", dtype="float32", device="cpu", compile_decode=True,
               graph_prefill_tokens=16)
    steps = record_steps(fast.engine)
    prompts = mixed_prompts(4)  # 1, 3, 7 and 16 tokens
    fast.generate([prompts[3]], GREEDY)  # 16 tokens: the graph
    fast.generate([[5] + prompts[3]], GREEDY)  # 17, none cached: eager
    assert steps[0] == [16] and steps[16] == [17]
    assert fast.engine.runner.decode_graph.num_steps == len(steps) - 1  # all but the 17-token prefill
    with pytest.raises(ValueError, match="graph_prefill_tokens must be an integer >= 0"):
        EngineConfig(graph_prefill_tokens=-1)


def test_a_graph_that_cannot_compile_leaves_decode_steps_eager(tiny_gpt2_dir, monkeypatch, caplog):
    def no_compiler(*_args):
        raise RuntimeError("no C++ compiler")  # the fault: what inductor raises without one

    monkeypatch.setattr(DecodeGraph, "warm_up", no_compiler)
    fast = LLM(str(tiny_gpt2_dir), weights="pretrained", dtype="float32", device="cpu", compile_decode=True,
               linears="reference")
    assert fast.engine.runner.decode_graph is None
    assert "decode steps run eagerly" in caplog.text
    assert fast.engine.scheduler.max_num_batched_tokens == 512  # the budget of eager steps
    reference = LLM(str(tiny_gpt2_dir), weights="pretrained", dtype="float32", device="cpu", linears="reference", compile_decode=False)
    prompts = mixed_prompts(3)
    assert [o.token_ids for o in fast.generate(prompts, GREEDY)] == \
        [o.token_ids for o in reference.generate(prompts, GREEDY)]


def test_a_draw_that_cannot_compile_runs_eagerly_beside_the_graph(tiny_gpt2_dir, monkeypatch, caplog):
    warm_up = Sampler.warm_up

    def inductor_fails(sampler, vocab_size):
        if sampler.is_compiled:  # the fault: what inductor raised on CUDA for the draw alone
            raise NotImplementedError("NYI TritonSplitDimKernel reductions")
        warm_up(sampler, vocab_size)

    monkeypatch.setattr(Sampler, "warm_up", inductor_fails)
    config = dict(weights="pretrained", dtype="float32", device="cpu", linears="reference", sampler="torch")
    fast = LLM(str(tiny_gpt2_dir), compile_decode=True, **config)
    assert fast.engine.runner.decode_graph is not None and not fast.engine.runner.sampler.is_compiled
    assert "the sampler's draw did not compile" in caplog.text
    reference = LLM(str(tiny_gpt2_dir), **config, compile_decode=False)
    prompts = mixed_prompts(3)
    sampled = SamplingParams(max_tokens=8, temperature=0.8, seed=1, ignore_eos=True)
    for params in (GREEDY, sampled):
        assert [o.token_ids for o in fast.generate(prompts, params)] == \
            [o.token_ids for o in reference.generate(prompts, params)]
    assert fast.engine.runner.decode_graph.num_steps > 0


def test_an_attention_kernel_that_cannot_build_falls_back_to_the_expression(tiny_gpt2_dir, monkeypatch, caplog):
    def no_ninja():
        raise RuntimeError("Ninja is required to load C++ extensions")  # the fault: what torch raises

    monkeypatch.setattr(native_attention, "load", no_ninja)
    with caplog.at_level(logging.INFO, logger="engine.core.kernel_choice"):
        fast = LLM(str(tiny_gpt2_dir), weights="pretrained", dtype="float32", device="cpu", compile_decode=True)
    assert fast.engine.runner.decode_graph.attention is decode_attention_with_own
    assert "decode_attention: our C++ kernel is not available; inductor compiles the expression" in caplog.text
    with pytest.raises(ValueError, match=r"decode_attention: native: the C\+\+ kernel did not build here"):
        LLM(str(tiny_gpt2_dir), weights="pretrained", dtype="float32", device="cpu", compile_decode=True,
            decode_attention="native")


def test_compile_decode_auto_compiles_on_cpu_in_both_dtypes():
    assert EngineConfig(dtype="bfloat16", device="cpu", compile_decode="auto").decode_compiled
    assert EngineConfig(dtype="float32", device="cpu", compile_decode="auto").decode_compiled
    assert EngineConfig(dtype="float32", device="cpu", compile_decode=True).decode_compiled
    assert not EngineConfig(dtype="bfloat16", device="cpu", compile_decode=False).decode_compiled


def test_the_defaults_are_the_shipped_fast_path():
    """EngineConfig(), and so LLM(model), runs what configs/gpt2.yaml serves: the file sets no
    engine field, and the defaults compile the decode graph and bound the waiting line."""
    default = EngineConfig(device="cpu")
    assert default.decode_compiled and default.compile_decode == "auto"
    assert default.one_thread_max_tokens == "auto" and default.cuda_graphs == "auto"
    assert (default.max_waiting_requests, default.max_waiting_tokens) == (128, 16384)
    assert default.scheduling_policy == "fair" and default.allowed_priorities == (-100, 100)  # issue 55
    shipped = yaml.safe_load((Path(__file__).resolve().parents[1] / "configs" / "gpt2.yaml").read_text())
    assert shipped["applications"][0]["args"]["engine"] == {}
    with pytest.raises(ValueError, match="compile_decode must be true, false or auto"):
        EngineConfig(compile_decode="yes")
    with pytest.raises(ValueError, match="decode_attention must be auto, native or torch"):
        EngineConfig(decode_attention="cpp")
