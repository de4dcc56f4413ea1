"""The engine's record of its steps: what each computed and how long it took, drained once."""

from __future__ import annotations

from engine import LLM, SamplingParams
from engine.core.step_log import StepLog, StepRecord


def make_llm(model_dir, **config) -> LLM:
    return LLM(str(model_dir), weights="pretrained", dtype="float32", device="cpu", **config, compile_decode=False)


def test_each_step_records_its_prompt_and_decode_tokens(tiny_gpt2_dir):
    llm = make_llm(tiny_gpt2_dir, max_num_batched_tokens=64)
    assert llm.engine.step_log.drain() == []  # the warm-up's steps are not the caller's
    prompts = [list(range(5, 45)), list(range(100, 140))]  # 80 prompt tokens: two prefill steps at 64
    llm.generate(prompts, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    steps = llm.engine.step_log.drain()

    assert sum(step.num_prompt_tokens for step in steps) == 80
    assert sum(step.num_tokens - step.num_prompt_tokens for step in steps) == 2 * 3  # the decodes after each first token
    assert all(step.num_tokens <= 64 and step.duration_s > 0 for step in steps)
    assert [step.kind for step in steps[:2]] == ["prefill", "prefill"]
    assert steps[0].num_tokens == steps[0].num_prompt_tokens == 64
    assert (steps[1].num_tokens, steps[1].num_prompt_tokens) == (16 + 1, 16)  # the rest, beside the first's decode
    assert steps[-1].kind == "decode" and steps[-1].num_tokens == 1  # the second prompt, a step behind
    assert llm.engine.step_log.drain() == []


def test_a_prefix_cache_hit_records_only_the_prompt_tokens_computed(tiny_gpt2_dir):
    llm = make_llm(tiny_gpt2_dir, enable_prefix_caching=True, block_size=16)
    prompt = list(range(200, 240))  # 40 tokens: two full blocks can be reused
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    llm.generate([prompt], params)
    llm.engine.step_log.drain()
    llm.generate([prompt], params)
    first = llm.engine.step_log.drain()[0]
    assert first.kind == "prefill" and first.num_prompt_tokens == 40 - 32


def test_an_undrained_log_keeps_only_the_newest_records():
    log = StepLog(size=3)
    for tokens in range(1, 6):
        log.append(StepRecord(0.01, tokens, 0))
    assert [record.num_tokens for record in log.drain()] == [3, 4, 5]
    assert log.drain() == []
