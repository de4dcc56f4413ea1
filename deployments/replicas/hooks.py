"""The one door tests and benchmarks have into a running engine replica; shut in service.

- RAYINFER_TEST_HOOKS=1 in the replica's environment opens `EngineReplica.test_hook(name)`,
  run on the engine's step loop between two steps: "check_integrity" asserts the KV pool's
  invariants (the leak checks), "fail_next_step" makes the next step raise as a bug in the
  model would, "fail_next_request" makes the next request added fail alone inside the
  step that draws its second token, as one whose constraint broke would (the fault-injection tests).
- RAYINFER_LOAD_LOG_DIR=<dir> makes each replica append every change of its open requests,
  and the work each asks of it, to <dir>/<replica id>.log: the scale-out benchmarks and
  tests check the router's load bound against them.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Collection
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

from deployments.routing.cache_shadow import CacheShadow
from deployments.routing.prefix_routing import block_hashes

if TYPE_CHECKING:  # the replica imports the engine in its constructor, not with its modules
    from engine import AsyncEngine, LLMEngine

TEST_HOOKS_ENV = "RAYINFER_TEST_HOOKS"
LOAD_LOG_DIR_ENV = "RAYINFER_LOAD_LOG_DIR"


def fail_next_step(engine: LLMEngine) -> None:
    def failing_step():
        raise RuntimeError("fault injected by a test")

    engine.step = failing_step  # this engine's own: the loop's next step calls it


class _RefusesSecondToken:
    """A grammar state that takes a request's first token and refuses its second."""

    is_terminated = False

    def __init__(self) -> None:
        self.num_accepted = 0

    def fill(self, bitmask, row: int) -> None:
        pass  # every token allowed

    def accept(self, token_id: int) -> bool:
        self.num_accepted += 1
        return self.num_accepted < 2


def fail_next_request(engine: LLMEngine) -> None:
    add_request = engine.add_request

    def add_and_break(request_id: str, *args, **kwargs) -> None:
        engine.add_request = add_request  # once
        add_request(request_id, *args, **kwargs)
        engine._seqs[request_id].grammar = _RefusesSecondToken()

    engine.add_request = add_and_break


def check_integrity(engine: LLMEngine) -> None:
    engine.check_integrity()


TEST_HOOKS: dict[str, Callable[[LLMEngine], None]] = {"check_integrity": check_integrity,
                                                       "fail_next_step": fail_next_step,
                                                       "fail_next_request": fail_next_request}


class ReplicaHooks:
    """An engine replica's side of the door: its load log, where one was asked for, and
    the test hooks, where they are open."""

    def __init__(self, replica_id: str, block_size: int, num_kv_blocks: int) -> None:
        directory = os.environ.get(LOAD_LOG_DIR_ENV)
        self._load_log = LoadLog(Path(directory), replica_id, block_size, num_kv_blocks) if directory else None

    def arrived(self, request_id: str, prompt_token_ids: list[int], max_tokens: int) -> None:
        if self._load_log is not None:
            self._load_log.arrived(request_id, prompt_token_ids, max_tokens)

    def left(self, request_id: str) -> None:
        if self._load_log is not None:
            self._load_log.left(request_id)

    async def call(self, engine: AsyncEngine, name: str) -> None:
        if os.environ.get(TEST_HOOKS_ENV) != "1":
            raise PermissionError(f"test hooks are shut (set {TEST_HOOKS_ENV}=1 in tests only)")
        await engine.call_on_loop(TEST_HOOKS[name])


class LoadEvent(NamedTuple):
    """One change of a replica's open requests, and the shape of the request that made it."""

    time: float  # wall clock
    num_open: int  # open requests after it
    delta: int  # +1 arrived, -1 left
    num_prompt_tokens: int = 0
    # Not among the blocks of the prompts recently sent to this replica (a shadow of its
    # own arrivals, as deployments/routing/cache_shadow.py keeps one per router): what its prefix
    # cache likely missed, as the routers' work model counts it.
    num_uncached_tokens: int = 0
    max_tokens: int = 0


class LoadLog:
    """Every change of a replica's open `generate` calls, appended to <dir>/<replica id>.log
    as LoadEvent lines (wall clock, so the logs of replicas on one machine merge into one
    timeline: loadtest/scale/load_balance.py)."""

    def __init__(self, directory: Path, replica_id: str, block_size: int, num_kv_blocks: int) -> None:
        self.num_open = 0
        self._replica_id, self._block_size, self._num_kv_blocks = replica_id, block_size, num_kv_blocks
        self._shapes: dict[str, tuple[int, int, int]] = {}  # open request id -> its shape
        self._shadow = CacheShadow()
        self._file = open(directory / f"{replica_id}.log", "a", buffering=1)

    def arrived(self, request_id: str, prompt_token_ids: list[int], max_tokens: int) -> None:
        self.num_open += 1
        hashes = block_hashes(prompt_token_ids, self._block_size)
        num_cached = self._shadow.num_cached_blocks(self._replica_id, hashes) * self._block_size
        self._shadow.record(self._replica_id, hashes, self._num_kv_blocks)
        shape = (len(prompt_token_ids), len(prompt_token_ids) - num_cached, max_tokens)
        self._shapes[request_id] = shape
        self._write(1, shape)

    def left(self, request_id: str) -> None:
        self.num_open -= 1
        self._write(-1, self._shapes.pop(request_id, (0, 0, 0)))

    def _write(self, delta: int, shape: tuple[int, int, int]) -> None:
        self._file.write(f"{time.time():.6f} {self.num_open} {delta} {' '.join(map(str, shape))}\n")


def read_load_logs(directory: Path, since: float = 0.0,
                   replica_ids: Collection[str] | None = None) -> dict[str, list[LoadEvent]]:
    """Every replica's LoadLog in directory (or only replica_ids': a redeployed app leaves
    its old replicas' logs, which would count as idle replicas), the events at or after
    `since` (time.time())."""
    logs = {}
    for path in sorted(directory.glob("*.log")):
        if replica_ids is not None and path.stem not in replica_ids:
            continue
        events = [LoadEvent(float(t), *map(int, rest)) for t, *rest in (line.split() for line in path.read_text().splitlines())]
        logs[path.stem] = [event for event in events if event.time >= since]
    return logs
