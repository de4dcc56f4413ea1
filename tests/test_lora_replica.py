"""An engine replica's adapters (deployments/replicas/engine_adapters.py): read on the first
request naming them, at most max_cpu_loras kept, the least recently requested idle one
forgotten, never one a request uses; each arrival tallied by where it found its adapter."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from deployments.replicas.engine_adapters import ReplicaAdapters
from engine import AsyncEngine, EngineConfig, SamplingParams
from engine.request.invalid_request import InvalidRequestError
from engine.request.lora_request import LoraRequest
from tests.test_lora import save_adapter

GREEDY = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
PROMPT = list(range(100, 120))


@pytest.fixture(scope="module")
def adapters(tiny_gpt2_dir, tmp_path_factory) -> dict[str, LoraRequest]:
    root = tmp_path_factory.mktemp("replica-loras")
    return {name: LoraRequest(name, str(save_adapter(tiny_gpt2_dir, root / name, seed, r=4, lora_alpha=8,
                                                           target_modules=["c_attn"])))
            for seed, name in enumerate("abcd")}


def engine(model_dir: Path, **config) -> AsyncEngine:
    return AsyncEngine(EngineConfig(model=str(model_dir), weights="pretrained", dtype="float32", device="cpu",
                                    compile_decode=False, **{"max_loras": 2, **config}))


async def run(replica: ReplicaAdapters, engine_: AsyncEngine, lora: LoraRequest, request_id: str) -> list[int]:
    async with replica.use(lora) as adapter:
        return [t async for chunk in engine_.generate(request_id, PROMPT, GREEDY, lora_name=adapter.name)
                for t in chunk.token_ids]


def test_past_max_cpu_loras_the_least_recently_requested_adapter_is_forgotten_and_read_again(tiny_gpt2_dir,
                                                                                            adapters):
    engine_ = engine(tiny_gpt2_dir, max_cpu_loras=2)
    arrivals: list[tuple[str, str]] = []
    replica = ReplicaAdapters(engine_, engine_.config.num_cpu_loras, lambda *arrival: arrivals.append(arrival))

    async def main():
        first = await run(replica, engine_, adapters["a"], "1")
        await run(replica, engine_, adapters["b"], "2")
        await run(replica, engine_, adapters["a"], "3")  # b is now the least recently requested
        await run(replica, engine_, adapters["c"], "4")
        held = replica.held(), [info.name for info in await engine_.list_loras()]
        again = await run(replica, engine_, adapters["b"], "5")
        return first, held, again, await engine_.lora_stats()

    try:
        first, held, again, stats = asyncio.run(main())
    finally:
        engine_.shutdown()
    assert held == (["a", "c"], ["a", "c"])
    assert replica.num_forgotten == 2 and stats.num_adapters == 2
    assert arrivals == [("a", "none"), ("b", "none"), ("a", "resident"), ("c", "none"), ("b", "none")]
    assert len(first) == len(again) == 4


def test_an_adapter_a_request_uses_is_never_forgotten_and_the_bound_holds_once_it_ends(tiny_gpt2_dir, adapters):
    engine_ = engine(tiny_gpt2_dir, max_loras=1, max_cpu_loras=1)
    replica = ReplicaAdapters(engine_, 1)

    async def main():
        async with replica.use(adapters["a"]) as a:
            async with replica.use(adapters["b"]):  # a is in use: kept, past the bound
                during = replica.held()
            assert (await run(replica, engine_, adapters["c"], "1"))  # b idle: forgotten, a still kept
            await replica.trimmed()  # c's end: c idle, a in use: c forgotten
            after_c = replica.held()
            tokens = [t async for chunk in engine_.generate("2", PROMPT, GREEDY, lora_name=a.name)
                      for t in chunk.token_ids]
        await run(replica, engine_, adapters["d"], "3")  # a and c idle now: down to the bound
        return during, after_c, tokens, replica.held()

    try:
        during, after_c, tokens, last = asyncio.run(main())
    finally:
        engine_.shutdown()
    assert during == ["a", "b"] and after_c == ["a"] and len(tokens) == 4 and last == ["d"]


def test_a_refused_adapter_is_an_invalid_request_and_leaves_nothing_in_use(tiny_gpt2_dir, adapters, tmp_path):
    engine_ = engine(tiny_gpt2_dir, max_cpu_loras=2)
    replica = ReplicaAdapters(engine_, 2)

    async def main():
        with pytest.raises(InvalidRequestError, match="'bad'"):
            async with replica.use(LoraRequest("bad", str(tmp_path))):
                pass
        with pytest.raises(RuntimeError, match="the client left"):
            async with replica.use(adapters["a"]):
                raise RuntimeError("the client left")
        await run(replica, engine_, adapters["b"], "1")
        await run(replica, engine_, adapters["c"], "2")  # a idle after its error: forgotten
        return replica.held()

    try:
        held = asyncio.run(main())
    finally:
        engine_.shutdown()
    assert held == ["b", "c"]


def test_max_cpu_loras_below_max_loras_is_refused():
    with pytest.raises(ValueError, match="max_cpu_loras must be an integer >= max_loras"):
        EngineConfig(max_loras=4, max_cpu_loras=2)
    assert EngineConfig(max_loras=4).num_cpu_loras == 4


def test_concurrent_requests_over_more_adapters_than_the_bound_all_run(tiny_gpt2_dir, adapters):
    """Reads, forgets and requests of held adapters interleave: none finds its adapter gone."""
    engine_ = engine(tiny_gpt2_dir, max_loras=1, max_cpu_loras=1)
    replica = ReplicaAdapters(engine_, 1)

    async def main():
        names = [name for _ in range(4) for name in "abcd"]
        outputs = await asyncio.gather(*(run(replica, engine_, adapters[name], str(i)) for i, name in enumerate(names)))
        await replica.trimmed()  # the last request's end forgets the idle ones past the bound
        return outputs

    try:
        outputs = asyncio.run(main())
    finally:
        engine_.shutdown()
    assert [len(tokens) for tokens in outputs] == [4] * 16 and len(replica.held()) == 1
