"""`one_thread_max_tokens` (N, or auto: 1 on CPU in bf16): steps of at most N tokens run on
one torch thread, the rest on `num_threads`, in whichever thread steps the engine; the
tokens stay the reference path's."""

from __future__ import annotations

import threading

import pytest
import torch

from engine import LLM, EngineConfig, SamplingParams
from tests.engine_helpers import mixed_prompts, record_threads

pytestmark = pytest.mark.usefixtures("restore_torch_threads")

GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


def make_llm(model_dir, **config) -> LLM:
    return LLM(str(model_dir), weights="pretrained", dtype="float32", device="cpu", linears="reference",
               num_threads=2, **config, compile_decode=False)


def test_steps_of_one_token_run_on_one_thread_and_give_the_same_tokens(tiny_gpt2_dir):
    llm = make_llm(tiny_gpt2_dir, one_thread_max_tokens=1)
    steps = record_threads(llm.engine)
    prompts = mixed_prompts(3)  # 1, 3 and 7 tokens
    ours = [o.token_ids for o in llm.generate([prompts[2]], GREEDY) + llm.generate(prompts, GREEDY)]
    expected = [o.token_ids for o in make_llm(tiny_gpt2_dir).generate([prompts[2]] + prompts, GREEDY)]
    assert ours == expected
    assert steps[0] == (7, 2)  # the prompt alone: both threads
    assert all(threads == 1 for tokens, threads in steps if tokens == 1)  # its decodes alone
    assert all(threads == 2 for tokens, threads in steps if tokens > 1)  # prompts, three decodes at once
    assert {tokens for tokens, _ in steps} >= {1, 3, 7, 11}


def test_every_step_on_num_threads_by_default(tiny_gpt2_dir):
    llm = make_llm(tiny_gpt2_dir)
    steps = record_threads(llm.engine)
    llm.generate(mixed_prompts(2), GREEDY)
    assert {threads for _, threads in steps} == {2}


def test_the_count_follows_the_thread_that_steps(tiny_gpt2_dir):
    """torch's thread count is the calling OS thread's: a step loop's thread and the caller's
    are set each for itself."""
    llm = make_llm(tiny_gpt2_dir, one_thread_max_tokens=1)
    engine = llm.engine
    steps = record_threads(engine)
    engine.add_request("a", mixed_prompts(3)[2], GREEDY)
    engine.step()  # 7 tokens here: 2 threads
    other = threading.Thread(target=engine.step)  # a decode in another thread: 1 there
    other.start()
    other.join()
    engine.step()  # a decode here: 1 here too, though this thread last ran on 2
    assert steps == [(7, 2), (1, 1), (1, 1)]
    engine.abort_request("a")


def test_auto_is_one_token_on_cpu_in_bf16_only(tiny_gpt2_dir):
    # fp32 steps move twice the bytes: there the second thread wins
    # (BENCHMARKS.md, "Designs shipped": one thread for one-token steps)
    assert EngineConfig(device="cpu", dtype="bfloat16", one_thread_max_tokens="auto").one_thread_tokens == 1
    assert EngineConfig(device="cpu", dtype="float32", one_thread_max_tokens="auto").one_thread_tokens == 0
    assert EngineConfig(device="cpu", dtype="float32", one_thread_max_tokens=2).one_thread_tokens == 2
    llm = make_llm(tiny_gpt2_dir, one_thread_max_tokens="auto")  # fp32
    steps = record_threads(llm.engine)
    llm.generate(mixed_prompts(1), GREEDY)
    assert {threads for _, threads in steps} == {2}


def test_one_thread_max_tokens_is_checked():
    for bad in (-1, "yes"):
        with pytest.raises(ValueError, match="one_thread_max_tokens must be an integer >= 0 or auto"):
            EngineConfig(one_thread_max_tokens=bad)
