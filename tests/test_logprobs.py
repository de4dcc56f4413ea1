"""Logprobs: of the model's own distribution (raw logits, float32), within 1e-3 of Hugging
Face's log_softmax on the same weights, for generated tokens and for prompt tokens (echo),
whatever the batching does: chunked prefill, prefix-cache hits, preemption, mixed batches."""

from __future__ import annotations

import asyncio

import pytest
import torch

from engine import LLM, AsyncEngine, EngineConfig, SamplingParams
from tests.engine_helpers import hf_model, mixed_prompts

ATOL = 1e-3


@pytest.fixture(scope="module")
def hf_fp32(tiny_gpt2_dir):
    return hf_model(tiny_gpt2_dir)


@pytest.fixture(scope="module")
def llm(tiny_gpt2_dir) -> LLM:
    return make_llm(tiny_gpt2_dir)


def make_llm(model_dir, **config) -> LLM:
    return LLM(str(model_dir), weights="pretrained", dtype="float32", device="cpu", **config, compile_decode=False)


def hf_log_softmax(model, token_ids: list[int]) -> torch.Tensor:
    """[len, vocab]: row i is the distribution of token i + 1 given tokens 0..i."""
    with torch.inference_mode():
        logits = model(torch.tensor([token_ids])).logits[0]
    return torch.log_softmax(logits.float(), dim=-1)


def assert_position_matches(entry, reference_row: torch.Tensor, token_id: int, k: int) -> None:
    assert entry.token_id == token_id
    assert abs(entry.logprob - reference_row[token_id].item()) < ATOL
    assert len(entry.top) == k
    values, ids = reference_row.topk(k)
    assert [t for t, _ in entry.top] == ids.tolist()
    assert torch.allclose(torch.tensor([lp for _, lp in entry.top]), values, atol=ATOL)


def assert_output_logprobs_match(hf, prompt: list[int], out, k: int) -> None:
    reference = hf_log_softmax(hf, prompt + out.token_ids)
    assert len(out.logprobs) == len(out.token_ids)
    for i, (token, entry) in enumerate(zip(out.token_ids, out.logprobs)):
        assert_position_matches(entry, reference[len(prompt) + i - 1], token, k)
    assert out.cumulative_logprob == pytest.approx(sum(e.logprob for e in out.logprobs), abs=ATOL)


def assert_prompt_logprobs_match(hf, prompt: list[int], prompt_logprobs, k: int) -> None:
    reference = hf_log_softmax(hf, prompt)
    assert len(prompt_logprobs) == len(prompt)
    assert prompt_logprobs[0] is None
    for i in range(1, len(prompt)):
        assert_position_matches(prompt_logprobs[i], reference[i - 1], prompt[i], k)


def test_generated_tokens_logprobs_and_top_k_match_hf(llm, hf_fp32):
    prompts = mixed_prompts(6)
    outputs = llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=5))
    for prompt, out in zip(prompts, outputs):
        assert_output_logprobs_match(hf_fp32, prompt, out, k=5)


def test_logprobs_zero_gives_the_sampled_token_only(llm, hf_fp32):
    prompt = mixed_prompts(3)[2]
    out = llm.generate([prompt], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, logprobs=0))[0]
    assert_output_logprobs_match(hf_fp32, prompt, out, k=0)


def test_logprobs_are_of_the_raw_distribution_not_the_sampling_transforms(llm, hf_fp32):
    # Temperature, top-k, penalties and a bias all change what is sampled, never what is reported.
    params = SamplingParams(max_tokens=10, temperature=2.0, top_k=5, seed=3, ignore_eos=True, logprobs=3,
                            presence_penalty=1.5, repetition_penalty=1.3, logit_bias={100: 5.0})
    prompt = mixed_prompts(4)[3]
    out = llm.generate([prompt], params)[0]
    assert_output_logprobs_match(hf_fp32, prompt, out, k=3)
    # At temperature 2 over five candidates the samples are not all the argmax.
    assert any(e.token_id != e.top[0][0] for e in out.logprobs)


def test_rows_without_logprobs_get_none_in_a_mixed_batch(llm, hf_fp32):
    prompts = mixed_prompts(4)
    with_logprobs = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=2)
    plain = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    outputs = llm.generate(prompts, [with_logprobs, plain, with_logprobs, plain])
    for prompt, out in zip(prompts[::2], outputs[::2]):
        assert_output_logprobs_match(hf_fp32, prompt, out, k=2)
    assert all(o.logprobs is None and o.cumulative_logprob is None and o.prompt_logprobs is None for o in outputs[1::2])
    # The plain rows decode as they do alone.
    alone = llm.generate(prompts[1::2], plain)
    assert [o.token_ids for o in outputs[1::2]] == [o.token_ids for o in alone]


def test_prompt_logprobs_match_hf_with_the_first_token_none(llm, hf_fp32):
    prompts = mixed_prompts(8)[1:]
    outputs = llm.generate(prompts, SamplingParams(max_tokens=2, temperature=0, ignore_eos=True, prompt_logprobs=2))
    for prompt, out in zip(prompts, outputs):
        assert_prompt_logprobs_match(hf_fp32, prompt, out.prompt_logprobs, k=2)
        assert out.logprobs is None


def test_prompt_logprobs_survive_chunked_prefill(tiny_gpt2_dir, hf_fp32):
    llm = make_llm(tiny_gpt2_dir, max_num_batched_tokens=16, max_num_seqs=4)
    prompts = mixed_prompts(8)[4:]  # 17 to 120 tokens: two to eight chunks each
    outputs = llm.generate(prompts, SamplingParams(max_tokens=3, temperature=0, ignore_eos=True, prompt_logprobs=1, logprobs=1))
    for prompt, out in zip(prompts, outputs):
        assert_prompt_logprobs_match(hf_fp32, prompt, out.prompt_logprobs, k=1)
        assert_output_logprobs_match(hf_fp32, prompt, out, k=1)
    llm.engine.check_integrity()


def test_prompt_logprobs_survive_a_prefix_cache_hit(tiny_gpt2_dir, hf_fp32):
    llm = make_llm(tiny_gpt2_dir)
    prompt = list(range(1000, 1050))  # three full blocks of 16, cached by the first request
    llm.generate([prompt], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
    echoed = llm.generate([prompt], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True, prompt_logprobs=0))[0]
    assert_prompt_logprobs_match(hf_fp32, prompt, echoed.prompt_logprobs, k=0)
    # The scoring request computed its prompt instead of taking the cached blocks...
    assert llm.engine.stats().prefix_cache_hit_rate == 0
    # ...while a plain request still hits them.
    llm.generate([prompt], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
    assert llm.engine.stats().prefix_cache_hit_rate > 0.2
    assert llm.engine.stats().num_kv_blocks_used == 0


def test_prompt_logprobs_survive_preemption_mid_prefill(tiny_gpt2_dir, hf_fp32):
    # 12 blocks of 16 tokens, 32-token chunks, prompts needing 21 blocks: sequences are
    # preempted part-way through scoring their prompts and recomputed from the start.
    llm = make_llm(tiny_gpt2_dir, num_kv_blocks=12, max_num_batched_tokens=32, max_num_seqs=4)
    scheduler = llm.engine.scheduler
    preempted_mid_scoring = []
    real_preempt = scheduler._preempt

    def preempt(seq):  # a spy: records, then the real preemption
        preempted_mid_scoring.append(seq.needs_prompt_logprobs and len(seq.prompt_logprobs) > 1)
        real_preempt(seq)

    scheduler._preempt = preempt
    prompts = [mixed_prompts(12)[i] for i in (7, 10, 6, 9)]  # 120, 90, 64, 48 tokens
    outputs = llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, prompt_logprobs=1, logprobs=1))
    assert any(preempted_mid_scoring)
    for prompt, out in zip(prompts, outputs):
        assert_prompt_logprobs_match(hf_fp32, prompt, out.prompt_logprobs, k=1)
        assert_output_logprobs_match(hf_fp32, prompt, out, k=1)
    llm.engine.check_integrity()
    assert llm.engine.stats().num_kv_blocks_used == 0


def test_max_tokens_zero_scores_the_prompt_and_generates_nothing(llm, hf_fp32):
    prompts = mixed_prompts(5)[2:]
    params = SamplingParams(max_tokens=0, prompt_logprobs=1)
    outputs = llm.generate(prompts, [params, SamplingParams(max_tokens=3, temperature=0), params])
    for prompt, out in zip(prompts[::2], outputs[::2]):
        assert out.token_ids == [] and out.finish_reason == "length"
        assert_prompt_logprobs_match(hf_fp32, prompt, out.prompt_logprobs, k=1)
    assert len(outputs[1].token_ids) == 3
    assert llm.engine.stats().num_kv_blocks_used == 0


def test_a_one_token_prompt_has_one_none_prompt_logprob(llm):
    out = llm.generate([[42]], SamplingParams(max_tokens=0, prompt_logprobs=3))[0]
    assert out.prompt_logprobs == [None] and out.token_ids == []


def test_max_tokens_zero_needs_prompt_logprobs():
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)


@pytest.mark.parametrize("field", ["logprobs", "prompt_logprobs"])
@pytest.mark.parametrize("value", [-1, 21, 1.5, True, "2"])
def test_invalid_logprob_counts_are_rejected_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_the_async_stream_carries_logprobs_per_token_and_prompt_logprobs_once(tiny_gpt2_dir, hf_fp32):
    engine = AsyncEngine(EngineConfig(model=str(tiny_gpt2_dir), weights="pretrained", dtype="float32", device="cpu", compile_decode=False),
                         max_chunks_per_s=None)
    prompt = mixed_prompts(4)[3]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=2, prompt_logprobs=2)

    async def collect(request_id, params):
        return [chunk async for chunk in engine.generate(request_id, prompt, params)]

    try:
        chunks = asyncio.run(collect("lp", params))
        prompt_only = asyncio.run(collect("echo", SamplingParams(max_tokens=0, prompt_logprobs=0)))
    finally:
        engine.shutdown()
    assert all(len(c.logprobs) == len(c.token_ids) for c in chunks)
    assert [c.prompt_logprobs is not None for c in chunks] == [True] + [False] * (len(chunks) - 1)
    assert_prompt_logprobs_match(hf_fp32, prompt, chunks[0].prompt_logprobs, k=2)
    tokens = [t for c in chunks for t in c.token_ids]
    logprobs = [e for c in chunks for e in c.logprobs]
    reference = hf_log_softmax(hf_fp32, prompt + tokens)
    for i, (token, entry) in enumerate(zip(tokens, logprobs)):
        assert_position_matches(entry, reference[len(prompt) + i - 1], token, k=2)
    assert chunks[-1].cumulative_logprob == pytest.approx(sum(e.logprob for e in logprobs), abs=ATOL)
    assert [c.token_ids for c in prompt_only] == [[]] and prompt_only[0].finish_reason == "length"
    assert_prompt_logprobs_match(hf_fp32, prompt, prompt_only[0].prompt_logprobs, k=0)
