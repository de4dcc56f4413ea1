"""The engine deployment with the doors tests need into a running engine: its KV pool's
integrity check, and faults injected into its step loop. Only tests build apps with it
(`faulty_app`); the product's engine deployment has neither door."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ray import serve

from deployments.app import make_app
from deployments.replicas.engine_deployment import EngineDeployment

if TYPE_CHECKING:
    from engine import LLMEngine


def fail_next_step(engine: LLMEngine) -> None:
    """The engine's next step raises, as a bug in the model would."""
    def failing_step():
        raise RuntimeError("fault injected by a test")

    engine.step = failing_step  # this engine's own: the step loop's next step calls it


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
    """The next request added fails alone inside the step that draws its second token, as
    one whose constraint broke would."""
    add_request = engine.add_request

    def add_and_break(request_id: str, *args, **kwargs) -> None:
        engine.add_request = add_request  # once
        add_request(request_id, *args, **kwargs)
        engine._seqs[request_id].grammar = _RefusesSecondToken()

    engine.add_request = add_and_break


class FaultyEngine(EngineDeployment.func_or_class):
    def check_integrity(self) -> None:
        """The KV pool's invariants (ref counts, free + used = total). Call it on an idle
        engine: its step loop then waits for work and touches nothing."""
        self._engine.engine.check_integrity()

    def fail_next_step(self) -> None:
        fail_next_step(self._engine.engine)

    def fail_next_request(self) -> None:
        fail_next_request(self._engine.engine)


def faulty_app(args: dict, deployment_options: dict[str, dict] | None = None) -> serve.Application:
    return make_app(args, deployment_options, engine_class=FaultyEngine)
