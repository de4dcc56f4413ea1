"""A request that fails inside a step (its constraint cannot fill its mask, or refuses the
token drawn) fails alone: it ends with finish_reason "error" and its blocks are freed, its
stream raises RequestFailedError, and the step's other requests and the engine go on. The
fault is injected by giving one sequence a grammar state that breaks; everything else is
the real engine on the tiny checkpoint."""

from __future__ import annotations

import asyncio

import pytest
import torch

from engine import AsyncEngine, EngineConfig, LLMEngine, SamplingParams
from engine.request.outputs import RequestFailedError, StepOutput

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
PROMPTS = {"first": [1, 2, 3], "broken": [4, 5, 6, 7], "last": [8, 9]}


class BrokenGrammar:
    """A grammar state that fails as a broken constraint would: where `fails_in` is "fill" its
    mask cannot be filled; where "accept", it refuses the token drawn. Its error's message
    stands for request content, which no log may hold."""

    def __init__(self, fails_in: str) -> None:
        self.fails_in = fails_in
        self.is_terminated = False

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        if self.fails_in == "fill":
            raise RuntimeError("secret-request-content")

    def accept(self, token_id: int) -> bool:
        return self.fails_in != "accept"


def config(model_dir) -> EngineConfig:
    return EngineConfig(model=str(model_dir), weights="pretrained", dtype="float32", device="cpu",
                        compile_decode=False, num_kv_blocks=32)


def break_grammar(engine: LLMEngine, request_id: str, fails_in: str) -> None:
    engine._seqs[request_id].grammar = BrokenGrammar(fails_in)


def run_to_end(engine: LLMEngine) -> dict[str, list[StepOutput]]:
    outputs: dict[str, list[StepOutput]] = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            outputs.setdefault(output.request_id, []).append(output)
    return outputs


def alone(engine: LLMEngine, request_id: str) -> list[int]:
    engine.add_request(request_id, PROMPTS[request_id], GREEDY)
    return [o.token_id for o in run_to_end(engine)[request_id]]


@pytest.fixture(scope="module")
def engine(tiny_gpt2_dir) -> LLMEngine:
    return LLMEngine(config(tiny_gpt2_dir))


@pytest.mark.parametrize("fails_in", ["fill", "accept"])
def test_a_request_failing_inside_a_step_ends_alone_and_the_batch_goes_on(engine: LLMEngine, fails_in: str,
                                                                           caplog) -> None:
    expected = {request_id: alone(engine, request_id) for request_id in ("first", "last")}
    for request_id, prompt in PROMPTS.items():
        engine.add_request(request_id, prompt, GREEDY)
    break_grammar(engine, "broken", fails_in)
    with caplog.at_level("ERROR", logger="engine.core.llm_engine"):
        outputs = run_to_end(engine)
    [failed] = outputs["broken"]
    assert (failed.finish_reason, failed.token_id) == ("error", None)
    for request_id, tokens in expected.items():
        assert [o.token_id for o in outputs[request_id]] == tokens
        assert outputs[request_id][-1].finish_reason == "length"
    engine.check_integrity()
    assert engine.block_manager.num_used_blocks == 0
    logged = [r.getMessage() for r in caplog.records]
    assert any("broken" in m and "failed inside a step" in m for m in logged), logged
    assert not any("secret-request-content" in m for m in logged)
    assert alone(engine, "first") == expected["first"]  # and the engine serves on


def test_the_failed_requests_stream_raises_and_the_others_stream_to_their_end(tiny_gpt2_dir) -> None:
    engine = AsyncEngine(config(tiny_gpt2_dir))
    long = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)

    async def tokens(request_id: str, params: SamplingParams = GREEDY) -> list[int]:
        return [t async for chunk in engine.generate(request_id, PROMPTS[request_id], params) for t in chunk.token_ids]

    async def broken_mid_stream() -> None:
        stream = engine.generate("broken", PROMPTS["broken"], long)
        await anext(stream)
        break_grammar(engine.engine, "broken", "accept")  # its state: the step loop reads it at its next token
        async for _ in stream:
            pass

    async def main() -> tuple[list, list[BaseException | list[int]]]:
        alone = [await tokens("first"), await tokens("last")]
        together = await asyncio.gather(tokens("first"), broken_mid_stream(), tokens("last"), return_exceptions=True)
        return alone, together

    try:
        alone, (first, failure, last) = asyncio.run(asyncio.wait_for(main(), timeout=60))
        assert isinstance(failure, RequestFailedError) and "broken" in str(failure)
        assert [first, last] == alone
        assert not engine.is_dead and engine.num_active_requests() == 0
        assert asyncio.run(asyncio.wait_for(tokens("first"), timeout=30)) == alone[0]
        engine.engine.check_integrity()  # idle: the step loop waits for work and touches nothing
    finally:
        engine.shutdown()
