"""The sampler's C++ draw (engine/kernels/csrc/sampling.cpp): each row's argmax as torch.argmax
gives it, and the token torch's inverse-CDF draw picks at the same uniform, on vocabularies
that end inside a vector and inside a chunk, from float32 logits and from the model's bf16
or fp16 ones as from their float32 copy; never a token without mass; chosen by the engine's
`sampler` option, with torch's draw where the kernel cannot build."""

from __future__ import annotations

import logging

import pytest
import torch

from engine import LLM, EngineConfig, SamplingParams
from engine.kernels import native
from engine.sampling.sampler import draw as torch_draw


@pytest.fixture(scope="module")
def kernel():
    return native.load().draw


@pytest.mark.parametrize("vocab", [1, 5, 17, 255, 256, 257, 1000, 50257])
def test_the_kernel_draws_what_torch_draws(kernel, vocab: int):
    generator = torch.Generator().manual_seed(vocab)
    logits = torch.randn(24, vocab, generator=generator) * 3
    temperatures = torch.rand(24, generator=generator) + 0.2
    uniforms = torch.rand(24, 1, generator=generator)
    argmax, drawn = kernel(logits, temperatures, uniforms)
    expected_argmax, expected = torch_draw(logits, temperatures, uniforms)
    assert argmax.dtype == drawn.dtype == torch.int64
    assert torch.equal(argmax, expected_argmax)
    # The same CDF up to float32 summation order: equal unless a uniform lands within ~1e-6
    # of a boundary, which these seeded rows' do not.
    assert torch.equal(drawn, expected)


def test_argmax_takes_the_first_of_equal_maxima(kernel):
    logits = torch.zeros(3, 300)
    logits[0, [7, 40, 299]] = 5.0  # in different lanes and vectors
    logits[1, [33, 17]] = 5.0  # the later vector's lane is the earlier position
    logits[2] = float("-inf")  # no mass at all: torch says position 0
    argmax, _ = kernel(logits, torch.ones(3), torch.full((3, 1), 0.5))
    assert argmax.tolist() == [7, 17, 0] == logits.argmax(dim=-1).tolist()


def test_filtered_tokens_are_never_drawn_even_at_the_ends_of_the_uniforms(kernel):
    logits = torch.full((4, 700), float("-inf"))
    kept = [3, 256, 511, 690]  # top-k / top-p leave -inf everywhere else
    logits[:, kept] = torch.tensor([0.5, 1.0, -1.0, 2.0])
    uniforms = torch.tensor([[0.0], [1.0 - 2**-24], [0.5], [0.999]])
    _, drawn = kernel(logits, torch.ones(4), uniforms)
    assert drawn[0] == 3 and drawn[1] == 690  # the first and the last token with mass
    assert all(token in kept for token in drawn.tolist())
    assert torch.equal(drawn, torch_draw(logits, torch.ones(4), uniforms)[1])


def test_a_near_zero_temperature_draws_the_argmax(kernel):
    logits = torch.randn(8, 5000, generator=torch.Generator().manual_seed(0))
    argmax, drawn = kernel(logits, torch.full((8,), 1e-6), torch.rand(8, 1))
    assert torch.equal(drawn, argmax)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("vocab", [7, 50257])
def test_the_kernel_reads_reduced_precision_logits_as_their_float32_copy(kernel, dtype: torch.dtype, vocab: int):
    """The decode graph hands its logits over in the model's dtype: the same tokens as from
    the float32 copy, which a row ending inside a vector exercises too."""
    generator = torch.Generator().manual_seed(vocab)
    logits = (torch.randn(12, vocab, generator=generator) * 3).to(dtype)
    temperatures, uniforms = torch.rand(12, generator=generator) + 0.2, torch.rand(12, 1, generator=generator)
    argmax, drawn = kernel(logits, temperatures, uniforms)
    expected_argmax, expected = kernel(logits.float(), temperatures, uniforms)
    assert torch.equal(argmax, expected_argmax) and torch.equal(drawn, expected)
    assert torch.equal(torch.ops.rayinfer.argmax(logits), logits.float().argmax(dim=-1))


def test_argmax_alone_is_torchs(kernel):
    logits = torch.randn(9, 1000, generator=torch.Generator().manual_seed(3))
    logits[4, [10, 900]] = 50.0  # equal maxima: the first
    assert torch.equal(torch.ops.rayinfer.argmax(logits), logits.argmax(dim=-1))
    with pytest.raises(RuntimeError, match="float32, bf16 or fp16"):
        torch.ops.rayinfer.argmax(torch.zeros(2, 10, dtype=torch.float64))


def test_the_kernel_rejects_what_it_cannot_run(kernel):
    with pytest.raises(RuntimeError, match="float32, bf16 or fp16"):
        kernel(torch.zeros(2, 10, dtype=torch.float64), torch.ones(2), torch.zeros(2, 1))
    with pytest.raises(RuntimeError, match="contiguous rows"):
        kernel(torch.zeros(10, 2).t(), torch.ones(2), torch.zeros(2, 1))
    with pytest.raises(RuntimeError, match="one temperature and one uniform per row"):
        kernel(torch.zeros(2, 10), torch.ones(3), torch.zeros(2, 1))


def test_an_engine_samples_with_the_kernel_by_default_on_cpu(tiny_gpt2_dir):
    llm = LLM(str(tiny_gpt2_dir), weights="pretrained", dtype="float32", device="cpu", compile_decode=False)
    assert llm.engine.runner.sampler.native is torch.ops.rayinfer.draw
    torch_ops = LLM(str(tiny_gpt2_dir), weights="pretrained", dtype="float32", device="cpu", sampler="torch", compile_decode=False)
    assert torch_ops.engine.runner.sampler.native is None
    # A seeded request draws the same tokens through either: one uniform per row, one CDF.
    params = SamplingParams(max_tokens=12, temperature=0.9, seed=7, ignore_eos=True)
    assert llm.generate(["Hello there"], params)[0].token_ids == torch_ops.generate(["Hello there"], params)[0].token_ids


def test_a_kernel_that_cannot_build_leaves_the_draw_on_torch(tiny_gpt2_dir, monkeypatch, caplog):
    def no_ninja():
        raise RuntimeError("Ninja is required to load C++ extensions")  # the fault: what torch raises

    monkeypatch.setattr(native, "load", no_ninja)
    with caplog.at_level(logging.INFO):
        llm = LLM(str(tiny_gpt2_dir), weights="pretrained", dtype="float32", device="cpu", compile_decode=False)
    assert llm.engine.runner.sampler.native is None
    assert "sampler: our C++ kernel is not available; the draw runs on torch ops" in caplog.text
    assert len(llm.generate(["Hi"], SamplingParams(max_tokens=4, temperature=1.0, ignore_eos=True))[0].token_ids) == 4
    with pytest.raises(ValueError, match=r"sampler: native: the C\+\+ kernel did not build here"):
        LLM(str(tiny_gpt2_dir), weights="pretrained", dtype="float32", device="cpu", sampler="native", compile_decode=False)


def test_an_unknown_sampler_is_rejected():
    with pytest.raises(ValueError, match="sampler must be auto, native or torch"):
        EngineConfig(sampler="cuda")
