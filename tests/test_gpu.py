"""The CUDA path runs the same code as the CPU path (skipped without a GPU): its eager steps
and its CUDA-graph decode steps token-exact with Hugging Face (on the CPU) in fp32 whatever
the batching does, the graphs' steps close to the eager ones in both dtypes, and the
compiled graph (inductor's Triton kernels, the attention expression reading the pools in
place) checked against the eager steps in both dtypes, as on CPU (tests/test_decode_graph.py)."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.config import EngineConfig
from engine.model.attention import decode_attention_with_own
from engine.model.cuda_graphs import CudaGraphDecode
from tests.engine_helpers import hf_greedy, hf_model, mixed_prompts, record_steps
from tests.test_decode_graph import assert_alone_and_together_close, num_compiled_graphs

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)


def shared_prefix_prompts() -> list[list[int]]:
    prefix = list(range(1000, 1050))  # three full blocks of 16
    return [prefix + [7, 8, 9], prefix + [11], prefix + list(range(2000, 2030))]


def assert_matches_hf(llm: LLM, hf, prompts: list[list[int]]) -> None:
    for prompt, out in zip(prompts, llm.generate(prompts, GREEDY)):
        assert out.token_ids == hf_greedy(hf, prompt, 16), f"prompt of {len(prompt)} tokens diverged"
    llm.engine.check_integrity()
    assert llm.engine.stats().num_kv_blocks_used == 0


@pytest.mark.parametrize("cuda_graphs", [False, True])
def test_cuda_greedy_matches_hf_on_cpu_in_fp32(tiny_gpt2_dir, cuda_graphs: bool):
    llm = LLM(str(tiny_gpt2_dir), weights="pretrained", dtype="float32", device="cuda", cuda_graphs=cuda_graphs, compile_decode=False)
    assert llm.engine.model_info.device.startswith("cuda")
    assert isinstance(llm.engine.runner.decode_graph, CudaGraphDecode) is cuda_graphs
    assert_matches_hf(llm, hf_model(tiny_gpt2_dir), mixed_prompts(8))
    if cuda_graphs:
        assert llm.engine.runner.decode_graph.num_steps > 0


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("dtype, atol", [("float32", 1e-3), ("bfloat16", 0.15)])
def test_cuda_graphs_match_the_eager_path(tiny_gpt2_dir, dtype: str, atol: float, compiled: bool):
    """Decode steps replayed from the graphs (auto on CUDA; of the compiled step with
    compile_decode) at the buckets the prompts reach: one to 8 rows, contexts of one to 9
    blocks, one-token prompts among them; logprobs within atol of the eager steps', every
    step of one-token rows replayed, nothing compiled or captured after startup, the pool
    left consistent."""
    config = dict(weights="pretrained", dtype=dtype, device="cuda", max_num_batched_tokens=40, max_num_seqs=8)
    graphed = LLM(str(tiny_gpt2_dir), compile_decode=compiled, **config)
    compiled_at_start = num_compiled_graphs()
    graphs = graphed.engine.runner.decode_graph
    assert isinstance(graphs, CudaGraphDecode) and graphs.compiled is compiled
    smallest = 2 if compiled else 1  # 1024 positions in blocks of 16: up to 64 blocks
    assert graphs.rows == [n for n in (1, 2, 4, 8) if n >= smallest]
    assert graphs.widths == [n for n in (1, 2, 4, 8, 16, 32, 64) if n >= smallest]
    num_graphs = len(graphs.rows) * len(graphs.widths)
    assert graphs.num_graphs == num_graphs
    steps = record_steps(graphed.engine)
    eager = LLM(str(tiny_gpt2_dir), cuda_graphs=False, **config, compile_decode=False)
    assert eager.engine.runner.decode_graph is None
    prompts = mixed_prompts(12)
    assert_alone_and_together_close(graphed, eager, prompts, atol)
    sampled = graphed.generate(prompts[:3], SamplingParams(max_tokens=8, temperature=0.8, seed=1, ignore_eos=True))
    assert all(len(output.token_ids) == 8 for output in sampled)
    assert graphs.num_steps == sum(all(n == 1 for n in step) for step in steps) > 0
    assert graphs.num_graphs == num_graphs and num_compiled_graphs() == compiled_at_start
    graphed.engine.check_integrity()
    assert graphed.engine.stats().num_kv_blocks_used == 0


def test_cuda_prefix_hits_chunks_and_preemption_match_hf(tiny_gpt2_dir):
    # 12 blocks of 16 tokens for 8 prompts of up to 120 tokens, 32 tokens a step: sequences
    # are preempted and recomputed, long prompts prefilled in chunks beside decodes.
    hf = hf_model(tiny_gpt2_dir)
    llm = LLM(str(tiny_gpt2_dir), weights="pretrained", dtype="float32", device="cuda",
              num_kv_blocks=12, max_num_batched_tokens=32, max_num_seqs=8, compile_decode=False)
    assert_matches_hf(llm, hf, [p for p in mixed_prompts(12) if len(p) + 16 <= 12 * 16][:8])
    assert llm.engine.stats().num_preemptions > 0
    assert_matches_hf(llm, hf, shared_prefix_prompts()[:1])
    assert_matches_hf(llm, hf, shared_prefix_prompts())
    assert llm.engine.block_manager.num_prefix_hit_tokens >= 2 * 48


@pytest.mark.parametrize("dtype, atol", [("float32", 1e-3), ("bfloat16", 0.15)])
def test_cuda_compiled_graph_matches_the_eager_path(tiny_gpt2_dir, dtype: str, atol: float):
    """Every step on the graph (a 40-token budget): decodes, prompts alone and together,
    chunks of long prompts beside decodes; nothing compiles after startup."""
    config = dict(weights="pretrained", dtype=dtype, device="cuda", max_num_batched_tokens=40, max_num_seqs=8)
    fast = LLM(str(tiny_gpt2_dir), compile_decode=True, cuda_graphs=False, **config)
    assert fast.engine.runner.decode_graph.attention is decode_attention_with_own  # auto on CUDA
    compiled = num_compiled_graphs()
    steps = record_steps(fast.engine)
    eager = LLM(str(tiny_gpt2_dir), cuda_graphs=False, **config, compile_decode=False)
    prompts = mixed_prompts(12)
    assert_alone_and_together_close(fast, eager, prompts, atol)
    sampled = fast.generate(prompts[:3], SamplingParams(max_tokens=8, temperature=0.8, seed=1, ignore_eos=True))
    assert all(len(output.token_ids) == 8 for output in sampled)  # the draw beside the graph (eager on CUDA)
    assert fast.engine.runner.decode_graph.num_steps == len(steps)
    assert num_compiled_graphs() == compiled
    fast.engine.check_integrity()


def test_cuda_auto_dtype_and_seeded_sampling(tiny_gpt2_dir):
    llm = LLM(str(tiny_gpt2_dir), weights="pretrained", device="auto", compile_decode=False)
    assert llm.engine.model_info.dtype in ("bfloat16", "float16")
    params = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, seed=7, ignore_eos=True)
    alone = llm.generate([[1, 2, 3]], params)[0].token_ids
    batched = llm.generate(mixed_prompts(4) + [[1, 2, 3]], params)[-1].token_ids
    assert alone == batched


def test_cuda_compile_decode_auto_compiles_inside_cuda_graphs_only(tiny_gpt2_dir):
    assert EngineConfig(device="cuda", compile_decode="auto").decode_compiled
    assert not EngineConfig(device="cuda", compile_decode="auto", cuda_graphs=False).decode_compiled
    assert not EngineConfig(device="cuda").decode_compiled  # compile_decode's default: off
    # the step budget's auto: 512 on a GPU, where prefill steps are not the CPU's 128-token groups
    graphed = LLM(str(tiny_gpt2_dir), weights="pretrained", device="cuda", compile_decode="auto")
    assert graphed.engine.scheduler.max_num_batched_tokens == 512


def test_lora_on_cuda_runs_eager_steps_where_cuda_graphs_is_auto_and_each_adapter_is_its_own(tiny_gpt2_dir, tmp_path):
    """The captured graphs do not take adapter rows yet: auto resolves them off (and the
    compiled step with them) rather than refusing the engine; adapter and base rows mixed."""
    from tests.test_lora import save_adapter

    adapter = save_adapter(tiny_gpt2_dir, tmp_path / "a", 0, r=8, lora_alpha=16, target_modules=["c_attn", "c_fc"])
    config = EngineConfig(device="cuda", max_loras=1, compile_decode="auto")
    assert not config.decode_graphed and not config.decode_compiled
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    outputs = {}
    for device in ("cuda", "cpu"):
        llm = LLM(str(tiny_gpt2_dir), weights="pretrained", device=device, dtype="float32", compile_decode=False,
                  max_loras=1)
        llm.engine.add_lora("a", str(adapter))
        outputs[device] = [o.token_ids for o in llm.generate([[1, 2, 3], [1, 2, 3]], params, lora_name=["a", None])]
    assert outputs["cuda"] == outputs["cpu"] and outputs["cuda"][0] != outputs["cuda"][1]


def test_a_compiled_step_that_cannot_capture_falls_back_to_graphs_of_the_eager_step(tiny_gpt2_dir, monkeypatch):
    capture = CudaGraphDecode.capture

    def capture_eager_only(self, kv_pool):  # the fault: the compiled step fails to capture
        if self.compiled:
            raise RuntimeError("injected: no capture of the compiled step")
        capture(self, kv_pool)

    monkeypatch.setattr(CudaGraphDecode, "capture", capture_eager_only)
    llm = LLM(str(tiny_gpt2_dir), weights="pretrained", dtype="float32", device="cuda", compile_decode="auto")
    graphs = llm.engine.runner.decode_graph
    assert isinstance(graphs, CudaGraphDecode) and not graphs.compiled and graphs.num_graphs > 0
    assert_matches_hf(llm, hf_model(tiny_gpt2_dir), mixed_prompts(4))
    assert graphs.num_steps > 0
