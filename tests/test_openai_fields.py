# Every request field of the OpenAI API as real clients send it, through the real `openai` SDK
# (raw HTTP only where the SDK cannot send the shape) against real Ray Serve serving the tiny
# fp32 checkpoint: each field works as OpenAI/vLLM define it, or is a 400 naming it. The
# docs/api.md's field table lists the same fields; logprobs are checked against transformers'
# own log-softmax of the same weights.
from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import torch
import transformers

from deployments.app import build_app
from deployments.api.protocol import ChatBody, CompletionBody, DetokenizeBody, GenerateBody
from engine import LLM, SamplingParams
from tests.http_helpers import assert_openai_error
from tests.serve_helpers import running_app, tiny_app_args
from tests.test_sampling_limits import FLOAT_FIELDS, INT_FIELDS, with_field

pytestmark = pytest.mark.serve

ENGINE_ARGS = {"num_kv_blocks": 64, "max_num_seqs": 32, "max_num_batched_tokens": 256}
PROMPTS = ["Hello, my name is", "The capital of France is"]
LOGPROB_TOLERANCE = 1e-3
NO_EOS = {"ignore_eos": True}


@pytest.fixture(scope="module")
def base_url(tiny_gpt2_dir: Path) -> Iterator[str]:
    app = build_app(tiny_app_args(tiny_gpt2_dir, engine=ENGINE_ARGS))
    with running_app(app, "rayinfer") as instance:
        yield instance.url


@pytest.fixture(scope="module")
def offline_llm(tiny_gpt2_dir: Path) -> LLM:
    return LLM(str(tiny_gpt2_dir), dtype="float32", **ENGINE_ARGS, compile_decode=False)


@pytest.fixture(scope="module")
def hf_model(tiny_gpt2_dir: Path) -> transformers.GPT2LMHeadModel:
    return transformers.GPT2LMHeadModel.from_pretrained(tiny_gpt2_dir, torch_dtype=torch.float32).eval()


def hf_logprobs(model: transformers.GPT2LMHeadModel, token_ids: list[int]) -> torch.Tensor:
    """[len(token_ids), vocab]: row i is log P(next token | token_ids[:i + 1]), in fp32."""
    with torch.no_grad():
        logits = model(torch.tensor([token_ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def complete(oai: openai.OpenAI, prompt, **fields):
    extra = {k: fields.pop(k) for k in list(fields) if k not in _SDK_COMPLETION_ARGS}
    return oai.completions.create(model="tiny", prompt=prompt, temperature=fields.pop("temperature", 0),
                                  extra_body=extra or None, **fields)


_SDK_COMPLETION_ARGS = {"max_tokens", "n", "stream", "stream_options", "logprobs", "echo", "seed", "stop",
                        "best_of", "logit_bias", "presence_penalty", "frequency_penalty", "user", "suffix",
                        "top_p", "temperature"}


def streamed_texts(stream) -> dict[int, str]:
    texts: dict[int, str] = {}
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
    return texts


def refused(call) -> openai.BadRequestError:
    with pytest.raises(openai.BadRequestError) as info:
        call()
    assert info.value.status_code == 400
    return info.value


# ---- prompts in every shape ----


def test_a_list_of_prompts_gives_n_choices_per_prompt_indexed_prompt_major(oai: openai.OpenAI) -> None:
    singles = [complete(oai, p, max_tokens=6, **NO_EOS) for p in PROMPTS]
    batch = complete(oai, PROMPTS, max_tokens=6, n=2, **NO_EOS)
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    assert [c.text for c in batch.choices] == [s.choices[0].text for s in singles for _ in range(2)]
    assert batch.usage.prompt_tokens == sum(s.usage.prompt_tokens for s in singles)
    assert batch.usage.completion_tokens == 4 * 6


def test_a_list_of_prompts_streams_every_choice_under_its_index(oai: openai.OpenAI) -> None:
    batch = complete(oai, PROMPTS, max_tokens=6, n=2, **NO_EOS)
    stream = complete(oai, PROMPTS, max_tokens=6, n=2, stream=True, stream_options={"include_usage": True},
                      **NO_EOS)
    chunks = list(stream)
    assert streamed_texts(chunks) == {c.index: c.text for c in batch.choices}
    assert chunks[-1].usage.model_dump() == batch.usage.model_dump()


def test_token_id_prompts_in_lm_evals_shape_generate_like_their_text(oai: openai.OpenAI, gpt2_tokenizer) -> None:
    ids = [gpt2_tokenizer.encode(p) for p in PROMPTS]
    by_text = complete(oai, PROMPTS, max_tokens=5)
    assert [c.text for c in complete(oai, ids, max_tokens=5).choices] == [c.text for c in by_text.choices]
    assert complete(oai, [ids[1]], max_tokens=5).choices[0].text == by_text.choices[1].text  # one prompt, listed


@pytest.mark.parametrize("prompt", [[], [""], ["ok", ""], [[]], [[1, 2], []], ["text", [1, 2]], [[1, "2"]],
                                    [[50257]]])
def test_a_malformed_prompt_list_is_a_400_naming_prompt(http: httpx.Client, prompt) -> None:
    response = http.post("/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 2})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "prompt"


# ---- chat content ----


@pytest.mark.parametrize("stream", [False, True])
def test_chat_content_as_text_parts_is_the_parts_joined_by_newlines(oai: openai.OpenAI, stream: bool) -> None:
    def chat(content) -> tuple[str, int]:
        response = oai.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": content}], max_tokens=5, temperature=0,
            stream=stream, stream_options={"include_usage": True} if stream else None, extra_body=NO_EOS)
        if not stream:
            return response.choices[0].message.content, response.usage.prompt_tokens
        chunks = list(response)
        return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices), chunks[-1].usage.prompt_tokens

    parts = [{"type": "text", "text": "Hi there"}, {"type": "text", "text": "how are you?"}]
    assert chat(parts) == chat("Hi there\nhow are you?")


@pytest.mark.parametrize("content", [
    [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}],
    [{"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}],
    [{"type": "text"}],
    [{"text": "no type"}],
    42,
])
def test_chat_content_other_than_text_is_a_400_naming_messages(http: httpx.Client, content) -> None:
    body = {"model": "tiny", "messages": [{"role": "user", "content": content}], "max_tokens": 2}
    response = http.post("/v1/chat/completions", json=body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "messages"


# ---- logprobs and echo ----


def hf_greedy(model: transformers.GPT2LMHeadModel, prompt_ids: list[int], max_tokens: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                             do_sample=False, pad_token_id=0)
    return out[0, len(prompt_ids):].tolist()


def test_completion_logprobs_match_transformers_log_softmax(oai: openai.OpenAI, hf_model, gpt2_tokenizer) -> None:
    prompt_ids = gpt2_tokenizer.encode(PROMPTS[0])
    lp = complete(oai, PROMPTS[0], max_tokens=6, logprobs=3, **NO_EOS).choices[0].logprobs
    output_ids = hf_greedy(hf_model, prompt_ids, 6)
    rows = hf_logprobs(hf_model, prompt_ids + output_ids[:-1])[len(prompt_ids) - 1:]
    assert lp.tokens == [gpt2_tokenizer.decode([t]) for t in output_ids]
    for i, token_id in enumerate(output_ids):
        assert abs(lp.token_logprobs[i] - rows[i, token_id].item()) < LOGPROB_TOLERANCE
        top3 = rows[i].topk(3).indices.tolist()
        assert list(lp.top_logprobs[i]) == [gpt2_tokenizer.decode([t]) for t in top3]  # greedy: in the top 3
        assert all(abs(lp.top_logprobs[i][gpt2_tokenizer.decode([t])] - rows[i, t].item()) < LOGPROB_TOLERANCE
                   for t in top3)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(6)]


def test_echo_returns_prompt_logprobs_in_lm_evals_loglikelihood_shape(oai: openai.OpenAI, hf_model,
                                                                       gpt2_tokenizer) -> None:
    """lm-eval's loglikelihood request: token-id prompts, echo, logprobs 1, max_tokens 1."""
    ids = [gpt2_tokenizer.encode(p) for p in PROMPTS]
    response = complete(oai, ids, max_tokens=1, logprobs=1, echo=True, seed=1234)
    for prompt_ids, choice in zip(ids, response.choices):
        lp = choice.logprobs
        assert choice.text.startswith(gpt2_tokenizer.decode(prompt_ids))
        assert len(lp.token_logprobs) == len(prompt_ids) + 1
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        reference = hf_logprobs(hf_model, prompt_ids)
        for i in range(1, len(prompt_ids)):
            assert abs(lp.token_logprobs[i] - reference[i - 1, prompt_ids[i]].item()) < LOGPROB_TOLERANCE
            best = reference[i - 1].argmax().item()
            assert gpt2_tokenizer.decode([best]) in lp.top_logprobs[i]  # lm-eval's is_greedy reads this
            assert 1 <= len(lp.top_logprobs[i]) <= 2  # the top one, plus the prompt's own token


def test_echo_with_max_tokens_0_returns_only_the_prompt(oai: openai.OpenAI, gpt2_tokenizer) -> None:
    choice = complete(oai, PROMPTS[1], max_tokens=0, echo=True, logprobs=0).choices[0]
    assert choice.text == PROMPTS[1]
    assert len(choice.logprobs.tokens) == len(gpt2_tokenizer.encode(PROMPTS[1]))
    assert choice.finish_reason == "length"


def test_prompt_logprobs_survive_a_prefix_cache_hit(oai: openai.OpenAI) -> None:
    prompt = "A prompt long enough to fill more than one sixteen-token KV block, so the second call hits " \
             "the prefix cache for its first block at least"
    first = complete(oai, prompt, max_tokens=1, logprobs=1, echo=True).choices[0].logprobs
    second = complete(oai, prompt, max_tokens=1, logprobs=1, echo=True).choices[0].logprobs
    assert second.token_logprobs[1:] == pytest.approx(first.token_logprobs[1:], abs=LOGPROB_TOLERANCE)
    assert None not in second.token_logprobs[1:]


def test_streamed_logprobs_concatenate_to_the_non_stream_ones(oai: openai.OpenAI) -> None:
    whole = complete(oai, PROMPTS[0], max_tokens=6, logprobs=2, echo=True, **NO_EOS).choices[0].logprobs
    tokens, offsets, values = [], [], []
    for chunk in complete(oai, PROMPTS[0], max_tokens=6, logprobs=2, echo=True, stream=True, **NO_EOS):
        lp = chunk.choices[0].logprobs
        if lp is not None:
            tokens += lp.tokens
            offsets += lp.text_offset
            values += lp.token_logprobs
    assert tokens == whole.tokens and offsets == whole.text_offset
    assert values[0] is None and values[1:] == pytest.approx(whole.token_logprobs[1:], abs=LOGPROB_TOLERANCE)


@pytest.mark.parametrize("stream", [False, True])
def test_chat_logprobs_have_token_logprob_bytes_and_top_logprobs(oai: openai.OpenAI, stream: bool) -> None:
    response = oai.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}],
                                           max_tokens=4, temperature=0, logprobs=True, top_logprobs=2,
                                           stream=stream, extra_body=NO_EOS)
    if stream:
        content = [entry for chunk in response for entry in (chunk.choices[0].logprobs.content or [])
                   if chunk.choices and chunk.choices[0].logprobs]
    else:
        content = response.choices[0].logprobs.content
    assert len(content) == 4
    for entry in content:
        assert entry.logprob <= 0 and bytes(entry.bytes).decode("utf-8", "replace") == entry.token
        assert len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].token == entry.token  # greedy: the sampled token is the best
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob


def test_chat_top_logprobs_without_logprobs_is_a_400(oai: openai.OpenAI) -> None:
    error = refused(lambda: oai.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}],
                                                        max_tokens=2, top_logprobs=2))
    assert error.param == "top_logprobs"


def test_max_tokens_0_without_echo_is_a_400(oai: openai.OpenAI) -> None:
    assert refused(lambda: complete(oai, PROMPTS[0], max_tokens=0)).param == "max_tokens"


# ---- sampling controls, wired to the engine ----


def greedy_ids(oai: openai.OpenAI, gpt2_tokenizer, prompt: str, max_tokens: int, **fields) -> list[int]:
    text = complete(oai, prompt, max_tokens=max_tokens, **NO_EOS, **fields).choices[0].text
    return gpt2_tokenizer.encode(text)


def test_logit_bias_forces_and_bans_tokens(oai: openai.OpenAI, gpt2_tokenizer) -> None:
    forced = gpt2_tokenizer.encode(" banana")[0]
    assert greedy_ids(oai, gpt2_tokenizer, PROMPTS[0], 4, logit_bias={str(forced): 100}) == [forced] * 4
    first = greedy_ids(oai, gpt2_tokenizer, PROMPTS[0], 1)[0]
    assert greedy_ids(oai, gpt2_tokenizer, PROMPTS[0], 1, logit_bias={str(first): -100})[0] != first


@pytest.mark.parametrize("fields", [
    {"presence_penalty": 2.0}, {"frequency_penalty": -1.5}, {"repetition_penalty": 1.8}, {"min_p": 0.05},
    {"logit_bias": {"262": 3.5, "13": -2}}, {"presence_penalty": 1.0, "frequency_penalty": 0.5, "min_tokens": 3},
])
@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 1.0, "seed": 11}])
def test_sampling_controls_reach_the_engine_as_the_offline_llm_takes_them(
        oai: openai.OpenAI, tiny_gpt2_dir: Path, offline_llm, fields: dict, sampling: dict) -> None:
    """The engine's own tests check what each control does; here: the HTTP fields arrive intact."""
    served = complete(oai, PROMPTS[0], max_tokens=10, **NO_EOS, **sampling, **fields).choices[0].text
    bias = {int(k): v for k, v in fields.get("logit_bias", {}).items()} or None
    params = SamplingParams(max_tokens=10, ignore_eos=True, **sampling, **(fields | {"logit_bias": bias}))
    assert served == offline_llm.generate([PROMPTS[0]], params)[0].text


def test_min_p_1_keeps_only_the_most_likely_token(oai: openai.OpenAI) -> None:
    greedy = complete(oai, PROMPTS[1], max_tokens=8, **NO_EOS).choices[0].text
    sampled = complete(oai, PROMPTS[1], max_tokens=8, temperature=1.5, seed=7, min_p=1.0, **NO_EOS)
    assert sampled.choices[0].text == greedy


def test_stop_token_ids_end_the_choice_and_min_tokens_holds_them_off(oai: openai.OpenAI, hf_model,
                                                                     gpt2_tokenizer) -> None:
    ids = hf_greedy(hf_model, gpt2_tokenizer.encode(PROMPTS[0]), 8)
    stop = ids[2]
    stopped = complete(oai, PROMPTS[0], max_tokens=8, stop_token_ids=[stop], **NO_EOS)
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.usage.completion_tokens == ids.index(stop) + 1  # the stop token is generated, then ends it
    held = complete(oai, PROMPTS[0], max_tokens=8, stop_token_ids=[stop], min_tokens=8, **NO_EOS)
    assert held.usage.completion_tokens == 8


def test_include_stop_str_in_output_keeps_the_stop_string(oai: openai.OpenAI) -> None:
    text = complete(oai, PROMPTS[1], max_tokens=10, **NO_EOS).choices[0].text
    stop = text[3:6]
    without = complete(oai, PROMPTS[1], max_tokens=10, stop=[stop], **NO_EOS).choices[0]
    with_stop = complete(oai, PROMPTS[1], max_tokens=10, stop=[stop], include_stop_str_in_output=True,
                         **NO_EOS).choices[0]
    assert without.text == text[:text.index(stop)]
    assert with_stop.text == without.text + stop
    assert with_stop.finish_reason == "stop"


def test_best_of_equal_to_n_is_plain_sampling(oai: openai.OpenAI) -> None:
    plain = complete(oai, PROMPTS[0], max_tokens=5, n=2, temperature=1.0, seed=3, **NO_EOS)
    best = complete(oai, PROMPTS[0], max_tokens=5, n=2, best_of=2, temperature=1.0, seed=3, **NO_EOS)
    assert [c.text for c in best.choices] == [c.text for c in plain.choices]


def test_best_of_below_n_is_a_400(oai: openai.OpenAI) -> None:
    assert refused(lambda: complete(oai, PROMPTS[0], max_tokens=2, n=3, best_of=2)).param == "best_of"


def test_best_of_with_stream_is_a_400(oai: openai.OpenAI) -> None:
    assert refused(lambda: complete(oai, PROMPTS[0], max_tokens=2, n=1, best_of=2, stream=True)).param == "best_of"


@pytest.mark.parametrize(("path", "fields", "param"), [
    ("/v1/completions", {"max_tokens": 4, "min_tokens": 5}, "min_tokens"),
    ("/v1/chat/completions", {"max_tokens": 4, "min_tokens": 5}, "min_tokens"),
])
def test_rules_across_fields_that_the_engine_checks_are_a_400_naming_the_field(http: httpx.Client, path: str,
                                                                              fields: dict, param: str) -> None:
    prompt = {"prompt": "Hi"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "Hi"}]}
    response = http.post(path, json={"model": "tiny", **prompt, **fields})
    assert response.status_code == 400, response.text
    assert (response.json()["error"]["type"], response.json()["error"]["param"]) == ("invalid_request_error", param)


def test_the_last_seed_with_n_choices_is_served_their_seeds_wrapping_within_int64(http: httpx.Client) -> None:
    body = {"model": "tiny", "prompt": "Hi", "max_tokens": 2, "n": 2, "seed": 2**63 - 1, "temperature": 1}
    response = http.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    assert len(response.json()["choices"]) == 2


# ---- numbers at JSON's edges (the decisions: deployments/api/errors.py) ----

ROUTES = {CompletionBody: "/v1/completions", ChatBody: "/v1/chat/completions", GenerateBody: "/generate",
          DetokenizeBody: "/detokenize"}


def post_raw(http: httpx.Client, path: str, raw: str) -> httpx.Response:
    return http.post(path, content=raw.encode(), headers={"content-type": "application/json"})


def test_top_k_past_int64_is_a_400_naming_top_k_and_the_engine_serves_on(http: httpx.Client) -> None:
    body = {"model": "tiny", "prompt": "Hello there", "max_tokens": 5, "top_k": 9223372036854775808}
    assert_openai_error(http.post("/v1/completions", json=body), 400, "invalid_request_error", "top_k")
    body["top_k"] = 2**63 - 1  # the edge itself: the whole vocabulary
    assert http.post("/v1/completions", json=body).status_code == 200
    assert http.get("/health").status_code == 200


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/completions", {"model": "tiny", "prompt": "Hello there", "max_tokens": 5, "logit_bias": {"\u00b2": 1}}),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5,
                              "logit_bias": {"\u2460": 1}}),
])
def test_a_unicode_digit_as_a_logit_bias_key_is_a_400_naming_logit_bias(http: httpx.Client, path: str,
                                                                         body: dict) -> None:
    assert_openai_error(http.post(path, json=body), 400, "invalid_request_error", "logit_bias")


EDGE_VALUES = [  # (body, the rest of a valid body, field, its raw JSON value)
    *[(b, base, f, shape.format(n)) for b, base, f, shape in INT_FIELDS for n in (2**63, -(2**63) - 1)],
    *[(b, base, f, shape.format(v)) for b, base, f, shape in FLOAT_FIELDS for v in ("NaN", "Infinity", "-Infinity")],
]


@pytest.mark.parametrize(("body", "base", "field", "value"), EDGE_VALUES,
                         ids=[f"{b.__name__}.{f}={v}" for b, _, f, v in EDGE_VALUES])
def test_past_int64_nan_and_infinity_in_any_numeric_field_are_a_400_naming_it(
        http: httpx.Client, body, base: dict, field: str, value: str) -> None:
    response = post_raw(http, ROUTES[body], with_field(base, field, value))
    assert_openai_error(response, 400, "invalid_request_error", field)


def test_a_key_given_twice_is_a_400_naming_it(http: httpx.Client) -> None:
    raw = '{"model": "tiny", "prompt": "Hi", "max_tokens": 2, "max_tokens": 900}'
    assert_openai_error(post_raw(http, "/v1/completions", raw), 400, "invalid_request_error", "max_tokens")


# ---- usage ----


def test_continuous_usage_stats_puts_running_usage_on_every_chunk(oai: openai.OpenAI) -> None:
    chunks = list(complete(oai, PROMPTS[0], max_tokens=5, stream=True, **NO_EOS,
                           stream_options={"include_usage": True, "continuous_usage_stats": True}))
    *token_chunks, final = chunks
    counts = [c.usage.completion_tokens for c in token_chunks]
    assert counts == sorted(counts) and counts[-1] == 5
    assert all(c.usage.prompt_tokens == final.usage.prompt_tokens for c in token_chunks)
    assert final.choices == [] and final.usage.completion_tokens == 5


def test_chat_stream_usage_in_guidellms_shape(oai: openai.OpenAI) -> None:
    stream = oai.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": [{"type": "text", "text": "Hi"}]}], max_tokens=4,
        temperature=0, stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True},
        extra_body=NO_EOS)
    chunks = list(stream)
    assert all(c.usage is not None for c in chunks)
    assert chunks[-1].usage.completion_tokens == 4


# ---- fields that are accepted as no-ops, refused, or unknown ----


@pytest.mark.parametrize(("path", "fields"), [
    ("/v1/completions", {"user": "user-1234"}),
    ("/v1/completions", {"suffix": None, "best_of": 1, "echo": False, "logprobs": None}),
    ("/v1/completions", {"add_special_tokens": True, "skip_special_tokens": True}),
    ("/v1/chat/completions", {"user": "user-1234", "store": False, "metadata": None}),
    ("/v1/chat/completions", {"response_format": {"type": "text"}, "tools": None, "tool_choice": "none"}),
    ("/v1/chat/completions", {"tools": [], "parallel_tool_calls": True, "logprobs": False}),
    ("/v1/completions", {"priority": -100}),  # when it runs, not what it says
    ("/v1/chat/completions", {"priority": 100}),
])
def test_fields_without_effect_on_the_output_are_accepted(http: httpx.Client, path: str, fields: dict) -> None:
    body = {"model": "tiny", "max_tokens": 4, "temperature": 0, **NO_EOS}
    body |= {"prompt": PROMPTS[0]} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "Hi"}]}
    plain = http.post(path, json=body)
    with_fields = http.post(path, json=body | fields)
    assert with_fields.status_code == 200, with_fields.text
    pick = (lambda r: r.json()["choices"][0].get("text") or r.json()["choices"][0]["message"]["content"])
    assert pick(with_fields) == pick(plain)


COMPLETION_REFUSALS = [
    ("suffix", " and so on"),
    ("use_beam_search", True),
    ("length_penalty", 0.5),
    ("truncate_prompt_tokens", 4),
    ("allowed_token_ids", [1, 2]),
    ("bad_words", ["cat"]),
    ("prompt_logprobs", 1),
    ("return_tokens_as_token_ids", True),
    ("skip_special_tokens", False),
    ("priority", 101),  # outside the engine's priority_range
    ("priority", -101),
    ("priority", 1.5),
    ("logprobs", 21),
    ("logprobs", -1),
]
CHAT_REFUSALS = [
    ("tools", [{"type": "function", "function": {"name": "f", "parameters": {}}}]),
    ("tool_choice", "required"),
    ("functions", [{"name": "f", "parameters": {}}]),
    ("function_call", "auto"),
    ("echo", True),
    ("add_generation_prompt", False),
    ("continue_final_message", True),
    ("chat_template", "{{ messages }}"),
    ("chat_template_kwargs", {"x": 1}),
    ("store", True),
    ("audio", {"voice": "alloy", "format": "wav"}),
    ("modalities", ["text", "audio"]),
    ("prediction", {"type": "content", "content": "x"}),
    ("reasoning_effort", "low"),
    ("web_search_options", {}),
    ("top_logprobs", 21),
]


@pytest.mark.parametrize(("field", "value"), COMPLETION_REFUSALS)
def test_completion_fields_we_cannot_honour_are_a_400_naming_them(http: httpx.Client, field: str, value) -> None:
    response = http.post("/v1/completions", json={"model": "tiny", "prompt": "Hi", "max_tokens": 2, field: value})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == field


@pytest.mark.parametrize(("field", "value"), CHAT_REFUSALS)
def test_chat_fields_we_cannot_honour_are_a_400_naming_them(http: httpx.Client, field: str, value) -> None:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "logprobs": True,
            field: value}
    response = http.post("/v1/chat/completions", json=body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == field


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_an_unknown_field_is_a_400_naming_it(oai: openai.OpenAI, path: str) -> None:
    if path == "/v1/completions":
        call = lambda: complete(oai, "Hi", max_tokens=2, temprature=0.5)  # noqa: E731 - a typo, as users make
    else:
        call = lambda: oai.chat.completions.create(  # noqa: E731
            model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=2, extra_body={"temprature": 0.5})
    error = refused(call)
    assert error.param == "temprature"
    assert "temprature" in error.message


def test_an_unknown_stream_options_field_is_a_400(http: httpx.Client) -> None:
    body = {"model": "tiny", "prompt": "Hi", "max_tokens": 2, "stream": True, "stream_options": {"usage": True}}
    response = http.post("/v1/completions", json=body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "stream_options"


def test_stream_options_without_stream_is_a_400(http: httpx.Client) -> None:
    body = {"model": "tiny", "prompt": "Hi", "max_tokens": 2, "stream_options": {"include_usage": True}}
    response = http.post("/v1/completions", json=body)
    assert response.status_code == 400, response.text
    assert json.loads(response.text)["error"]["param"] == "stream_options"


def test_lm_evals_generate_until_request_shape(http: httpx.Client, gpt2_tokenizer, offline_llm) -> None:
    """local-completions' generate_until payload, byte for byte as lm-eval 0.4 builds it."""
    ids = [gpt2_tokenizer.encode(p) for p in PROMPTS]
    body = {"prompt": ids, "model": "tiny", "max_tokens": 12, "temperature": 0,
            "stop": ["\n\n", "<|endoftext|>"], "seed": 1234}
    response = http.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    texts = {c["index"]: c["text"] for c in response.json()["choices"]}  # lm-eval reads them by index
    expected = offline_llm.generate(ids, SamplingParams(max_tokens=12, temperature=0, stop=["\n\n", "<|endoftext|>"]))
    assert [texts[0], texts[1]] == [e.text for e in expected]
