"""Sampling parameters: validation, seeded reproducibility, filters, stops and limits."""

from __future__ import annotations

import math
import pickle

import pytest
import torch

from engine import LLM, SamplingParams
from engine.kernels import native
from engine.request.invalid_request import InvalidRequestError
from engine.sampling.sampler import _filter_top_k_top_p, Sampler, SamplingBatch
from tests.engine_helpers import mixed_prompts


@pytest.fixture(scope="module")
def llm(tiny_gpt2_dir) -> LLM:
    return LLM(str(tiny_gpt2_dir), weights="pretrained", dtype="float32", device="cpu", compile_decode=False)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": math.nan}, "temperature"),
        ({"temperature": math.inf}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 2.5}, "max_tokens"),
        ({"stop": [""]}, "stop"),
        ({"stop": ["x"] * 17}, "stop"),
        ({"seed": "7"}, "seed"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ],
)
def test_invalid_sampling_params_are_rejected_with_a_clear_message(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_top_k_minus_one_means_disabled():
    assert SamplingParams(top_k=-1).top_k == 0


def test_seeded_sampling_is_reproducible_across_batch_compositions(llm):
    seeded = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, seed=1234, ignore_eos=True)
    prompt = mixed_prompts(3)[2]
    alone = llm.generate([prompt], seeded)[0].token_ids
    others = SamplingParams(max_tokens=16, temperature=0.8, top_k=50, ignore_eos=True)
    in_batch = llm.generate(mixed_prompts(6) + [prompt], [others] * 6 + [seeded])[-1].token_ids
    assert alone == in_batch
    other_seed = llm.generate([prompt], SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, seed=4321, ignore_eos=True))
    assert other_seed[0].token_ids != alone


def test_unseeded_sampling_varies(llm):
    params = SamplingParams(max_tokens=16, temperature=1.0, ignore_eos=True)
    first, second = llm.generate([[5, 6, 7], [5, 6, 7]], params)
    assert first.token_ids != second.token_ids


def test_top_k_one_and_tiny_top_p_are_greedy(llm):
    prompts = mixed_prompts(4)
    greedy = [o.token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))]
    top_k = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=1.5, top_k=1, ignore_eos=True))
    top_p = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=1.5, top_p=1e-6, ignore_eos=True))
    assert [o.token_ids for o in top_k] == greedy
    assert [o.token_ids for o in top_p] == greedy


def test_max_tokens_ends_with_length(llm):
    out = llm.generate("Hello", SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))[0]
    assert len(out.token_ids) == 5 and out.finish_reason == "length"


def test_stop_token_ends_with_stop_unless_ignored(llm):
    greedy = llm.generate("Hello", SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))[0].token_ids
    stop_at = greedy[3]
    out = llm.generate("Hello", SamplingParams(max_tokens=10, temperature=0, stop_token_ids=[stop_at]))[0]
    assert out.finish_reason == "stop"
    assert out.token_ids == greedy[: greedy.index(stop_at) + 1]


def test_eos_ends_with_stop_and_ignore_eos_runs_on(tiny_gpt2_dir):
    llm = LLM(str(tiny_gpt2_dir), weights="pretrained", dtype="float32", device="cpu", compile_decode=False)
    greedy = llm.generate("Hello", SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))[0].token_ids
    # Random weights rarely pick <|endoftext|>: declare the 4th greedy token the EOS instead.
    llm.engine.eos_token_id = greedy[3]
    stopped = llm.generate("Hello", SamplingParams(max_tokens=10, temperature=0))[0]
    assert stopped.finish_reason == "stop"
    assert stopped.token_ids == greedy[: greedy.index(greedy[3]) + 1]
    ignored = llm.generate("Hello", SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))[0]
    assert ignored.token_ids == greedy and ignored.finish_reason == "length"


def test_stop_string_ends_the_text_before_it(llm):
    full = llm.generate("The quick brown fox", SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))[0]
    stop = full.text[len(full.text) // 2 : len(full.text) // 2 + 3]
    out = llm.generate("The quick brown fox", SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, stop=[stop]))[0]
    assert out.finish_reason == "stop"
    assert out.text == full.text[: full.text.index(stop)]
    assert stop not in out.text
    assert out.token_ids == full.token_ids[: len(out.token_ids)]
    assert llm.engine.stats().num_kv_blocks_used == 0


def test_prompt_plus_max_tokens_beyond_context_is_rejected(llm):
    with pytest.raises(ValueError, match="context"):
        llm.generate([1] * 1000, SamplingParams(max_tokens=25))
    assert llm.generate([1] * 1000, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))[0].finish_reason == "length"


def test_request_larger_than_the_block_pool_is_rejected_at_add(tiny_gpt2_dir):
    llm = LLM(str(tiny_gpt2_dir), weights="pretrained", dtype="float32", device="cpu", num_kv_blocks=4, compile_decode=False)
    with pytest.raises(ValueError, match="KV blocks"):
        llm.engine.add_request("big", [1] * 60, SamplingParams(max_tokens=10))
    assert not llm.engine.has_unfinished_requests()


@pytest.mark.parametrize("prompt", [[], [50257], [-1]])
def test_empty_or_out_of_vocabulary_prompts_are_rejected(llm, prompt):
    with pytest.raises(ValueError, match="prompt"):
        llm.generate([prompt], SamplingParams())


def tampered(params: SamplingParams, **fields) -> SamplingParams:
    """params with fields set past construction's checks, as params unpickled from a Ray
    handle's caller or changed in place reach the engine."""
    params = pickle.loads(pickle.dumps(params))
    for name, value in fields.items():
        object.__setattr__(params, name, value)
    return params


@pytest.mark.parametrize("fields", [{"top_k": 2**63}, {"seed": 2**64}, {"temperature": math.nan},
                                    {"logit_bias": {"5": 1.0}}, {"stop_token_ids": (2**63,)},
                                    {"repetition_penalty": 1e-40}])
def test_params_past_their_limits_are_refused_at_admission_naming_the_field(llm, fields):
    bad = tampered(SamplingParams(max_tokens=4, temperature=0), **fields)
    with pytest.raises(InvalidRequestError) as refused:
        llm.generate([[1, 2, 3]], bad)
    assert refused.value.param == next(iter(fields))
    assert not llm.engine.has_unfinished_requests()
    assert llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, ignore_eos=True))[0].finish_reason == "length"


def test_params_of_another_type_are_refused_at_admission(llm):
    with pytest.raises(InvalidRequestError, match="SamplingParams"):
        llm.engine.add_request("r", [1, 2, 3], {"max_tokens": 4})
    assert not llm.engine.has_unfinished_requests()


def test_top_k_at_int64s_edge_samples_from_the_whole_vocabulary(llm):
    params = {"max_tokens": 8, "temperature": 1.0, "seed": 7, "ignore_eos": True}
    whole = llm.generate([[1, 2, 3]], SamplingParams(top_k=2**63 - 1, **params))[0].token_ids
    assert whole == llm.generate([[1, 2, 3]], SamplingParams(top_k=0, **params))[0].token_ids


def test_a_temperature_below_the_greedy_bound_samples_the_argmax(llm):
    prompts = mixed_prompts(3)
    greedy = [o.token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))]
    tiny = llm.generate(prompts, SamplingParams(max_tokens=8, temperature=1e-40, ignore_eos=True))
    assert [o.token_ids for o in tiny] == greedy


@pytest.mark.parametrize("draw", ["eager", "compiled"])
def test_a_row_of_nan_logits_still_draws_a_token_of_the_vocabulary(draw: str):
    """The limits keep NaN out of the logits; were one to get in, its row's token must not
    be one the next step cannot embed, failing every request in it."""
    logits = torch.tensor([[float("nan")] * 8, [0.0] * 8])
    batch = SamplingBatch.from_params([SamplingParams(temperature=1.0)] * 2, [None] * 2, 8, torch.device("cpu"))
    assert make_sampler(draw)(logits, batch).tolist()[0] in range(8)


# The draw's three implementations: torch ops eager; compiled, as compile_decode runs them;
# native, our C++ kernel, what the engine runs on CPU by default.
DRAWS = ["eager", "compiled", "native"]


def make_sampler(draw: str) -> Sampler:
    return Sampler(seed=0, device=torch.device("cpu"), compiled=draw == "compiled",
                   native=native.load().draw if draw == "native" else None)


def _sample_many(logits: list[float], num: int, draw: str = "eager", **params) -> torch.Tensor:
    batch = SamplingBatch.from_params([SamplingParams(**params)] * num, [None] * num, len(logits), torch.device("cpu"))
    return make_sampler(draw)(torch.tensor([logits] * num), batch)


@pytest.mark.parametrize("draw", DRAWS)
def test_sampled_tokens_follow_the_softmax_distribution(draw: str):
    logits = [2.0, 1.0, 0.0, -1.0, 0.5]
    tokens = _sample_many(logits, 40_000, draw, temperature=0.7)
    expected = torch.softmax(torch.tensor(logits) / 0.7, dim=-1)
    observed = torch.bincount(tokens, minlength=len(logits)).float() / len(tokens)
    # 4 standard deviations of a frequency over 40k draws: < 0.01 for every token.
    assert torch.allclose(observed, expected, atol=0.01), (observed, expected)


@pytest.mark.parametrize("draw", DRAWS)
def test_top_k_and_top_p_never_sample_outside_their_set(draw: str):
    logits = [3.0, 2.9, 2.8, -5.0, 0.0, 1.0]
    top_k = torch.bincount(_sample_many(logits, 5000, draw, temperature=1.0, top_k=2), minlength=6)
    assert top_k[:2].min() > 0 and top_k[2:].sum() == 0
    # softmax mass: tokens 0, 1 ~0.65, tokens 0, 1, 2 ~0.94: top_p 0.8 keeps exactly those three.
    top_p = torch.bincount(_sample_many(logits, 5000, draw, temperature=1.0, top_p=0.8), minlength=6)
    assert top_p[:3].min() > 0 and top_p[3:].sum() == 0


def test_every_draw_picks_the_eager_draws_tokens_and_greedy_rows_their_argmax():
    torch.manual_seed(0)
    logits = torch.randn(9, 50257) * 3
    params = [SamplingParams(temperature=0 if row % 3 == 0 else 0.8, seed=row) for row in range(9)]
    tokens = [make_sampler(draw)(logits, SamplingBatch.from_params(
        params, [torch.Generator().manual_seed(p.seed) for p in params], 50257, torch.device("cpu")))
        for draw in DRAWS]
    # The same uniform per row and the same CDF up to float32 summation order: the same token
    # unless a uniform falls within ~1e-6 of a boundary, which these rows' draws do not.
    assert torch.equal(tokens[0], tokens[1]) and torch.equal(tokens[0], tokens[2])
    assert torch.equal(tokens[1][::3], logits[::3].argmax(dim=-1))


def test_the_compiled_draw_compiles_once_for_one_row_and_for_many():
    sampler = Sampler(seed=0, device=torch.device("cpu"), compiled=True)
    sampler.warm_up(vocab_size=64)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    for rows in (1, 5, 2, 1):
        batch = SamplingBatch.from_params([SamplingParams(temperature=1.0)] * rows, [None] * rows, 64,
                                          torch.device("cpu"))
        assert sampler(torch.randn(rows, 64), batch).shape == (rows,)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs


@pytest.mark.parametrize("scale", [0.5, 3.0])  # flat rows reach past the candidates, peaked ones not
def test_top_k_top_p_over_candidates_keeps_what_the_full_sort_keeps(scale: float):
    torch.manual_seed(0)
    logits = torch.randn(12, 50257) * scale
    logits[0] = 0.0  # uniform: top_p 0.9 needs 45k tokens, far past the candidates
    top_ks = torch.tensor([50257, 50257, 50257, 50257, 40, 40, 2000, 2000, 50257, 1, 50257, 300])
    top_ps = torch.tensor([0.9, 0.5, 0.9, 0.999, 1.0, 0.8, 0.95, 1.0, 0.01, 1.0, 1.0, 0.7])
    kept = _filter_top_k_top_p(logits, top_ks, top_ps)
    for row, k, p, row_kept in zip(logits, top_ks, top_ps, kept.isfinite()):
        surely_kept, surely_dropped = _reference_keep(row, int(k), float(p))
        assert row_kept[surely_kept].all() and not row_kept[surely_dropped].any()
    assert torch.equal(kept[kept.isfinite()], logits[kept.isfinite()])
    assert kept[0].isfinite().sum() > 40_000 and kept[9].isfinite().sum() == 1


def _reference_keep(row: torch.Tensor, top_k: int, top_p: float,
                    rounding: float = 1e-4) -> tuple[torch.Tensor, torch.Tensor]:
    """(surely kept, surely dropped) by the definitions, in float64, one row at a time: the
    k most likely tokens, renormalised; of those, the most likely ones until the mass before
    the next token reaches top_p. Tokens whose mass before lies within `rounding` of top_p
    are in neither: float32 sums over 50257 tokens may decide them either way."""
    probs, order = torch.softmax(row.double(), dim=-1).sort(descending=True)
    probs = probs[:top_k] / probs[:top_k].sum()
    mass_before = probs.cumsum(dim=-1) - probs
    kept, dropped = torch.zeros_like(row, dtype=torch.bool), torch.ones_like(row, dtype=torch.bool)
    kept[order[: max(1, int((mass_before < top_p - rounding).sum()))]] = True
    dropped[order[: max(1, int((mass_before < top_p + rounding).sum()))]] = False
    return kept, dropped
