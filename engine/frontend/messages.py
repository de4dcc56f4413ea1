"""Messages into and out of the step loop thread (engine/frontend/step_loop.py).

In, from any thread through the inbox: AddRequest, AbortRequest, CallOnLoop, GraphCompiled.
Out, called on the event loop of the request(s) they concern: StepOutputs,
RequestRejected, EngineFailed.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from engine.request.outputs import EngineDeadError, StepOutput
from engine.request.sampling_params import SamplingParams
from engine.request.scheduling import Scheduling

if TYPE_CHECKING:
    import xgrammar as xgr

    from engine.core.llm_engine import LLMEngine


@dataclass(frozen=True)
class AddRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    loop: asyncio.AbstractEventLoop  # where the request's outputs are delivered
    scheduling: Scheduling = Scheduling()
    grammar: xgr.CompiledGrammar | None = None  # params.constraint's, compiled before it was sent
    lora_name: str | None = None  # the LoRA adapter it runs under (None: the base model)


@dataclass(frozen=True)
class AbortRequest:
    request_id: str


@dataclass(frozen=True)
class CallOnLoop:
    """Call `fn(engine)` on the loop thread, between two steps; `done` gets its result or its
    exception. LoRA adapters load and unload through it (AsyncEngine.add_lora and the like):
    the slots they take are read by every step."""

    fn: Callable[[LLMEngine], Any]
    done: concurrent.futures.Future


@dataclass(frozen=True)
class GraphCompiled:
    """The decode graph's background compile has ended: steps take the graph from now on,
    even when none runs until the next request (the log then says when it happened)."""


InMessage = AddRequest | AbortRequest | CallOnLoop | GraphCompiled


@dataclass(frozen=True)
class StepOutputs:
    """One step's outputs for the requests of one event loop."""

    outputs: list[StepOutput]
    steps_per_s: float  # the loop's smoothed step rate when it published them


@dataclass(frozen=True)
class RequestRejected:
    """The engine refused an AddRequest (LLMEngine.add_request raised): a ValueError for a
    request that can never run, anything else for a failure its values caused unexpectedly."""

    request_id: str
    error: Exception


@dataclass(frozen=True)
class EngineFailed:
    """The step loop crashed: every request of the event loop fails with `error`."""

    error: EngineDeadError


OutMessage = StepOutputs | RequestRejected | EngineFailed
