from __future__ import annotations


import pytest

from engine.request.detokenizer import IncrementalDetokenizer, TokenVocab

MULTILINGUAL = [
    "你好，世界！这是一个测试。",
    "emoji 😀🎉👍🏽 and flags 🇫🇷🇯🇵",
    "naïve café, Ünïcødé — “quotes” … ñ",
    " ä½ å¥½😀 mixed Привет こんにちは",
]


@pytest.fixture(scope="module")
def vocab(gpt2_tokenizer) -> TokenVocab:
    return TokenVocab.from_tokenizer(gpt2_tokenizer)


def ids_of(tokenizer, text: str) -> list[int]:
    return tokenizer(text)["input_ids"]


def decode_reference(tokenizer, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


def is_utf8(data: bytes) -> bool:
    try:
        data.decode()
    except UnicodeDecodeError:
        return False
    return True


def stream(vocab: TokenVocab, ids: list[int], stop: tuple[str, ...] = (), chunk: int = 1) -> list[str]:
    detokenizer = IncrementalDetokenizer(vocab, stop)
    deltas = [detokenizer.push(ids[i : i + chunk]).text for i in range(0, len(ids), chunk)]
    return deltas + [detokenizer.finish()]


def test_vocab_maps_every_id_to_its_bytes(gpt2_tokenizer) -> None:
    vocab = TokenVocab.from_tokenizer(gpt2_tokenizer)
    assert vocab.vocab_size == 50257
    assert (vocab.token_bytes[15496], vocab.token_bytes[995], vocab.token_bytes[220]) == (b"Hello", b" world", b" ")
    assert 50256 in vocab.special_ids


@pytest.mark.parametrize("text", MULTILINGUAL)
def test_multibyte_text_one_token_at_a_time_never_emits_a_broken_character(gpt2_tokenizer, vocab, text: str) -> None:
    ids = ids_of(gpt2_tokenizer, text)
    assert any(not is_utf8(vocab.token_bytes[i]) for i in ids), "some character should span tokens"
    deltas = stream(vocab, ids)
    assert not any("\ufffd" in delta for delta in deltas)
    assert "".join(deltas) == decode_reference(gpt2_tokenizer, ids) == text


@pytest.mark.parametrize("chunk", [1, 2, 5, 1000])
@pytest.mark.parametrize("text", [*MULTILINGUAL, "Hello world", "  leading spaces\n\n\ttabs  ", "x" * 300, ""])
def test_deltas_concatenate_to_tokenizer_decode(gpt2_tokenizer, vocab, text: str, chunk: int) -> None:
    ids = ids_of(gpt2_tokenizer, text)
    assert "".join(stream(vocab, ids, chunk=chunk)) == decode_reference(gpt2_tokenizer, ids)


def test_arbitrary_ids_including_invalid_utf8_match_tokenizer_decode(gpt2_tokenizer, vocab) -> None:
    ids = list(range(0, 50257, 97))
    assert "".join(stream(vocab, ids, chunk=3)) == decode_reference(gpt2_tokenizer, ids)


def test_stop_string_spanning_several_tokens_is_not_emitted(gpt2_tokenizer, vocab) -> None:
    stop = "\n\nUser:"
    assert len(ids_of(gpt2_tokenizer, stop)) > 1
    ids = ids_of(gpt2_tokenizer, "The answer is 42.\n\nUser: and more")
    detokenizer = IncrementalDetokenizer(vocab, [stop])
    deltas = [detokenizer.push([token_id]) for token_id in ids]
    stopped_at = [d.stopped for d in deltas].index(True)
    assert stop in gpt2_tokenizer.decode(ids[: stopped_at + 1])
    assert stop not in gpt2_tokenizer.decode(ids[:stopped_at])
    assert all(d.stopped and d.text == "" for d in deltas[stopped_at + 1 :])
    assert "".join(d.text for d in deltas) + detokenizer.finish() == "The answer is 42."


def test_stop_string_in_the_first_token_emits_nothing(gpt2_tokenizer, vocab) -> None:
    detokenizer = IncrementalDetokenizer(vocab, ["Hello"])
    delta = detokenizer.push(ids_of(gpt2_tokenizer, "Hello world"))
    assert (delta.text, delta.stopped, delta.num_tokens) == ("", True, 1)
    assert detokenizer.finish() == ""


def test_stop_string_inside_a_token_keeps_the_text_before_it(gpt2_tokenizer, vocab) -> None:
    delta = IncrementalDetokenizer(vocab, ["ll"]).push(ids_of(gpt2_tokenizer, "Hello world"))
    assert (delta.text, delta.stopped) == ("He", True)


def test_num_tokens_counts_through_the_token_that_completes_the_stop(gpt2_tokenizer, vocab) -> None:
    ids = ids_of(gpt2_tokenizer, "one two three four five")
    delta = IncrementalDetokenizer(vocab, [" three"]).push(ids)
    assert (delta.text, delta.stopped) == ("one two", True)
    assert delta.num_tokens == ids.index(ids_of(gpt2_tokenizer, " three")[0]) + 1 < len(ids)


def test_pushes_after_a_stop_return_no_text(gpt2_tokenizer, vocab) -> None:
    detokenizer = IncrementalDetokenizer(vocab, ["two"])
    detokenizer.push(ids_of(gpt2_tokenizer, "one two"))
    delta = detokenizer.push(ids_of(gpt2_tokenizer, " three"))
    assert (delta.text, delta.stopped, delta.num_tokens) == ("", True, 0)


def test_earliest_of_several_stop_strings_wins(gpt2_tokenizer, vocab) -> None:
    delta = IncrementalDetokenizer(vocab, ["four", "two"]).push(ids_of(gpt2_tokenizer, "one two three four"))
    assert delta.text == "one "


def test_text_that_may_start_a_stop_is_held_back_then_flushed_by_finish(gpt2_tokenizer, vocab) -> None:
    detokenizer = IncrementalDetokenizer(vocab, ["world peace"])
    delta = detokenizer.push(ids_of(gpt2_tokenizer, "Hello world"))
    assert (delta.text, delta.stopped) == ("Hello ", False)
    assert detokenizer.finish() == "world"


def test_text_that_cannot_start_a_stop_is_emitted_at_once(gpt2_tokenizer, vocab) -> None:
    delta = IncrementalDetokenizer(vocab, ["\n\nUser:"]).push(ids_of(gpt2_tokenizer, "Hello world"))
    assert delta.text == "Hello world"


def test_special_tokens_are_skipped(gpt2_tokenizer, vocab) -> None:
    ids = [50256, *ids_of(gpt2_tokenizer, "Hi"), 50256, *ids_of(gpt2_tokenizer, " there"), 50256]
    assert "".join(stream(vocab, ids)) == "Hi there"


def test_incomplete_utf8_at_the_end_becomes_a_replacement_character(gpt2_tokenizer, vocab) -> None:
    ids = ids_of(gpt2_tokenizer, "ok 😀")[:-1]
    deltas = stream(vocab, ids)
    assert "\ufffd" not in "".join(deltas[:-1])
    assert "".join(deltas) == b"".join(vocab.token_bytes[i] for i in ids).decode(errors="replace")
    assert deltas[-1].endswith("\ufffd")
