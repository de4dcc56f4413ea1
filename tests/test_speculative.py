"""Speculative decoding by prompt lookup (`speculative: {method: ngram, ...}`) changes no
output: greedy is token-exact with the engine without it and with Hugging Face (fp32,
`linears: reference`) through batching, preemption, prefix hits and chunked prefill; sampled
tokens keep their distribution, and a seeded request its very tokens. Rejected proposals
leave no KV block behind and no key in the prefix cache.

The tiny checkpoint's own greedy text rarely repeats, so most requests here restrict their
output to four tokens with logit_bias (which speculates): n-grams then recur, and about half
the proposals are kept, half rejected."""

from __future__ import annotations

import asyncio

import pytest
import torch
from scipy.stats import chi2

from engine import LLM, AsyncEngine, EngineConfig, SamplingParams
from engine.core.block_manager import chain_hash
from engine.speculative.ngram_proposer import NgramIndex
from tests.engine_helpers import hf_model, mixed_prompts, record_steps

SPEC = {"num_speculative_tokens": 4}
FEW = {token: 100.0 for token in (11, 12, 13, 14)}  # the output is these tokens, in the model's order
MAX_TOKENS = 30
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
GREEDY_FEW = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, logit_bias=FEW)
# The chi-square tests' false-failure rate, were the two distributions the same.
FALSE_FAILURE_RATE = 1e-4


def make_llm(model_dir, compile_decode: bool = False, **config) -> LLM:
    return LLM(str(model_dir), weights="pretrained", dtype="float32", device="cpu", linears="reference",
               compile_decode=compile_decode, **config)


def repetitive_prompts() -> list[list[int]]:
    return [[5, 6, 7, 8] * 10, [11, 12, 13, 14, 12] * 6, list(range(40, 60)) * 3, [9] * 17]


def hf_greedy(model, prompt: list[int], max_new_tokens: int, bias: dict[int, float] | None) -> list[int]:
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None,
            pad_token_id=0, sequence_bias={(token,): b for token, b in (bias or {}).items()} or None)
    return out[0, len(prompt):].tolist()


def assert_no_rejected_token_kept(llm: LLM, outputs) -> None:
    """Every KV block back in the pool, and every key in the prefix cache that of a full
    block of some request's prompt and output, as kept, with its tokens."""
    engine = llm.engine
    engine.check_integrity()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    kept: dict[int, tuple[int, ...]] = {}
    for out in outputs:
        tokens, prev = out.prompt_token_ids + out.token_ids, None
        for start in range(0, len(tokens) - engine.config.block_size + 1, engine.config.block_size):
            block = tuple(tokens[start : start + engine.config.block_size])
            prev = chain_hash(prev, block)
            kept[prev] = block
    for block_hash, block_id in engine.block_manager.hash_to_block_id.items():
        assert kept.get(block_hash) == engine.block_manager.blocks[block_id].token_ids, f"block {block_id}"


def assert_spec_kept_some_and_rejected_some(llm: LLM) -> None:
    stats = llm.engine.stats()
    assert 0 < stats.num_spec_accepted_tokens < stats.num_spec_proposed_tokens
    assert stats.spec_acceptance_rate == stats.num_spec_accepted_tokens / stats.num_spec_proposed_tokens


@pytest.fixture(scope="module")
def plain(tiny_gpt2_dir) -> LLM:
    """The engine without speculation: the reference every test compares with."""
    return make_llm(tiny_gpt2_dir)


def test_greedy_with_speculation_is_token_exact_with_hf_and_without(tiny_gpt2_dir, plain):
    hf = hf_model(tiny_gpt2_dir)
    prompts = repetitive_prompts() + mixed_prompts(6)
    params = [GREEDY_FEW if i % 3 else GREEDY for i in range(len(prompts))]
    llm = make_llm(tiny_gpt2_dir, speculative=SPEC)
    outputs = llm.generate(prompts, params)
    for prompt, p, out in zip(prompts, params, outputs):
        assert out.token_ids == hf_greedy(hf, prompt, MAX_TOKENS, p.logit_bias), f"prompt of {len(prompt)} tokens"
    assert [o.token_ids for o in outputs] == [o.token_ids for o in plain.generate(prompts, params)]
    assert_spec_kept_some_and_rejected_some(llm)
    assert_no_rejected_token_kept(llm, outputs)


def test_requests_that_do_not_speculate_run_beside_those_that_do_unchanged(tiny_gpt2_dir, plain):
    """logprobs and penalties keep a request from speculating; in one batch with speculating
    ones, each gets what it gets without speculation, logprobs included."""
    prompts = repetitive_prompts()
    params = [GREEDY_FEW, SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, logit_bias=FEW, logprobs=2),
              SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, logit_bias=FEW, presence_penalty=0.5),
              GREEDY_FEW]
    llm = make_llm(tiny_gpt2_dir, speculative=SPEC)
    steps = record_steps(llm.engine)
    outputs, expected = llm.generate(prompts, params), plain.generate(prompts, params)
    assert [o.token_ids for o in outputs] == [o.token_ids for o in expected]
    for ours, theirs in zip(outputs[1].logprobs, expected[1].logprobs):
        assert ours.token_id == theirs.token_id and ours.logprob == pytest.approx(theirs.logprob, abs=1e-4)
    assert any(len(step) == 4 and sum(step) > 4 for step in steps)  # speculating rows beside the decodes
    assert_spec_kept_some_and_rejected_some(llm)
    assert_no_rejected_token_kept(llm, outputs)


def test_preemption_under_a_tiny_block_pool_with_speculation_changes_no_token(tiny_gpt2_dir, plain):
    prompts = [p for p in mixed_prompts(12) if len(p) + MAX_TOKENS <= 10 * 16][:8]
    llm = make_llm(tiny_gpt2_dir, num_kv_blocks=10, max_num_batched_tokens=64, speculative=SPEC)
    outputs = llm.generate(prompts, GREEDY_FEW)
    assert [o.token_ids for o in outputs] == [o.token_ids for o in plain.generate(prompts, GREEDY_FEW)]
    assert llm.engine.stats().num_preemptions > 0
    assert_spec_kept_some_and_rejected_some(llm)
    assert_no_rejected_token_kept(llm, outputs)


def test_prefix_hits_and_chunked_prefill_with_speculation_change_no_token(tiny_gpt2_dir, plain):
    prefix = list(range(1000, 1050))
    prompts = [prefix + [7, 8, 9], prefix + [11], prefix + list(range(2000, 2030))]
    llm = make_llm(tiny_gpt2_dir, max_num_batched_tokens=16, max_num_seqs=4, speculative=SPEC)
    expected = [o.token_ids for o in plain.generate(prompts, GREEDY_FEW)]
    first = llm.generate(prompts[:1], GREEDY_FEW)
    outputs = llm.generate(prompts, GREEDY_FEW)
    assert [o.token_ids for o in first + outputs] == expected[:1] + expected
    assert llm.engine.stats().prefix_cache_hit_rate > 0.3
    assert_spec_kept_some_and_rejected_some(llm)
    assert_no_rejected_token_kept(llm, first + outputs)


@pytest.mark.parametrize("max_tokens", [1, 2, 7, 13])
def test_stop_tokens_and_max_tokens_cut_the_kept_proposals_where_they_would_end_the_output(tiny_gpt2_dir, plain,
                                                                                          max_tokens):
    params = [SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, logit_bias=FEW),
              SamplingParams(max_tokens=MAX_TOKENS, temperature=0, logit_bias=FEW, stop_token_ids=[13])]
    prompts = repetitive_prompts()[1:3]
    llm = make_llm(tiny_gpt2_dir, speculative=SPEC)
    outputs, expected = llm.generate(prompts, params), plain.generate(prompts, params)
    assert [(o.token_ids, o.finish_reason) for o in outputs] == [(o.token_ids, o.finish_reason) for o in expected]
    assert len(outputs[0].token_ids) == max_tokens and outputs[1].finish_reason == "stop"
    assert_no_rejected_token_kept(llm, outputs)


def test_a_stop_string_inside_kept_proposals_ends_the_text_as_without_speculation(tiny_gpt2_dir, plain):
    prompts = repetitive_prompts()
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, logit_bias=FEW, stop=["/,"])
    llm = make_llm(tiny_gpt2_dir, speculative=SPEC)
    outputs, expected = llm.generate(prompts, params), plain.generate(prompts, params)
    assert [(o.text, o.token_ids, o.finish_reason) for o in outputs] == [(o.text, o.token_ids, o.finish_reason)
                                                                         for o in expected]
    assert any(o.finish_reason == "stop" for o in outputs) and llm.engine.stats().num_spec_accepted_tokens > 0
    assert_no_rejected_token_kept(llm, outputs)


def test_a_step_takes_proposals_only_up_to_max_step_rows(tiny_gpt2_dir):
    llm = make_llm(tiny_gpt2_dir, speculative=SPEC | {"max_step_rows": 6})
    steps = record_steps(llm.engine)
    llm.generate(repetitive_prompts()[:3], GREEDY_FEW)
    assert steps[0] == [40, 30, 60]  # the prompts
    assert max(sum(step) for step in steps[1:]) == 6  # 3 decodes + 3 proposals, and no more
    steps.clear()
    llm.generate(mixed_prompts(8), GREEDY_FEW)  # 8 decodes: past the cap already
    assert all(n == 1 for step in steps[1:] for n in step)


def test_a_seeded_request_draws_the_same_tokens_with_speculation_or_without(tiny_gpt2_dir, plain):
    prompts = repetitive_prompts()
    params = [SamplingParams(max_tokens=MAX_TOKENS, temperature=1.5, top_k=3 if i % 2 else 0, seed=i, logit_bias=FEW,
                             ignore_eos=True) for i in range(len(prompts))]
    llm = make_llm(tiny_gpt2_dir, speculative=SPEC)
    outputs = llm.generate(prompts, params)
    assert [o.token_ids for o in outputs] == [o.token_ids for o in plain.generate(prompts, params)]
    alone = llm.generate(prompts[:1], params[:1])  # another batch, other proposals' rows: the same tokens
    assert alone[0].token_ids == outputs[0].token_ids
    assert_spec_kept_some_and_rejected_some(llm)


def token_count_outcomes(llm: LLM, num: int) -> list[tuple[int, ...]]:
    """Of num unseeded requests over FEW's four tokens: per request, how many times each of
    the four came in its 12 tokens (one outcome per request: requests are independent, the
    tokens of one are not)."""
    params = SamplingParams(max_tokens=12, temperature=1.0, logit_bias=FEW, ignore_eos=True)
    outputs = llm.generate([[12] * 20] * num, params)
    return [tuple(out.token_ids.count(token) for token in FEW) for out in outputs]


def chi_square_homogeneity(ours: list[int], theirs: list[int]) -> tuple[float, int]:
    """The statistic and degrees of freedom of two samples of one categorical outcome,
    cells rarer than 10 in both samples together merged into one."""
    cells = sorted(set(ours) | set(theirs), key=lambda c: ours.count(c) + theirs.count(c))
    table, rare = [], [0, 0]
    for cell in cells:
        a, b = ours.count(cell), theirs.count(cell)
        if a + b < 10:
            rare = [rare[0] + a, rare[1] + b]
        else:
            table.append((a, b))
    if sum(rare):
        table.append(tuple(rare))
    n_a, n_b = len(ours), len(theirs)
    statistic = 0.0
    for a, b in table:
        expected_a, expected_b = (a + b) * n_a / (n_a + n_b), (a + b) * n_b / (n_a + n_b)
        statistic += (a - expected_a) ** 2 / expected_a + (b - expected_b) ** 2 / expected_b
    return statistic, len(table) - 1


def test_sampled_tokens_keep_their_distribution_under_speculation(tiny_gpt2_dir, plain, monkeypatch):
    """Per token of FEW, a chi-square test of homogeneity of how often it comes in a
    request (two samples of 1000 requests), each at a quarter of FALSE_FAILURE_RATE. Every
    step speculates (16 decodes and their proposals stay under max_step_rows), and every
    proposal is 12, which the model seldom draws: where the rule kept a proposal too often,
    12 would come more often. (The prompt's own n-grams propose what the model would draw
    anyway: the tiny model's next token depends on little more than its last.)"""
    monkeypatch.setattr(NgramIndex, "propose", lambda _index, _tokens, num_tokens: [12] * num_tokens)
    llm = make_llm(tiny_gpt2_dir, speculative=SPEC | {"max_step_rows": 80}, max_num_seqs=16, seed=1)
    ours, theirs = token_count_outcomes(llm, 1000), token_count_outcomes(plain, 1000)
    assert_spec_kept_some_and_rejected_some(llm)
    for index, token in enumerate(FEW):
        statistic, dof = chi_square_homogeneity([o[index] for o in ours], [o[index] for o in theirs])
        assert dof >= 3, "the test needs a spread of outcomes to say anything"
        assert statistic < chi2.ppf(1 - FALSE_FAILURE_RATE / len(FEW), dof), f"token {token}: {statistic:.1f}, {dof} dof"


def test_on_the_compiled_decode_graph_speculation_changes_no_token(tiny_gpt2_dir):
    llm = make_llm(tiny_gpt2_dir, compile_decode=True, speculative=SPEC)
    assert llm.engine.runner.decode_graph is not None
    prompts = repetitive_prompts() + mixed_prompts(4)
    outputs = llm.generate(prompts, GREEDY_FEW)
    assert llm.engine.runner.decode_graph.num_steps > 0
    assert_spec_kept_some_and_rejected_some(llm)
    assert_no_rejected_token_kept(llm, outputs)
    speculator, llm.engine.scheduler.speculator = llm.engine.scheduler.speculator, None  # the same graph, without
    assert [o.token_ids for o in outputs] == [o.token_ids for o in llm.generate(prompts, GREEDY_FEW)]


def test_async_engine_streams_what_the_offline_engine_without_speculation_gives(tiny_gpt2_dir, plain):
    """Several tokens of one request in one step reach its stream in order, the last chunk
    finishing it, as the served app takes them."""
    prompts = repetitive_prompts()
    engine = AsyncEngine(EngineConfig(model=str(tiny_gpt2_dir), weights="pretrained", dtype="float32", device="cpu",
                                      linears="reference", compile_decode=False, speculative=SPEC))

    async def collect(request_id: str, prompt: list[int]) -> tuple[list[int], str | None]:
        chunks = [chunk async for chunk in engine.generate(request_id, prompt, GREEDY_FEW)]
        return [t for c in chunks for t in c.token_ids], chunks[-1].finish_reason

    async def main():
        return await asyncio.gather(*(collect(f"r{i}", p) for i, p in enumerate(prompts)))

    try:
        streamed = asyncio.run(main())
        assert engine.stats().num_spec_accepted_tokens > 0
    finally:
        engine.shutdown()
    assert streamed == [(o.token_ids, "length") for o in plain.generate(prompts, GREEDY_FEW)]
