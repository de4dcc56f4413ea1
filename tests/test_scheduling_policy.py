"""The scheduling policies on a real engine (the tiny checkpoint): who starts next and who is
preempted under fcfs, priority and fair (engine/core/queue_policy.py), stepped by hand."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from engine import LLM, SamplingParams
from engine.core.llm_engine import LLMEngine
from engine.request.invalid_request import InvalidRequestError
from engine.request.scheduling import Scheduling


def make_engine(model_dir: Path, policy: str, **config) -> LLMEngine:
    return LLM(str(model_dir), dtype="float32", device="cpu", compile_decode=False, scheduling_policy=policy,
               **config).engine


def params(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)


def first_token_order(engine: LLMEngine) -> list[str]:
    """Step until idle; the request ids in the order of their first tokens."""
    order: list[str] = []
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.request_id not in order:
                order.append(output.request_id)
    return order


def finish_order(engine: LLMEngine) -> list[str]:
    """Step until idle; the request ids in the order they finished."""
    order: list[str] = []
    while engine.has_unfinished_requests():
        order += [o.request_id for o in engine.step() if o.finish_reason is not None]
    return order


def assert_idle_and_intact(engine: LLMEngine) -> None:
    assert not engine.has_unfinished_requests()
    assert engine.block_manager.num_used_blocks == 0
    assert len(engine.scheduler.waiting) == 0 and engine.scheduler.running == []
    engine.check_integrity()


def test_waiting_requests_start_in_priority_order_and_fcfs_among_equals(tiny_gpt2_dir):
    engine = make_engine(tiny_gpt2_dir, "priority", max_num_seqs=1)
    for request_id, priority in (("a", 0), ("b", 5), ("c", -1), ("d", 0)):
        engine.add_request(request_id, [1, 2, 3], params(2), Scheduling(priority=priority))
    assert first_token_order(engine) == ["c", "a", "d", "b"]
    assert engine.scheduler.num_preemptions == 0
    assert_idle_and_intact(engine)


def test_a_higher_priority_request_preempts_the_lowest_priority_running_one(tiny_gpt2_dir):
    engine = make_engine(tiny_gpt2_dir, "priority", max_num_seqs=2)
    engine.add_request("low", [1, 2, 3], params(20), Scheduling(priority=2))
    engine.add_request("mid", [4, 5, 6], params(20), Scheduling(priority=1))
    for _ in range(3):
        engine.step()
    engine.add_request("urgent", [7, 8, 9], params(4), Scheduling(priority=0))
    outputs = {o.request_id for o in engine.step()}
    assert outputs == {"mid", "urgent"}  # low gave up its place: recomputed later
    assert [s.request_id for s in engine.scheduler.waiting] == ["low"]
    assert engine.scheduler.num_preemptions == 1
    engine.check_integrity()
    assert finish_order(engine) == ["urgent", "mid", "low"]  # every one runs to its end
    assert_idle_and_intact(engine)


def test_an_equal_or_lower_priority_request_waits_for_a_slot(tiny_gpt2_dir):
    engine = make_engine(tiny_gpt2_dir, "priority", max_num_seqs=1)
    engine.add_request("running", [1, 2, 3], params(6), Scheduling(priority=0))
    engine.step()
    engine.add_request("same", [4, 5], params(2), Scheduling(priority=0))
    engine.add_request("lower", [4, 5], params(2), Scheduling(priority=3))
    assert first_token_order(engine) == ["running", "same", "lower"]
    assert engine.scheduler.num_preemptions == 0


def test_under_fcfs_requests_start_in_arrival_order_and_a_priority_is_refused(tiny_gpt2_dir):
    engine = make_engine(tiny_gpt2_dir, "fcfs", max_num_seqs=1)
    for request_id in ("a", "b", "c"):
        engine.add_request(request_id, [1, 2, 3], params(2))
    with pytest.raises(InvalidRequestError, match="fcfs") as refused:
        engine.add_request("urgent", [1, 2, 3], params(2), Scheduling(priority=-1))
    assert refused.value.param == "priority"
    assert first_token_order(engine) == ["a", "b", "c"]
    assert_idle_and_intact(engine)


def test_under_fcfs_kv_pressure_preempts_the_newest_admitted_and_it_goes_back_to_the_front(tiny_gpt2_dir):
    """Two sequences that outgrow a 6-block pool: the newer is the one preempted, and it goes
    back ahead of a request that arrived after it."""
    engine = make_engine(tiny_gpt2_dir, "fcfs", max_num_seqs=2, num_kv_blocks=6, block_size=16)
    victims: list[str] = []
    preempt = engine.scheduler._preempt

    def recording(seq):
        victims.append(seq.request_id)
        preempt(seq)
        victims.append([s.request_id for s in engine.scheduler.waiting])

    engine.scheduler._preempt = recording
    engine.add_request("old", list(range(1, 20)), params(40))
    engine.add_request("new", list(range(1, 20)), params(40))
    engine.step()
    engine.add_request("later", [1, 2], params(2))
    first_token_order(engine)
    assert victims[:2] == ["new", ["new", "later"]]
    assert set(victims[::2]) == {"new"}
    assert_idle_and_intact(engine)


@pytest.mark.parametrize("priority", [-101, 101, True, 1.5])
def test_a_priority_outside_the_configured_range_is_refused(tiny_gpt2_dir, priority):
    engine = make_engine(tiny_gpt2_dir, "fair", priority_range=(-100, 100))
    with pytest.raises(InvalidRequestError) as refused:
        engine.add_request("x", [1, 2, 3], params(2), Scheduling(priority=priority))
    assert refused.value.param == "priority"
    assert not engine.has_unfinished_requests()


def serve_saturated(engine: LLMEngine, tenants: dict[str, float], num_steps: int) -> Counter:
    """Each tenant keeps 3 requests waiting for num_steps steps; the tokens each got (prompt
    tokens computed + tokens generated: the service the policy counts), read off the batches
    the model runs."""
    served: Counter = Counter()
    run = engine.runner.run

    def recording(batch):
        for seq, num_new in zip(batch.seqs, batch.num_new_tokens):
            served[seq.tenant] += num_new
        return run(batch)

    engine.runner.run = recording
    for step in range(num_steps):
        live = Counter(seq.tenant for seq in engine._seqs.values())
        for tenant, weight in tenants.items():
            for i in range(engine.config.max_num_seqs + 3 - live[tenant]):
                engine.add_request(f"{tenant}-{step}-{i}", [1, 2, 3, 4], params(6), Scheduling(0, tenant, weight))
        engine.step()
    engine.runner.run = run
    return served


def test_weighted_shares_converge_to_the_weights_under_saturation(tiny_gpt2_dir):
    engine = make_engine(tiny_gpt2_dir, "fair", max_num_seqs=4)
    served = serve_saturated(engine, {"a": 1.0, "b": 3.0}, num_steps=120)
    assert served["b"] / (served["a"] + served["b"]) == pytest.approx(0.75, abs=0.05), served


def test_equal_weights_share_equally_whatever_each_sends(tiny_gpt2_dir):
    engine = make_engine(tiny_gpt2_dir, "fair", max_num_seqs=4)
    served = serve_saturated(engine, {"a": 1.0, "b": 1.0}, num_steps=80)
    assert served["a"] / (served["a"] + served["b"]) == pytest.approx(0.5, abs=0.05), served


def test_a_tenant_back_from_idle_gets_no_credit_for_its_idle_time(tiny_gpt2_dir):
    """a is served alone for a while; when b arrives its counter is lifted to a's, so the
    two share from then on rather than b taking every slot until it has caught up."""
    engine = make_engine(tiny_gpt2_dir, "fair", max_num_seqs=4)
    serve_saturated(engine, {"a": 1.0}, num_steps=40)
    counters = engine.scheduler.waiting.counters
    assert counters["a"] > 40
    engine.add_request("b-first", [1, 2, 3, 4], params(6), Scheduling(0, "b", 1.0))
    assert counters["b"] == counters["a"]  # lifted to the least counter of the backlogged: a's
    served = serve_saturated(engine, {"a": 1.0, "b": 1.0}, num_steps=40)
    assert served["a"] / (served["a"] + served["b"]) == pytest.approx(0.5, abs=0.1), served


def fill_batch(engine: LLMEngine, tenant: str, num_requests: int, max_tokens: int = 30) -> None:
    """tenant's requests, stepped until the batch is full (the rest wait)."""
    for i in range(num_requests):
        engine.add_request(f"{tenant}-{i}", [1, 2, 3, 4], params(max_tokens), Scheduling(0, tenant))
    while len(engine.scheduler.running) < min(num_requests, engine.config.max_num_seqs):
        engine.step()
    engine.step()


def running_by_tenant(engine: LLMEngine) -> Counter:
    return Counter(seq.tenant for seq in engine.scheduler.running)


def test_a_tenant_short_of_its_share_is_prefilled_in_a_step_of_its_own_taking_the_newest_slot(tiny_gpt2_dir):
    engine = make_engine(tiny_gpt2_dir, "fair", max_num_seqs=4)
    fill_batch(engine, "heavy", 6)
    newest = engine.scheduler.running[-1].request_id
    engine.add_request("light", [5, 6, 7], params(4), Scheduling(0, "light"))
    outputs = engine.step()
    assert [o.request_id for o in outputs] == ["light"]  # no heavy decode in its step
    assert engine.step_log.drain()[-1].num_tokens == 3
    assert running_by_tenant(engine) == {"heavy": 3, "light": 1}
    assert newest in {s.request_id for s in engine.scheduler.waiting} and engine.scheduler.num_preemptions == 1
    engine.check_integrity()
    assert {o.request_id for o in engine.step()} == {"light", *(s.request_id for s in engine.scheduler.running)}
    finish_order(engine)
    assert_idle_and_intact(engine)


def test_a_weighted_tenant_takes_its_share_of_the_slots_at_once_and_keeps_them(tiny_gpt2_dir):
    engine = make_engine(tiny_gpt2_dir, "fair", max_num_seqs=4)
    fill_batch(engine, "a", 6)
    for i in range(5):
        engine.add_request(f"b-{i}", [5, 6, 7], params(30), Scheduling(0, "b", 3.0))
    assert {o.request_id for o in engine.step()} == {"b-0", "b-1", "b-2"}
    assert running_by_tenant(engine) == {"a": 1, "b": 3}  # shares of 4 slots by weight 1:3
    for _ in range(10):
        engine.step()
    assert engine.scheduler.num_preemptions == 3  # neither takes a slot back
    finish_order(engine)
    assert_idle_and_intact(engine)


def test_a_tenant_at_its_share_waits_for_a_slot_like_any_other(tiny_gpt2_dir):
    engine = make_engine(tiny_gpt2_dir, "fair", max_num_seqs=4)
    for tenant in ("a", "b"):
        for i in range(2):
            engine.add_request(f"{tenant}-{i}", [1, 2, 3, 4], params(30), Scheduling(0, tenant))
    engine.step()
    engine.add_request("b-late", [5, 6, 7], params(4), Scheduling(0, "b"))
    assert {o.request_id for o in engine.step()} == {"a-0", "a-1", "b-0", "b-1"}
    assert engine.scheduler.num_preemptions == 0
    finish_order(engine)
    assert_idle_and_intact(engine)


def test_one_tenant_under_fair_never_goes_ahead_of_its_own_batch(tiny_gpt2_dir):
    engine = make_engine(tiny_gpt2_dir, "fair", max_num_seqs=4)
    fill_batch(engine, "solo", 2)
    engine.add_request("solo-late", [5, 6, 7], params(4), Scheduling(0, "solo"))
    assert {o.request_id for o in engine.step()} == {"solo-0", "solo-1", "solo-late"}  # one step, decodes beside it
    assert engine.scheduler.num_preemptions == 0
    finish_order(engine)
    assert_idle_and_intact(engine)
