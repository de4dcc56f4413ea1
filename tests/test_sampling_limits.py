# Each sampling field's range is stated once (engine/request/sampling_limits.py): the HTTP body and
# SamplingParams accept and refuse exactly the same values at its edges. Every range lies
# within what the sampler's tensors hold (int64, finite float32), and each body refuses the
# numbers at JSON's edges on purpose (deployments/api/errors.py lists the decisions): past
# int64, NaN and Infinity, Unicode digits as token ids, a key given twice.
from __future__ import annotations

import json
import math

import pytest
from pydantic import BaseModel, ValidationError

from deployments.api.errors import ApiError, invalid_body
from deployments.api.http_body import check_no_duplicate_keys
from deployments.api.protocol import ChatBody, CompletionBody, DetokenizeBody, GenerateBody
from engine import SamplingParams
from engine.request.sampling_limits import FLOAT32_MAX, INT64_MAX

PAST_INT64 = 2**63

EDGES = [  # (field, values both accept, values both refuse)
    ("temperature", [0, 0.0, 7.5, FLOAT32_MAX], [-0.01, math.inf, math.nan, 1e39]),
    ("top_p", [1, 1e-9], [0, 1.01]),
    ("top_k", [-1, 0, 50, INT64_MAX], [-2, PAST_INT64]),
    ("min_p", [0, 1], [-0.01, 1.01]),
    ("seed", [-(2**63), INT64_MAX], [-(2**63) - 1, PAST_INT64]),
    ("presence_penalty", [-2, 2], [-2.01, 2.01]),
    ("frequency_penalty", [-2, 2], [-2.01, 2.01]),
    ("repetition_penalty", [0.01, 5, 100], [0, 0.0099, 100.5, math.inf]),
    ("min_tokens", [0, 16], [-1, PAST_INT64]),
    ("max_tokens", [1, INT64_MAX], [-1, PAST_INT64]),
    ("logprobs", [0, 20], [-1, 21]),
]


def body_accepts(field: str, value: object) -> bool:
    try:
        CompletionBody.model_validate({"prompt": "Hi", field: value})
    except ValidationError:
        return False
    return True


def params_accept(field: str, value: object) -> bool:
    try:
        SamplingParams(**{field: value})
    except ValueError:
        return False
    return True


@pytest.mark.parametrize(("field", "accepted", "refused"), EDGES, ids=[e[0] for e in EDGES])
def test_the_http_body_and_sampling_params_agree_at_each_edge(field: str, accepted: list, refused: list) -> None:
    assert [(body_accepts(field, v), params_accept(field, v)) for v in accepted] == [(True, True)] * len(accepted)
    assert [(body_accepts(field, v), params_accept(field, v)) for v in refused] == [(False, False)] * len(refused)


@pytest.mark.parametrize("bias", [-100, 100, -100.5, 100.5])
def test_logit_bias_values_share_one_range(bias: float) -> None:
    inside = abs(bias) <= 100
    assert body_accepts("logit_bias", {"5": bias}) == inside
    assert params_accept("logit_bias", {5: bias}) == inside


# ---- numbers at JSON's edges, as the routes read them ----

CHAT = {"messages": [{"role": "user", "content": "hi"}]}


def refusal(body: type[BaseModel], raw: str | bytes) -> str | None:
    """The param a route's 400 names for this raw body, or "accepted"."""
    raw = raw.encode() if isinstance(raw, str) else raw
    try:
        parsed = body.model_validate_json(raw)
        check_no_duplicate_keys(raw)
        if hasattr(parsed, "check"):
            parsed.check()
    except ValidationError as exc:
        return invalid_body(exc.errors()).param
    except ApiError as exc:
        assert exc.status == 400
        return exc.param
    return "accepted"


def with_field(base: dict, field: str, value: str) -> str:
    """base's JSON with field set to a raw JSON literal (NaN, a 30-digit number, ...)."""
    return json.dumps({**base, field: "<value>"}).replace('"<value>"', value)


INT_FIELDS = [  # (body, the rest of a valid body, field, a JSON value holding the number at `{}`)
    *[(CompletionBody, {"prompt": "hi"}, f, "{}") for f in
      ("max_tokens", "top_k", "seed", "n", "min_tokens", "logprobs", "best_of")],
    (CompletionBody, {"max_tokens": 2}, "prompt", "[{}]"),
    (CompletionBody, {"max_tokens": 2}, "prompt", "[[1, {}]]"),
    (CompletionBody, {"prompt": "hi"}, "stop_token_ids", "[{}]"),
    *[(ChatBody, CHAT, f, "{}") for f in ("max_tokens", "max_completion_tokens", "top_k", "seed", "n", "min_tokens")],
    (ChatBody, {**CHAT, "logprobs": True}, "top_logprobs", "{}"),
    (ChatBody, CHAT, "stop_token_ids", "[{}]"),
    (GenerateBody, {"prompt": "hi"}, "max_new_tokens", "{}"),
    (GenerateBody, {"prompt": "hi"}, "top_k", "{}"),
    (DetokenizeBody, {}, "tokens", "[{}]"),
]


@pytest.mark.parametrize("number", [PAST_INT64, -PAST_INT64 - 1, 10**30, 10**4000],
                         ids=["2**63", "-2**63-1", "10**30", "10**4000"])
@pytest.mark.parametrize(("body", "base", "field", "shape"), INT_FIELDS,
                         ids=[f"{b.__name__}.{f}-{s}" for b, _, f, s in INT_FIELDS])
def test_an_integer_past_int64_is_a_400_naming_its_field(body, base: dict, field: str, shape: str,
                                                          number: int) -> None:
    assert refusal(body, with_field(base, field, shape.format(number))) == field


@pytest.mark.parametrize("field", ["top_k", "seed", "max_tokens"])
def test_a_number_too_long_for_the_parser_is_a_400(field: str) -> None:
    assert refusal(CompletionBody, with_field({"prompt": "hi"}, field, "9" * 5000)) is None  # where: in the message


FLOAT_FIELDS = [
    *[(CompletionBody, {"prompt": "hi"}, f, "{}") for f in
      ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")],
    (CompletionBody, {"prompt": "hi"}, "logit_bias", '{{"5": {}}}'),
    (ChatBody, CHAT, "temperature", "{}"),
    (ChatBody, CHAT, "logit_bias", '{{"5": {}}}'),
    (GenerateBody, {"prompt": "hi"}, "temperature", "{}"),
    (GenerateBody, {"prompt": "hi"}, "top_p", "{}"),
]


@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity", "1e400"])
@pytest.mark.parametrize(("body", "base", "field", "shape"), FLOAT_FIELDS,
                         ids=[f"{b.__name__}.{f}" for b, _, f, _ in FLOAT_FIELDS])
def test_nan_and_infinity_are_a_400_naming_the_field(body, base: dict, field: str, shape: str, literal: str) -> None:
    assert refusal(body, with_field(base, field, shape.format(literal))) == field


@pytest.mark.parametrize("literal", ["NaN", "Infinity"])
@pytest.mark.parametrize("field", ["max_tokens", "seed", "n"])
def test_nan_in_an_integer_field_is_a_400_naming_it(field: str, literal: str) -> None:
    assert refusal(CompletionBody, with_field({"prompt": "hi"}, field, literal)) == field


@pytest.mark.parametrize("key", ["\u00b2", "\u2460", "\u0667", "\uff15", "07", "-1", "+1", " 5", "5 ", "1.0", "",
                                 "99999999999999999999", "0x1f"])
@pytest.mark.parametrize("body, base", [(CompletionBody, {"prompt": "hi"}), (ChatBody, CHAT)])
def test_a_logit_bias_key_that_is_not_an_ascii_token_id_is_a_400_naming_logit_bias(body, base: dict, key: str) -> None:
    assert refusal(body, with_field(base, "logit_bias", f'{{"{key}": 1}}')) == "logit_bias"


@pytest.mark.parametrize("key", ["0", "5", "50256", "9223372036854775807"])
def test_logit_bias_keys_are_decimal_token_ids(key: str) -> None:
    assert refusal(CompletionBody, with_field({"prompt": "hi"}, "logit_bias", f'{{"{key}": 1}}')) == "accepted"


@pytest.mark.parametrize(("raw", "param"), [
    ('{"prompt": "hi", "prompt": "there"}', "prompt"),
    ('{"prompt": "hi", "max_tokens": 2, "max_tokens": 3}', "max_tokens"),
    ('{"prompt": "hi", "logit_bias": {"5": 1, "5": -1}}', "logit_bias"),
    ('{"prompt": "hi", "stream": true, "stream_options": {"include_usage": true, "include_usage": false}}',
     "stream_options"),
])
def test_a_key_given_twice_is_a_400_naming_the_field(raw: str, param: str) -> None:
    assert refusal(CompletionBody, raw) == param


def test_a_key_given_twice_inside_a_chat_message_names_messages() -> None:
    raw = '{"messages": [{"role": "user", "content": "a", "content": "b"}]}'
    assert refusal(ChatBody, raw) == "messages"


def test_n_seeds_wrap_within_int64_at_its_edge() -> None:
    body = CompletionBody.model_validate({"prompt": "hi", "seed": INT64_MAX, "n": 2})
    assert [body.choice_params(4, i).seed for i in range(2)] == [INT64_MAX, -(2**63)]
    assert [p.seed for p in SamplingParams(seed=INT64_MAX, n=2).fan_out()] == [INT64_MAX, -(2**63)]


def test_below_the_greedy_temperature_a_request_samples_greedily() -> None:
    assert SamplingParams(temperature=1e-6).is_greedy and SamplingParams(temperature=0).is_greedy
    assert not SamplingParams(temperature=1e-5).is_greedy
