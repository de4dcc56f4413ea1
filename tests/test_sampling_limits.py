# Each sampling field's range is stated once (engine/sampling_limits.py): the HTTP body and
# SamplingParams accept and refuse exactly the same values at its edges.
from __future__ import annotations

import math

import pytest
from pydantic import ValidationError

from deployments.protocol import CompletionBody
from engine import SamplingParams

EDGES = [  # (field, values both accept, values both refuse)
    ("temperature", [0, 0.0, 7.5], [-0.01, math.inf, math.nan]),
    ("top_p", [1, 1e-9], [0, 1.01]),
    ("top_k", [-1, 0, 50], [-2]),
    ("min_p", [0, 1], [-0.01, 1.01]),
    ("seed", [-(2**63), 2**63 - 1], [2**63]),
    ("presence_penalty", [-2, 2], [-2.01, 2.01]),
    ("frequency_penalty", [-2, 2], [-2.01, 2.01]),
    ("repetition_penalty", [0.01, 5], [0, math.inf]),
    ("min_tokens", [0, 16], [-1]),
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
