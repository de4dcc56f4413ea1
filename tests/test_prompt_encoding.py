"""Prompts to checked token ids (deployments/api/encoding.py's Encoder, which the tokenizer
deployment and the ingress share), and which prompts the ingress encodes itself
(deployments/api/prompt_encoding.py). Both paths through real Serve: tests/test_observability.py."""

from __future__ import annotations

import asyncio

import pytest

from deployments.api.encoding import ChatMessage, EncodeError, EncodeRequest, Encoded, Encoder
from deployments.api.errors import ApiError
from deployments.observability.metrics import TokenizerMetrics
from deployments.api.prompt_encoding import PromptEncoding


@pytest.fixture(scope="module")
def encoder(gpt2_tokenizer) -> Encoder:
    return Encoder(gpt2_tokenizer)


def test_text_prompts_encode_as_the_tokenizer_does_with_no_special_tokens(encoder, gpt2_tokenizer):
    requests = [EncodeRequest(prompt="Hello there", max_tokens=4), EncodeRequest(prompt=" and again, \u00e9t\u00e9", max_tokens=2)]
    assert encoder.encode(requests) == [Encoded(gpt2_tokenizer.encode("Hello there"), 4),
                                        Encoded(gpt2_tokenizer.encode(" and again, \u00e9t\u00e9"), 2)]


def test_chat_messages_encode_through_the_template(encoder, gpt2_tokenizer):
    messages = [ChatMessage("system", "Be terse."), ChatMessage("user", "Hi!")]
    [result] = encoder.encode([EncodeRequest(messages=messages, max_tokens=3)])
    assert result == Encoded(gpt2_tokenizer.encode("system: Be terse.\nuser: Hi!\nassistant:"), 3)


def test_token_id_prompts_pass_through_checked(encoder):
    assert encoder.encode([EncodeRequest(prompt=[15496, 612], max_tokens=1)]) == [Encoded([15496, 612], 1)]


def test_no_max_tokens_means_the_rest_of_the_context(encoder, gpt2_tokenizer):
    [result] = encoder.encode([EncodeRequest(prompt="Hello", max_model_len=16)])
    assert result.max_tokens == 16 - len(gpt2_tokenizer.encode("Hello"))


def test_one_bad_prompt_gets_its_own_error_and_spares_the_others(encoder, gpt2_tokenizer):
    long_text = "word " * 40
    num_tokens = len(gpt2_tokenizer.encode(long_text))
    results = encoder.encode([EncodeRequest(prompt="fine", max_tokens=1),
                              EncodeRequest(prompt=long_text, max_tokens=1, max_model_len=16),
                              EncodeRequest(prompt="", max_tokens=1),
                              EncodeRequest(prompt=[50257], max_tokens=1),
                              EncodeRequest(prompt="fine", max_tokens=20, max_model_len=16)])
    assert isinstance(results[0], Encoded)
    assert results[1] == EncodeError(f"prompt is {num_tokens} tokens, the model's context is 16: no room to generate",
                                     "prompt", "context_length_exceeded")
    assert results[2].param == "prompt" and "empty" in results[2].message
    assert results[3].param == "prompt" and "[0, 50257)" in results[3].message
    assert results[4].param == "max_tokens" and results[4].code == "context_length_exceeded"


def encoding(encoder: Encoder, local_max_chars: int) -> PromptEncoding:
    # No tokenizer deployment: a prompt sent to it would fail the test.
    return PromptEncoding(None, encoder, local_max_chars, TokenizerMetrics("ingress"))  # type: ignore[arg-type]


@pytest.mark.parametrize(("requests", "local"), [
    ([EncodeRequest(prompt="x" * 64)], True),
    ([EncodeRequest(prompt="x" * 65)], False),
    ([EncodeRequest(prompt=list(range(64)))], True),
    ([EncodeRequest(prompt=list(range(65)))], False),
    # the template's text counts: "user: " + content + "\nassistant:"
    ([EncodeRequest(messages=[ChatMessage("user", "x" * 47)])], True),
    ([EncodeRequest(messages=[ChatMessage("user", "x" * 48)])], False),
    # a request's prompts count together: many short ones never hold the ingress's loop for long
    ([EncodeRequest(prompt="x" * 32), EncodeRequest(prompt="x" * 32)], True),
    ([EncodeRequest(prompt="x" * 32), EncodeRequest(prompt="x" * 33)], False),
])
def test_requests_up_to_the_bound_are_encoded_in_the_ingress(encoder, requests, local):
    assert encoding(encoder, 64).is_local(requests) is local


def test_a_bound_of_zero_sends_every_prompt_to_the_deployment(encoder):
    assert not encoding(encoder, 0).is_local([EncodeRequest(prompt="a")])
    assert not encoding(encoder, 0).is_local([EncodeRequest(prompt=[1])])


def test_a_local_encode_returns_the_ids_or_a_400_naming_the_field(encoder, gpt2_tokenizer):
    local = encoding(encoder, 1024)
    requests = [EncodeRequest(prompt="Hi there", max_tokens=2), EncodeRequest(prompt=[1, 2], max_tokens=3)]
    assert asyncio.run(local(requests)) == [Encoded(gpt2_tokenizer.encode("Hi there"), 2), Encoded([1, 2], 3)]
    with pytest.raises(ApiError) as error:
        asyncio.run(local([EncodeRequest(prompt="Hi there", max_tokens=20, max_model_len=8)]))
    assert error.value.status == 400 and error.value.body["error"]["param"] == "max_tokens"
