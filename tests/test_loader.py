from __future__ import annotations

import json
import logging
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import huggingface_hub
import pytest
import torch
import transformers

from engine.model.loader import hub_is_reachable, load_state_dict, load_tokenizer, resolve_model

UNREACHABLE_HUB = "http://127.0.0.1:9"  # discard port: connection refused at once
HUB_PROBE_TIMEOUT_S = 2.0  # engine/model/loader.py's
MARKER = "<rayinfer-marker>"  # a token only the directory's own tokenizer has


@pytest.fixture
def marked_model_dir(tiny_gpt2_dir: Path, tmp_path: Path) -> Path:
    """The tiny checkpoint with a tokenizer the bundled one is not: one extra token."""
    directory = tmp_path / "marked"
    shutil.copytree(tiny_gpt2_dir, directory)
    tokenizer = load_tokenizer(str(tiny_gpt2_dir))
    tokenizer.add_tokens([MARKER])
    tokenizer.save_pretrained(directory)
    return directory


def has_marker(tokenizer) -> bool:
    return tokenizer(MARKER)["input_ids"] == [50257]


@pytest.fixture(autouse=True)
def offline_hub(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """No hub and an empty Hugging Face cache, whatever the machine running the tests has."""
    monkeypatch.setenv("HF_ENDPOINT", UNREACHABLE_HUB)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    cache = tmp_path / "hf-cache"
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    return cache


@pytest.mark.parametrize(
    ("name", "n_layer", "n_embd"),
    [("gpt2", 12, 768), ("distilgpt2", 6, 768), ("openai-community/gpt2-medium", 24, 1024), ("gpt2-xl", 48, 1600)],
)
def test_known_names_resolve_offline_to_random_weights(name: str, n_layer: int, n_embd: int) -> None:
    source = resolve_model(name, weights="random")
    assert (source.weights, source.weight_files) == ("random", ())
    assert (source.config.n_layer, source.config.n_embd, source.config.vocab_size) == (n_layer, n_embd, 50257)


@pytest.fixture
def connections(monkeypatch: pytest.MonkeyPatch) -> list[tuple[tuple[str, int], float | None]]:
    """Every TCP connection this process opens meanwhile (the hub probe's and any HTTP
    client's go through socket.create_connection), with its timeout; each still made."""
    opened: list[tuple[tuple[str, int], float | None]] = []
    create_connection = socket.create_connection

    def recording(address, timeout=None, *args, **kwargs):
        opened.append((tuple(address), timeout))
        return create_connection(address, timeout, *args, **kwargs)

    monkeypatch.setattr(socket, "create_connection", recording)
    return opened


def test_auto_falls_back_to_random_weights_with_a_warning_after_bounded_probes(
        caplog: pytest.LogCaptureFixture, connections: list) -> None:
    """It decides within seconds offline: its only connection attempts are the hub probe's, each
    with the probe's time-out, and no hub request could wait for a network time-out or retry."""
    with caplog.at_level(logging.WARNING, logger="engine.model.loader"):
        source = resolve_model("gpt2", weights="auto")
    assert set(connections) == {(("127.0.0.1", 9), HUB_PROBE_TIMEOUT_S)}  # each a bounded probe
    assert source.weights == "random"
    assert any(r.levelno == logging.WARNING and "RANDOM" in r.getMessage() for r in caplog.records)


def test_auto_on_an_unknown_hub_name_offline_fails_naming_it_after_bounded_probes(connections: list) -> None:
    with pytest.raises(ValueError, match="unknown model 'someone/not-a-model'"):
        resolve_model("someone/not-a-model", weights="auto")
    assert set(connections) == {(("127.0.0.1", 9), HUB_PROBE_TIMEOUT_S)}  # each a bounded probe


def test_pretrained_without_weights_raises_naming_the_model_and_where_it_looked(offline_hub: Path) -> None:
    with pytest.raises(FileNotFoundError, match=rf"'gpt2'.*{offline_hub}"):
        resolve_model("gpt2", weights="pretrained")


def test_a_path_that_is_no_directory_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="neither a directory"):
        resolve_model(str(tmp_path / "no" / "such" / "model"))


def test_local_dir_resolves_to_pretrained_safetensors(tiny_gpt2_dir: Path) -> None:
    source = resolve_model(str(tiny_gpt2_dir), weights="auto")
    assert source.weights == "pretrained"
    assert source.weight_files == (tiny_gpt2_dir / "model.safetensors",)
    assert source.config.n_layer == 2


def test_random_weights_from_a_local_dir_keep_its_config_and_read_no_weights(tiny_gpt2_dir: Path) -> None:
    source = resolve_model(str(tiny_gpt2_dir), weights="random")
    assert (source.weights, source.weight_files, source.config.n_embd) == ("random", (), 64)


def test_bin_checkpoint_loads_the_same_state_dict_as_safetensors(tiny_gpt2_dir: Path, tiny_gpt2_bin_dir: Path) -> None:
    bin_source = resolve_model(str(tiny_gpt2_bin_dir), weights="pretrained")
    assert bin_source.weight_files == (tiny_gpt2_bin_dir / "pytorch_model.bin",)
    from_bin = load_state_dict(bin_source.weight_files)
    from_safetensors = load_state_dict(resolve_model(str(tiny_gpt2_dir)).weight_files)
    assert from_bin.keys() == from_safetensors.keys()
    assert "transformer.wte.weight" in from_bin
    assert all(torch.equal(from_bin[k], from_safetensors[k]) for k in from_bin)


def test_hub_id_in_the_local_cache_resolves_to_its_snapshot(offline_hub: Path, marked_model_dir: Path) -> None:
    snapshot = offline_hub / "models--openai-community--gpt2" / "snapshots" / "0123abc"
    shutil.copytree(marked_model_dir, snapshot)
    (snapshot.parent.parent / "refs").mkdir()
    (snapshot.parent.parent / "refs" / "main").write_text("0123abc")
    source = resolve_model("openai-community/gpt2", weights="pretrained")
    assert source.weight_files == (snapshot / "model.safetensors",)
    assert source.config.n_layer == 2
    assert load_tokenizer("openai-community/gpt2")("Hello world")["input_ids"] == [15496, 995]
    assert has_marker(load_tokenizer("openai-community/gpt2"))  # the snapshot's tokenizer, not the bundled one


def test_non_gpt2_config_is_rejected(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    with pytest.raises(ValueError, match="'llama' is not supported"):
        resolve_model(str(tmp_path), weights="random")


def test_hub_probe_is_false_when_nothing_listens() -> None:
    assert not hub_is_reachable()


def test_hub_probe_is_true_when_the_endpoint_accepts(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.create_server(("127.0.0.1", 0)) as server:
        monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{server.getsockname()[1]}")
        assert hub_is_reachable()
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
        assert not hub_is_reachable()


def test_bundled_tokenizer_encodes_like_gpt2(gpt2_tokenizer) -> None:
    assert gpt2_tokenizer("Hello world")["input_ids"] == [15496, 995]
    assert gpt2_tokenizer(" Hello world")["input_ids"] == [18435, 995]
    assert gpt2_tokenizer.eos_token_id == gpt2_tokenizer.bos_token_id == 50256
    assert (len(gpt2_tokenizer), gpt2_tokenizer.model_max_length) == (50257, 1024)


@pytest.mark.parametrize("text", [" ä½ å¥½😀", "naïve café — 你好，世界 — こんにちは — Привет 🇫🇷🎉", "tabs\tand\nnewlines  "])
def test_bundled_tokenizer_round_trips_multilingual_text(gpt2_tokenizer, text: str) -> None:
    assert gpt2_tokenizer.decode(gpt2_tokenizer(text)["input_ids"]) == text


def test_local_dir_tokenizer_is_the_saved_one(marked_model_dir: Path, gpt2_tokenizer) -> None:
    text = "Hello world, 你好 😀"
    tokenizer = load_tokenizer(str(marked_model_dir))
    assert tokenizer(text)["input_ids"] == gpt2_tokenizer(text)["input_ids"]
    assert has_marker(tokenizer) and not has_marker(gpt2_tokenizer)


def test_a_gpt2_tokenizer_loads_by_its_class_as_auto_tokenizer_would(marked_model_dir: Path) -> None:
    text = f"Hello world, 你好 😀<|endoftext|> {MARKER} again"
    ours, auto = load_tokenizer(str(marked_model_dir)), transformers.AutoTokenizer.from_pretrained(marked_model_dir)
    assert type(ours) is type(auto)
    assert ours(text)["input_ids"] == auto(text)["input_ids"]
    assert (len(ours), ours.eos_token_id, ours.model_max_length) == (len(auto), auto.eos_token_id, auto.model_max_length)


def test_loading_a_gpt2_tokenizer_imports_no_torch(marked_model_dir: Path) -> None:
    """What lets a tokenizer replica start without torch (tests/test_serve_api.py checks the replicas)."""
    code = f"import sys; from engine.model.loader import load_tokenizer; load_tokenizer({str(marked_model_dir)!r}); " \
           "print(sorted(m for m in ('torch', 'engine.core.llm_engine') if m in sys.modules))"
    result = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[1],
                            capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"
