"""The CUDA path runs the same code as the CPU path (skipped without a GPU)."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from tests.engine_helpers import hf_greedy, hf_model, mixed_prompts

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def test_cuda_greedy_matches_hf_on_cpu_in_fp32(tiny_gpt2_dir):
    llm = LLM(str(tiny_gpt2_dir), weights="pretrained", dtype="float32", device="cuda")
    assert llm.engine.model_info.device.startswith("cuda")
    hf = hf_model(tiny_gpt2_dir)
    prompts = mixed_prompts(8)
    outputs = llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
    for prompt, out in zip(prompts, outputs):
        assert out.token_ids == hf_greedy(hf, prompt, 16)
    assert llm.engine.stats().num_kv_blocks_used == 0


def test_cuda_auto_dtype_and_seeded_sampling(tiny_gpt2_dir):
    llm = LLM(str(tiny_gpt2_dir), weights="pretrained", device="auto")
    assert llm.engine.model_info.dtype in ("bfloat16", "float16")
    params = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, seed=7, ignore_eos=True)
    alone = llm.generate([[1, 2, 3]], params)[0].token_ids
    batched = llm.generate(mixed_prompts(4) + [[1, 2, 3]], params)[-1].token_ids
    assert alone == batched
