"""Sampling controls in the batched sampler, each checked against a reference written
independently of it: Hugging Face's own repetition penalty, or a plain greedy loop over
HF's logits that applies the OpenAI/vLLM definition token by token."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from engine import LLM, SamplingParams
from engine.sampling.logits_controls import LogitsControls
from engine.sampling.sampler import Sampler, SamplingBatch
from engine.request.sampling_params import select_best
from engine.core.sequence import Sequence
from tests.engine_helpers import hf_greedy, hf_model, mixed_prompts


@pytest.fixture(scope="module")
def hf_fp32(tiny_gpt2_dir):
    return hf_model(tiny_gpt2_dir)


@pytest.fixture(scope="module")
def llm(tiny_gpt2_dir) -> LLM:
    return LLM(str(tiny_gpt2_dir), weights="pretrained", dtype="float32", device="cpu", compile_decode=False)


def greedy(max_tokens: int = 12, **controls) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, **controls)


def hf_greedy_adjusted(model, prompt: list[int], max_tokens: int, adjust, stop_ids=()) -> list[int]:
    """Greedy over HF's logits after adjust(logits, output_so_far); stops after a stop id."""
    output: list[int] = []
    for _ in range(max_tokens):
        with torch.inference_mode():
            logits = model(torch.tensor([prompt + output])).logits[0, -1].float()
        output.append(int(adjust(logits.clone(), output).argmax()))  # a clone outside inference mode: writable
        if output[-1] in stop_ids:
            break
    return output


def openai_penalties(presence: float, frequency: float):
    def adjust(logits: torch.Tensor, output: list[int]) -> torch.Tensor:
        for token, count in Counter(output).items():
            logits[token] -= presence + frequency * count
        return logits
    return adjust


def biased(bias: dict[int, float]):
    def adjust(logits: torch.Tensor, output: list[int]) -> torch.Tensor:
        for token, value in bias.items():
            logits[token] += value
        return logits
    return adjust


def test_repetition_penalty_matches_hf_generate(llm, hf_fp32):
    prompts = mixed_prompts(6)
    outputs = llm.generate(prompts, greedy(repetition_penalty=1.8))
    plain = llm.generate(prompts, greedy())
    for prompt, out in zip(prompts, outputs):
        with torch.inference_mode():
            reference = hf_fp32.generate(
                torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=12, min_new_tokens=12, do_sample=False, repetition_penalty=1.8,
                eos_token_id=None, pad_token_id=0,
            )[0, len(prompt):].tolist()
        assert out.token_ids == reference
    assert [o.token_ids for o in outputs] != [o.token_ids for o in plain]


@pytest.mark.parametrize("presence, frequency", [(1.5, 0.0), (0.0, 1.2), (0.5, 0.7), (-2.0, 0.0)])
def test_presence_and_frequency_penalties_follow_their_definition(llm, hf_fp32, presence, frequency):
    prompts = mixed_prompts(4)
    outputs = llm.generate(prompts, greedy(presence_penalty=presence, frequency_penalty=frequency))
    for prompt, out in zip(prompts, outputs):
        assert out.token_ids == hf_greedy_adjusted(hf_fp32, prompt, 12, openai_penalties(presence, frequency))


def test_penalties_change_greedy_output_on_a_repetitive_model(llm, hf_fp32):
    # The tiny random model repeats itself under plain greedy; a frequency penalty breaks that.
    prompt = mixed_prompts(3)[2]
    plain = llm.generate([prompt], greedy(24))[0].token_ids
    penalised = llm.generate([prompt], greedy(24, frequency_penalty=2.0))[0].token_ids
    assert len(set(plain)) < len(plain)
    assert max(Counter(penalised).values()) < max(Counter(plain).values())


def test_logit_bias_forces_a_token_and_bans_another(llm, hf_fp32):
    prompt = mixed_prompts(4)[3]
    forced = llm.generate([prompt], SamplingParams(max_tokens=8, temperature=1.0, seed=1, ignore_eos=True,
                                                   logit_bias={31337: 100}))[0]
    assert forced.token_ids == [31337] * 8
    first = hf_greedy(hf_fp32, prompt, 1)[0]
    banned = llm.generate([prompt], greedy(8, logit_bias={first: -100}))[0].token_ids
    assert first not in banned
    bias = {first: -100, 17: 3.5, 9000: 6.0}
    out = llm.generate([prompt], greedy(8, logit_bias=bias))[0].token_ids
    assert out == hf_greedy_adjusted(hf_fp32, prompt, 8, biased(bias))


def test_min_tokens_keeps_eos_and_stop_token_ids_from_ending_early(tiny_gpt2_dir, hf_fp32):
    llm = LLM(str(tiny_gpt2_dir), weights="pretrained", dtype="float32", device="cpu", compile_decode=False)
    prompt = mixed_prompts(3)[2]
    plain = hf_greedy(hf_fp32, prompt, 12)
    eos, stop = plain[2], plain[4]
    llm.engine.eos_token_id = eos  # random weights rarely pick <|endoftext|>: declare one
    params = SamplingParams(max_tokens=12, temperature=0, min_tokens=6, stop_token_ids=[stop])

    def mask_until_min(logits, output):
        if len(output) < 6:
            logits[[eos, stop]] = float("-inf")
        return logits

    out = llm.generate([prompt], params)[0]
    expected = hf_greedy_adjusted(hf_fp32, prompt, 12, mask_until_min, stop_ids=(eos, stop))
    assert out.token_ids == expected
    assert len(out.token_ids) >= 6 and eos not in out.token_ids[:6] and stop not in out.token_ids[:6]
    assert out.finish_reason == ("stop" if out.token_ids[-1] in (eos, stop) else "length")
    # Without min_tokens the same request stops at the first of them, by the third token.
    early = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0, stop_token_ids=[stop]))[0]
    assert early.token_ids == plain[: min(plain.index(eos), plain.index(stop)) + 1] and early.finish_reason == "stop"


def test_a_batch_mixes_rows_with_and_without_controls(llm, hf_fp32):
    prompts = mixed_prompts(6)
    bias = {500: 4.0}
    params = [greedy(), greedy(repetition_penalty=1.5), greedy(logit_bias=bias), greedy(presence_penalty=1.0),
              greedy(), SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, min_p=0.1, seed=5, ignore_eos=True)]
    outputs = llm.generate(prompts, params)
    assert outputs[0].token_ids == hf_greedy(hf_fp32, prompts[0], 12)
    assert outputs[4].token_ids == hf_greedy(hf_fp32, prompts[4], 12)
    assert outputs[1].token_ids == llm.generate([prompts[1]], params[1])[0].token_ids
    assert outputs[2].token_ids == hf_greedy_adjusted(hf_fp32, prompts[2], 12, biased(bias))
    assert outputs[3].token_ids == hf_greedy_adjusted(hf_fp32, prompts[3], 12, openai_penalties(1.0, 0.0))
    assert outputs[5].token_ids == llm.generate([prompts[5]], params[5])[0].token_ids  # seeded: batch-independent


def test_penalty_counts_stay_exact_as_tokens_are_appended():
    vocab = 12
    prompt, outputs = [1, 2, 2, 3], [3, 5, 5, 5, 7, 0]
    params = SamplingParams(repetition_penalty=1.7, presence_penalty=0.4, frequency_penalty=0.3)
    seq = Sequence("s", prompt, params, block_size=16)
    plain = Sequence("p", prompt, SamplingParams(), block_size=16)
    for token in outputs[:2]:
        seq.append_token(token, None)
    LogitsControls.from_seqs([seq], vocab, torch.device("cpu"))  # counts built here...
    for token in outputs[2:]:
        seq.append_token(token, None)  # ...and kept up to date from here on
    logits = torch.randn(2, vocab, generator=torch.Generator().manual_seed(0)) * 3
    changed = LogitsControls.from_seqs([plain, seq], vocab, torch.device("cpu")).apply(logits)
    assert torch.equal(changed[0], logits[0])
    expected = []
    for token, x in enumerate(logits[1].tolist()):
        if token in prompt or token in outputs:
            x = x / 1.7 if x > 0 else x * 1.7
        expected.append(x - 0.3 * outputs.count(token) - 0.4 * (token in outputs))
    assert torch.allclose(changed[1], torch.tensor(expected), atol=1e-6)


def test_min_p_keeps_only_tokens_at_least_min_p_of_the_top_and_renormalises():
    logits = torch.tensor([2.0, 1.5, 0.2, -1.0, 1.0, -3.0])
    probs = torch.softmax(logits, dim=-1)
    kept = probs >= 0.3 * probs.max()
    expected = torch.where(kept, probs, 0.0) / probs[kept].sum()
    num = 40_000
    batch = SamplingBatch.from_params([SamplingParams(temperature=1.0, min_p=0.3)] * num, [None] * num, 6, torch.device("cpu"))
    tokens = Sampler(seed=0, device=torch.device("cpu"))(logits.repeat(num, 1), batch)
    observed = torch.bincount(tokens, minlength=6).float() / num
    assert observed[~kept].sum() == 0
    assert torch.allclose(observed, expected, atol=0.01), (observed, expected)


def test_the_sampler_leaves_raw_logits_untouched_for_logprobs():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(1))
    before = logits.clone()
    seqs = [Sequence(str(i), [1, 2], SamplingParams(temperature=0.7, top_k=5, min_p=0.2, repetition_penalty=2.0,
                                                      logit_bias={3: 9.0}), 16) for i in range(3)]
    controls = LogitsControls.from_seqs(seqs, 50, torch.device("cpu"))
    batch = SamplingBatch.from_params([s.params for s in seqs], [None] * 3, 50, torch.device("cpu"), controls)
    Sampler(seed=0, device=torch.device("cpu"))(logits, batch)
    assert torch.equal(logits, before)


def test_best_of_runs_seeded_sequences_and_keeps_the_most_likely(llm):
    params = SamplingParams(max_tokens=6, temperature=1.0, seed=11, n=2, best_of=4, ignore_eos=True)
    children = params.fan_out()
    assert [c.seed for c in children] == [11, 12, 13, 14]
    assert all(c.n == 1 and c.best_of is None and c.logprobs == 0 for c in children)
    prompt = mixed_prompts(3)[2]
    outputs = llm.generate([prompt] * 4, children)
    assert len({tuple(o.token_ids) for o in outputs}) > 1
    scores = [o.cumulative_logprob for o in outputs]
    best = select_best(scores, 2)
    assert sorted(scores, reverse=True)[:2] == [scores[i] for i in best]
    assert SamplingParams(n=3).fan_out() == [SamplingParams()] * 3
    assert SamplingParams(n=2, logprobs=None).fan_out()[0].logprobs is None  # n alone needs no ranking


def test_the_engine_runs_one_sequence_per_request(llm):
    with pytest.raises(ValueError, match="fan_out"):
        llm.generate([[1, 2]], SamplingParams(n=2))
    with pytest.raises(ValueError, match="fan_out"):
        llm.generate([[1, 2]], SamplingParams(best_of=2))


@pytest.mark.parametrize("kwargs, message", [
    ({"logit_bias": {50257: 1.0}}, "logit_bias"),
    ({"stop_token_ids": [50257]}, "stop_token_ids"),
])
def test_token_ids_beyond_the_vocabulary_are_rejected(llm, kwargs, message):
    with pytest.raises(ValueError, match=message):
        llm.generate([[1, 2]], SamplingParams(**kwargs))


@pytest.mark.parametrize("kwargs, message", [
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"presence_penalty": math.nan}, "presence_penalty"),
    ({"frequency_penalty": -2.1}, "frequency_penalty"),
    ({"frequency_penalty": "1"}, "frequency_penalty"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"repetition_penalty": math.inf}, "repetition_penalty"),
    ({"logit_bias": {"50": 1.0}}, "logit_bias"),
    ({"logit_bias": {-1: 1.0}}, "logit_bias"),
    ({"logit_bias": {5: 100.5}}, "logit_bias"),
    ({"logit_bias": {5: math.nan}}, "logit_bias"),
    ({"logit_bias": [5]}, "logit_bias"),
    ({"min_p": -0.1}, "min_p"),
    ({"min_p": 1.5}, "min_p"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"min_tokens": 17}, "min_tokens"),  # above max_tokens (16)
    ({"min_tokens": 1.5}, "min_tokens"),
    ({"n": 0}, "n must"),
    ({"n": 3, "best_of": 2}, "best_of"),
    ({"best_of": 0}, "best_of"),
])
def test_invalid_controls_are_rejected_naming_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_select_best_needs_every_cumulative_logprob():
    assert select_best([-3.0, -1.0, -2.0], 2) == [1, 2]
    with pytest.raises(ValueError, match="cumulative_logprob"):
        select_best([-1.0, None], 1)
