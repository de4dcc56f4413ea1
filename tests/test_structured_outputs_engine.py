"""Structured outputs in the engine: greedy constrained output (fp32) is token-exact with
Hugging Face `generate` plus xgrammar's own HF logits processor on the same weights, in
batches that mix constrained and free rows, and stays so across preemption by recompute,
prefix-cache hits and chunked prefill; sampled output is valid for every kind; the
constraint ends the request ("stop"), max_tokens first ends it "length"."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch
import transformers
import xgrammar as xgr

from engine import LLM, AsyncEngine, EngineConfig, SamplingParams
from engine.request.constraint import Constraint
from engine.request.invalid_request import InvalidRequestError
from tests.engine_helpers import hf_greedy, hf_model, mixed_prompts
from tests.structured_helpers import CHOICES, CONSTRAINTS, is_valid

MAX_TOKENS = 40
EOS = 50256


@pytest.fixture(scope="module")
def hf_fp32(tiny_gpt2_dir) -> transformers.GPT2LMHeadModel:
    return hf_model(tiny_gpt2_dir)


def make_llm(model_dir, **config) -> LLM:
    return LLM(str(model_dir), weights="pretrained", dtype="float32", device="cpu", linears="reference",
               compile_decode=False, **config)


@pytest.fixture(scope="module")
def llm(tiny_gpt2_dir) -> LLM:
    return make_llm(tiny_gpt2_dir)


def hf_constrained(model: transformers.GPT2LMHeadModel, prompt: list[int], grammar: xgr.CompiledGrammar,
                   max_new_tokens: int = MAX_TOKENS) -> list[int]:
    """HF greedy under xgrammar's own logits processor: the tokens, up to and with EOS."""
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=EOS, pad_token_id=EOS,
                             logits_processor=[xgr.contrib.hf.LogitsProcessor(grammar)])
    return out[0, len(prompt):].tolist()


def greedy(kind: str, max_tokens: int = MAX_TOKENS, **fields) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, constraint=CONSTRAINTS[kind], **fields)


def assert_matches_hf(llm: LLM, hf: transformers.GPT2LMHeadModel, requests: list[tuple[list[int], str]]) -> None:
    outputs = llm.generate([p for p, _ in requests], [greedy(kind) for _, kind in requests])
    for (prompt, kind), out in zip(requests, outputs):
        expected = hf_constrained(hf, prompt, llm.engine.grammars.compile(CONSTRAINTS[kind]))
        assert out.token_ids == expected, f"{kind} on a prompt of {len(prompt)} tokens diverged"
        assert out.finish_reason == ("stop" if expected[-1] == EOS else "length")
    llm.engine.check_integrity()
    assert llm.engine.stats().num_kv_blocks_used == 0


@pytest.mark.parametrize("kind", list(CONSTRAINTS))
def test_greedy_constrained_output_is_token_exact_with_hf_and_xgrammar(llm, hf_fp32, gpt2_tokenizer, kind):
    prompts = [gpt2_tokenizer.encode(text) for text in ("Hello, my name is", "The answer:", "A list")]
    assert_matches_hf(llm, hf_fp32, [(p, kind) for p in prompts])


def test_constrained_and_free_rows_share_a_step_and_free_rows_are_untouched(llm, hf_fp32, gpt2_tokenizer):
    prompt = gpt2_tokenizer.encode("Hello, my name is")
    free = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    outputs = llm.generate([prompt] * 3, [greedy("regex"), free, greedy("choice")])
    assert outputs[1].token_ids == hf_greedy(hf_fp32, prompt, MAX_TOKENS)
    assert is_valid("regex", outputs[0].text) and is_valid("choice", outputs[2].text)


def test_the_constraint_holds_across_preemption_by_recompute(tiny_gpt2_dir, hf_fp32):
    # 8 blocks of 16 tokens for 6 requests of up to 49 + 40 tokens: sequences are preempted
    # mid-output and recomputed, their generated tokens with them.
    llm = make_llm(tiny_gpt2_dir, num_kv_blocks=8, max_num_batched_tokens=64)
    prompts = [p for p in mixed_prompts(12) if 16 < len(p) < 50][:3] + mixed_prompts(3)
    assert_matches_hf(llm, hf_fp32, [(p, kind) for p in prompts for kind in ("json_object",)] +
                      [(prompts[0], "grammar"), (prompts[1], "json_schema")])
    assert llm.engine.stats().num_preemptions > 0


def test_the_constraint_holds_on_a_prefix_cache_hit(tiny_gpt2_dir, hf_fp32):
    llm = make_llm(tiny_gpt2_dir)
    prompt = list(range(1000, 1050))  # three full blocks of 16
    assert_matches_hf(llm, hf_fp32, [(prompt, "json_schema")])
    assert_matches_hf(llm, hf_fp32, [(prompt, "json_schema"), (prompt + [7], "regex")])
    assert llm.engine.block_manager.num_prefix_hit_tokens >= 2 * 48


def test_the_constraint_holds_under_chunked_prefill(tiny_gpt2_dir, hf_fp32):
    llm = make_llm(tiny_gpt2_dir, max_num_batched_tokens=16, max_num_seqs=4)
    prompts = mixed_prompts(12)[5:9]  # 33 to 120 tokens: several chunks each, beside decodes
    assert_matches_hf(llm, hf_fp32, [(p, kind) for p, kind in zip(prompts, ["json_schema", "grammar", "regex", "choice"])])


@pytest.mark.parametrize("kind", list(CONSTRAINTS))
def test_sampled_outputs_that_end_by_themselves_are_valid(llm, gpt2_tokenizer, kind):
    prompt = gpt2_tokenizer.encode("Here it is:")
    params = [SamplingParams(max_tokens=64, temperature=1.0, seed=seed, constraint=CONSTRAINTS[kind])
              for seed in range(8)]
    outputs = llm.generate([prompt] * len(params), params)
    ended = [out for out in outputs if out.finish_reason == "stop"]
    assert all(is_valid(kind, out.text) and out.token_ids[-1] == EOS for out in ended), [o.text for o in ended]
    # Random weights may write a JSON object's keys on and on; the rest end within 64 tokens.
    assert ended or kind == "json_object"
    grammar = llm.engine.grammars.compile(CONSTRAINTS[kind])
    for out in outputs:  # the ones cut short are prefixes of valid outputs
        matcher = xgr.GrammarMatcher(grammar)
        assert all(matcher.accept_token(token) for token in out.token_ids)


def test_ignore_eos_still_ends_where_the_constraint_is_complete(llm):
    [out] = llm.generate([[1, 2, 3]], greedy("choice", ignore_eos=True))
    assert out.finish_reason == "stop" and out.text in CHOICES


def test_max_tokens_before_the_end_finishes_length(llm):
    [out] = llm.generate([[1, 2, 3]], greedy("json_object", max_tokens=3))
    assert out.finish_reason == "length" and len(out.token_ids) == 3
    assert out.text.startswith("{")


def test_logprobs_stay_the_models_raw_distribution(llm, hf_fp32):
    prompt = [464, 3280, 25]
    [out] = llm.generate([prompt], greedy("regex", logprobs=2))
    with torch.no_grad():
        raw = hf_fp32(torch.tensor([prompt + out.token_ids])).logits[0].float().log_softmax(-1)
    for position, (token, logprob) in enumerate(zip(out.token_ids, out.logprobs)):
        assert logprob.logprob == pytest.approx(raw[len(prompt) - 1 + position, token].item(), abs=1e-3)


@pytest.mark.parametrize(("constraint", "why"), [
    (Constraint("json_schema", '{"type": "objekt"}', "response_format"), "objekt"),
    (Constraint("regex", "[a-", "guided_regex"), "Unclosed"),
    (Constraint("grammar", "root ::= missing", "structured_outputs.grammar"), "missing"),
])
def test_a_constraint_that_does_not_compile_is_refused_naming_its_field(llm, constraint, why):
    with pytest.raises(InvalidRequestError) as info:
        llm.generate([[1, 2]], SamplingParams(max_tokens=4, constraint=constraint))
    assert info.value.param == constraint.param
    assert why in str(info.value) and ".cc:" not in str(info.value)
    assert llm.engine.stats().num_kv_blocks_used == 0


def test_grammars_are_compiled_once_per_text(tiny_gpt2_dir):
    llm = make_llm(tiny_gpt2_dir)
    for _ in range(3):
        llm.generate([[1, 2, 3]], greedy("choice"))
    stats = llm.engine.stats()
    assert (stats.num_constrained_requests, stats.num_grammar_compiles) == (3, 1)
    assert stats.grammar_compile_s > 0


def test_the_async_front_compiles_off_the_step_loop_and_refuses_what_does_not_compile(tiny_gpt2_dir):
    engine = AsyncEngine(EngineConfig(model=str(tiny_gpt2_dir), weights="pretrained", dtype="float32", device="cpu",
                                      compile_decode=False))
    grammars, compiled_on = engine.engine.grammars, []
    compile_ = grammars.compile
    grammars.compile = lambda constraint: compiled_on.append(threading.current_thread().name) or compile_(constraint)

    try:
        chunks = asyncio.run(_generate(engine, "ok", greedy("choice")))
        assert chunks[-1].finish_reason == "stop"
        bad = SamplingParams(max_tokens=4, constraint=Constraint("regex", "(", "guided_regex"))
        with pytest.raises(InvalidRequestError) as info:
            asyncio.run(_generate(engine, "bad", bad))
        assert info.value.param == "guided_regex"
        assert compiled_on and "step-loop" not in " ".join(compiled_on)
        assert engine.num_active_requests() == 0
    finally:
        engine.shutdown()


async def _generate(engine: AsyncEngine, request_id: str, params: SamplingParams) -> list:
    return [chunk async for chunk in engine.generate(request_id, [1, 2, 3], params)]


def test_json_strings_never_take_a_raw_control_character(llm, gpt2_tokenizer):
    # xgrammar's strings with a maxLength allow bytes below 0x20, which JSON (and json.loads) forbids.
    control = gpt2_tokenizer.convert_tokens_to_ids("\u0114")  # GPT-2's byte-level token for b"\x14"
    state = llm.engine.grammars.state(CONSTRAINTS["json_schema"])
    assert all(state.accept(token) for token in gpt2_tokenizer.encode('{"name": "ab'))
    bitmask = xgr.allocate_token_bitmask(1, 50257)
    state.matcher.fill_next_token_bitmask(bitmask, 0)
    allowed_by_xgrammar = bool(bitmask[0, control // 32] >> (control % 32) & 1)
    state.fill(bitmask, 0)
    assert allowed_by_xgrammar and not bitmask[0, control // 32] >> (control % 32) & 1
