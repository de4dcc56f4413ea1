"""AsyncEngine: streaming from the background step loop, coalesced chunks, aborts, crashes."""

from __future__ import annotations

import asyncio
import threading
import time

import psutil
import pytest

from engine import LLM, AsyncEngine, EngineConfig, EngineDeadError, EngineOverloadedError, SamplingParams
from engine.core import heap
from engine.core.sequence import RequestTimings
from engine.frontend import step_loop
from engine.frontend.request_stream import RequestStream
from engine.request.outputs import RequestFailedError, StepOutput
from engine.request.invalid_request import InvalidRequestError
from tests.engine_faults import fail_next_step
from tests.engine_helpers import mixed_prompts

GREEDY = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)


def make_engine(model_dir, max_chunks_per_s: float | None = None, engine_class: type[AsyncEngine] = AsyncEngine,
                **config) -> AsyncEngine:
    return engine_class(EngineConfig(model=str(model_dir), weights="pretrained", dtype="float32", device="cpu",
                                     compile_decode=False, **config), max_chunks_per_s=max_chunks_per_s)


@pytest.fixture
def engine(tiny_gpt2_dir):
    engine = make_engine(tiny_gpt2_dir)
    yield engine
    engine.shutdown()
    assert not engine.step_loop.is_alive()


async def collect(engine: AsyncEngine, request_id: str, prompt: list[int], params=GREEDY):
    chunks = [chunk async for chunk in engine.generate(request_id, prompt, params)]
    return chunks, [t for c in chunks for t in c.token_ids]


async def wait_until(predicate, timeout: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


def test_streams_match_offline_generation(engine, tiny_gpt2_dir):
    prompts = mixed_prompts(8)
    offline = LLM(str(tiny_gpt2_dir), weights="pretrained", dtype="float32", device="cpu", compile_decode=False).generate(prompts, GREEDY)

    async def main():
        return await asyncio.gather(*(collect(engine, f"r{i}", p) for i, p in enumerate(prompts)))

    results = asyncio.run(main())
    for (chunks, tokens), expected in zip(results, offline):
        assert tokens == expected.token_ids
        assert chunks[-1].finish_reason == "length"
        assert all(c.finish_reason is None for c in chunks[:-1])
        assert chunks[0].num_prompt_tokens > 0


def test_a_slow_consumer_gets_tokens_coalesced_into_fewer_chunks(engine):
    async def main():
        chunks = []
        async for chunk in engine.generate("slow", [1, 2, 3], GREEDY):
            chunks.append(chunk)
            await asyncio.sleep(0.05)  # the engine keeps stepping meanwhile
        return chunks

    chunks = asyncio.run(main())
    assert sum(len(c.token_ids) for c in chunks) == 20
    assert len(chunks) < 20
    assert max(len(c.token_ids) for c in chunks) > 1


def test_first_and_last_chunks_carry_timings(engine):
    chunks, _ = asyncio.run(collect(engine, "t", [1, 2, 3]))
    for chunk in (chunks[0], chunks[-1]):
        assert chunk.timings is not None and chunk.timings.prefill_s >= 0
        assert chunk.timings.ttft_s >= chunk.timings.queue_wait_s >= 0


class CountingEngine(AsyncEngine):
    """Counts the outputs of each StepOutputs message the step loop hands the asyncio side."""

    def __init__(self, *args, **kwargs) -> None:
        self.handed_over: list[int] = []
        super().__init__(*args, **kwargs)

    def _receive(self, message) -> None:
        self.handed_over.append(len(getattr(message, "outputs", ())))
        super()._receive(message)


def test_step_outputs_reach_asyncio_once_per_step(tiny_gpt2_dir):
    engine = make_engine(tiny_gpt2_dir, engine_class=CountingEngine)

    async def main():
        return await asyncio.gather(*(collect(engine, f"r{i}", [i + 1]) for i in range(6)))

    try:
        asyncio.run(main())
    finally:
        engine.shutdown()
    calls = [n for n in engine.handed_over if n]
    assert sum(calls) == 6 * 20
    assert len(calls) < 6 * 20  # several requests' tokens per hand-over


def test_breaking_out_of_a_stream_aborts_the_request_and_frees_its_blocks(engine):
    async def main():
        async for chunk in engine.generate("quit", list(range(40)), SamplingParams(max_tokens=500, temperature=0, ignore_eos=True)):
            break
        await wait_until(lambda: engine.stats().num_kv_blocks_used == 0 and engine.stats().num_running == 0)

    asyncio.run(main())
    assert engine.num_active_requests() == 0
    engine.engine.check_integrity()  # idle: the step loop waits for work and touches nothing


def test_an_event_loop_closed_under_an_open_stream_frees_its_request_and_the_engine_serves_on(engine):
    """The consumer's loop goes away with its request still running (no abort ever sent):
    the step loop drops that loop's outputs, aborts the request and keeps serving."""
    loop = asyncio.new_event_loop()
    stream = engine.generate("orphan", list(range(40)), SamplingParams(max_tokens=500, temperature=0, ignore_eos=True))
    loop.run_until_complete(anext(stream))
    loop.close()
    deadline = time.monotonic() + 10
    while engine.stats().num_kv_blocks_used or engine.stats().num_running:
        assert time.monotonic() < deadline, "the orphaned request kept its blocks"
        time.sleep(0.01)
    assert engine.step_loop.is_alive()
    chunks, tokens = asyncio.run(collect(engine, "after", list(range(8))))
    assert len(tokens) == GREEDY.max_tokens and chunks[-1].finish_reason == "length"


def test_cancelling_the_consumer_task_aborts_the_request(engine):
    async def consume():
        async for _ in engine.generate("cancel-me", [5] * 30, SamplingParams(max_tokens=500, temperature=0, ignore_eos=True)):
            pass

    async def main():
        task = asyncio.create_task(consume())
        await wait_until(lambda: engine.stats().num_running == 1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await wait_until(lambda: engine.stats().num_kv_blocks_used == 0 and engine.stats().num_running == 0)

    asyncio.run(main())


def test_invalid_request_raises_before_streaming(engine):
    async def main():
        with pytest.raises(ValueError, match="context"):
            await collect(engine, "too-long", [1] * 1020, SamplingParams(max_tokens=10))

    asyncio.run(main())
    assert engine.num_active_requests() == 0


def test_params_past_their_limits_are_refused_at_admission_and_the_engine_serves_on(engine):
    bad = SamplingParams(max_tokens=4, temperature=0)
    object.__setattr__(bad, "top_k", 2**63)  # as params unpickled from a handle's caller may hold

    async def main():
        running = asyncio.ensure_future(collect(engine, "running", [1, 2], GREEDY))
        with pytest.raises(InvalidRequestError) as refused:
            await collect(engine, "bad", [1, 2, 3], bad)
        assert refused.value.param == "top_k"
        return await running, await collect(engine, "after", [4, 5])

    (_, running), (_, after) = asyncio.run(asyncio.wait_for(main(), timeout=30))
    assert len(running) == len(after) == 20
    assert not engine.is_dead and engine.num_active_requests() == 0


def test_an_unexpected_error_at_admission_fails_that_request_alone_and_logs_no_content(engine, caplog):
    validate = engine.engine.validate_request

    def faulty(prompt_token_ids, params):  # a fault one request's values could trigger
        if prompt_token_ids == [9, 9, 9]:
            raise RuntimeError("quotes the request: secret-content")
        validate(prompt_token_ids, params)

    engine.engine.validate_request = faulty

    async def main():
        with pytest.raises(RuntimeError):
            await collect(engine, "faulty-request", [9, 9, 9])
        return await collect(engine, "after", [4, 5])

    with caplog.at_level("ERROR", logger="engine.frontend.step_loop"):
        _, after = asyncio.run(asyncio.wait_for(main(), timeout=30))
    assert len(after) == 20 and not engine.is_dead
    logged = [r.getMessage() for r in caplog.records if r.name == "engine.frontend.step_loop"]
    assert any("faulty-request" in m and "RuntimeError" in m for m in logged), logged
    assert not any("secret-content" in m for m in logged)


def test_a_crash_in_the_step_loop_fails_in_flight_requests_and_marks_the_engine_dead(engine):
    async def main():
        stream = engine.generate("doomed", [1, 2, 3], SamplingParams(max_tokens=500, temperature=0, ignore_eos=True))
        await stream.__anext__()
        fail_next_step(engine.engine)
        with pytest.raises(EngineDeadError, match="fault injected by a test"):
            async for _ in stream:
                pass
        with pytest.raises(EngineDeadError):
            await collect(engine, "after", [1])

    asyncio.run(asyncio.wait_for(main(), timeout=10))
    assert engine.is_dead
    with pytest.raises(EngineDeadError):
        engine.check_health()


def test_idle_loop_sleeps_instead_of_polling(engine):
    asyncio.run(collect(engine, "warm", [1]))
    threading.Event().wait(0.05)
    checks = []
    original = engine.engine.has_unfinished_requests
    engine.engine.has_unfinished_requests = lambda: checks.append(1) or original()
    threading.Event().wait(0.3)
    assert checks == []  # a polling loop would look for work again and again
    asyncio.run(collect(engine, "wake", [2]))  # and a new request still wakes it
    assert checks


def test_under_a_chunk_rate_budget_many_streams_get_multi_token_chunks_but_the_first_token_at_once(tiny_gpt2_dir):
    engine = make_engine(tiny_gpt2_dir, max_chunks_per_s=50)
    try:
        async def main():
            return await asyncio.gather(*(collect(engine, f"r{i}", [i + 1]) for i in range(16)))

        results = asyncio.run(main())
    finally:
        engine.shutdown()
    for chunks, tokens in results:
        assert len(tokens) == 20
        assert len(chunks[0].token_ids) == 1  # TTFT is never traded for fewer chunks
    total_chunks = sum(len(chunks) for chunks, _ in results)
    assert total_chunks < 16 * 20 / 2


def test_requests_beyond_the_waiting_bound_are_refused_at_once(tiny_gpt2_dir):
    engine = make_engine(tiny_gpt2_dir, max_waiting_requests=2)
    try:
        async def main():
            params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
            streams = [engine.generate(f"q{i}", [1, 2, 3], params) for i in range(3)]
            first = [asyncio.ensure_future(s.__anext__()) for s in streams[:2]]
            await asyncio.sleep(0)  # both admitted, neither has a token yet
            with pytest.raises(EngineOverloadedError) as refused:
                await streams[2].__anext__()
            assert refused.value.retry_after_s >= 1
            await asyncio.gather(*first)
            for s in streams[:2]:
                async for _ in s:
                    pass
            return [t async for c in engine.generate("later", [4], params) for t in c.token_ids]

        assert len(asyncio.run(main())) == 3  # once the queue drains, requests are admitted again
    finally:
        engine.shutdown()


def test_a_prompt_longer_than_the_waiting_token_bound_is_invalid_not_overloaded(tiny_gpt2_dir):
    engine = make_engine(tiny_gpt2_dir, max_waiting_tokens=8)
    try:
        async def main():
            with pytest.raises(InvalidRequestError, match="max_waiting_tokens") as refused:
                await collect(engine, "never-fits", list(range(1, 10)))  # on an idle engine: no retry could pass
            assert refused.value.param == "prompt"
            return await collect(engine, "fits", list(range(1, 9)))

        assert len(asyncio.run(main())[1]) == 20
    finally:
        engine.shutdown()


def test_heap_trim_returns_free_pages_on_this_platform():
    # 64 MiB in 1 KiB mallocs, pinned below a later allocation so that free() alone cannot
    # shrink the heap: the freed pages stay resident until the trim hands them back.
    blocks = [bytes(1024) for _ in range(64 * 1024)]
    pin = bytes(1024)
    del blocks
    before = psutil.Process().memory_info().rss
    assert heap.trim_heap() is True  # Linux/glibc, where the engine replica runs
    assert before - psutil.Process().memory_info().rss > 32 * 2**20
    del pin


def test_idle_step_loop_trims_the_heap_once_per_idle_period(tiny_gpt2_dir, monkeypatch):
    trims = []
    real_trim = step_loop.trim_heap
    monkeypatch.setattr(step_loop, "_TRIM_AFTER_IDLE_S", 0.2)
    monkeypatch.setattr(step_loop, "trim_heap", lambda: trims.append(1) or real_trim())
    engine = make_engine(tiny_gpt2_dir)
    try:
        async def run() -> None:
            await wait_until(lambda: len(trims) == 1)  # idle after warm-up: one trim
            await asyncio.sleep(0.6)
            assert len(trims) == 1, "an idle loop trims once, then sleeps until woken"
            await collect(engine, "a", [1, 2, 3])
            await wait_until(lambda: len(trims) == 2)  # the next idle period: one more
            await asyncio.sleep(0.6)
            assert len(trims) == 2

        asyncio.run(run())
    finally:
        engine.shutdown()


def test_a_replicas_load_report_is_current_while_idle_and_counts_the_work_ahead_while_busy(engine):
    """What the router reads (deployments/routing/engine_load.py): the engine's pending work as of
    its last step while requests are open; zero, stamped now, once none is, so that an idle
    replica's report never goes stale."""
    from deployments.routing.engine_load import EngineLoad

    async def main():
        stream = engine.generate("busy", list(range(300, 340)), SamplingParams(max_tokens=50, temperature=0, ignore_eos=True))
        await anext(stream)  # the prompt computed, the first token out
        busy = EngineLoad.of(engine)
        await stream.aclose()
        await wait_until(lambda: engine.num_active_requests() == 0)
        return busy

    busy = asyncio.run(main())
    assert busy.num_pending_prompt_tokens == 0 and 0 < busy.num_pending_decode_tokens < 50
    time.sleep(0.2)  # the last step's stamp is now older than the report below
    asked_at = time.time()
    idle = EngineLoad.of(engine)
    assert (idle.num_pending_prompt_tokens, idle.num_pending_decode_tokens) == (0, 0)
    assert idle.pending_at >= asked_at > busy.pending_at  # stamped when asked, not at the last step


def test_a_stream_that_fails_after_a_token_its_consumer_has_not_read_yet_gives_the_token_then_the_error():
    """The step loop may deliver a token and then fail the request before the consumer runs
    (a loaded machine): the token still comes first, so a server has answered 200 with it."""
    stream = RequestStream("r", num_prompt_tokens=1)
    timings = RequestTimings(arrival=0.0, first_scheduled=0.0, first_token=0.0)
    stream.push(StepOutput("r", 7, None, 1, timings), min_tokens=1)
    stream.push(StepOutput("r", None, "error", 1, timings), min_tokens=1)

    async def read() -> tuple[list[list[int]], BaseException | None]:
        tokens = []
        try:
            async for chunk in stream.chunks():
                tokens.append(chunk.token_ids)
        except RequestFailedError as exc:
            return tokens, exc
        return tokens, None

    tokens, error = asyncio.run(read())
    assert tokens == [[7]] and error is not None
