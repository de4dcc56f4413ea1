"""The waiting line and who goes next: first come first served, by priority, or fair shares
between tenants (EngineConfig.scheduling_policy).

    fcfs       arrival order; a preempted sequence goes back to the front
    priority   lower `priority` first (vLLM's), arrival order among equals; a waiting
               request preempts the lowest-priority running one when the batch is full
    fair       the virtual token counter (Sheng et al., "Fairness in Serving Large Language
               Models", OSDI 2024): the next request comes from the backlogged tenant with
               the least service so far (prompt tokens computed plus tokens generated,
               divided by its weight); priority orders each tenant's own line. While a
               tenant runs more sequences than its share of the batch's slots (by weight,
               among the tenants with work live), one running fewer goes ahead: the
               scheduler prefills its request in a step of its own, taking where the batch
               is full the slot of a sequence whose tenant keeps its own share without it

A tenant that becomes backlogged has its counter lifted to the least counter of those
backlogged already (or, with none, to that of the tenant whose request left the line last),
so idle time earns no credit to spend later as a burst.
"""

from __future__ import annotations

import bisect
from collections import OrderedDict, deque
from collections.abc import Iterator
from typing import TYPE_CHECKING

from engine.request.scheduling import SchedulingPolicy

if TYPE_CHECKING:
    from engine.core.sequence import Sequence

# Counters of tenants with nothing live, kept so that their return earns no credit; the
# oldest are forgotten past this many (tenants by the `user` field are unbounded).
MAX_IDLE_TENANTS = 1024


def _rank(seq: Sequence) -> tuple[int, int]:
    """Lower first: priority, then arrival."""
    return seq.priority, seq.arrival_index


class FcfsQueue:
    """Arrival order: the order the scheduler has always used. The hooks the other policies
    need (charge, forget, may_preempt) do nothing here."""

    def __init__(self) -> None:
        self._seqs: deque[Sequence] | list[Sequence] = deque()

    def __len__(self) -> int:
        return len(self._seqs)

    def __iter__(self) -> Iterator[Sequence]:
        return iter(self._seqs)

    def add(self, seq: Sequence) -> None:
        self._seqs.append(seq)

    def requeue(self, seq: Sequence) -> None:
        """A preempted (or passed-over) sequence: back to the front."""
        self._seqs.appendleft(seq)

    def remove(self, seq: Sequence) -> None:
        self._seqs.remove(seq)

    def peek(self) -> Sequence | None:
        return self._seqs[0] if self._seqs else None

    def charge(self, seq: Sequence, num_tokens: int) -> None:
        pass

    def forget(self, seq: Sequence) -> None:
        pass

    def may_preempt(self, waiting: Sequence, running: Sequence) -> bool:
        return False

    def victim_key(self, seq: Sequence) -> tuple:
        return ()  # every running sequence alike: the newest admitted goes first

    def underserved_head(self, num_slots: int) -> Sequence | None:
        """The next waiting request to go ahead of the running batch: none but under fair."""
        return None

    def slot_victim(self, running: list[Sequence], num_slots: int) -> Sequence | None:
        """The running sequence to give its slot to underserved_head's: none but under fair."""
        return None


class PriorityQueue(FcfsQueue):
    """Lower priority first, arrival order among equals; a sequence goes back to its place."""

    def __init__(self) -> None:
        self._seqs: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        bisect.insort(self._seqs, seq, key=_rank)

    def requeue(self, seq: Sequence) -> None:
        self.add(seq)

    def may_preempt(self, waiting: Sequence, running: Sequence) -> bool:
        return running.priority > waiting.priority

    def victim_key(self, seq: Sequence) -> tuple[int, int]:
        return _rank(seq)


class FairQueue:
    """One PriorityQueue per tenant; the next request is the head of the backlogged tenant
    with the least virtual token counter."""

    def __init__(self) -> None:
        self._lines: dict[str, PriorityQueue] = {}  # backlogged tenants only
        self.counters: dict[str, float] = {}
        self._live: dict[str, int] = {}  # sequences per tenant, waiting or running
        self._weights: dict[str, float] = {}  # of the tenants in _live
        self._idle: OrderedDict[str, None] = OrderedDict()  # tenants with none, oldest first
        self._last_left = 0.0  # the counter of the tenant whose request last left the line

    def __len__(self) -> int:
        return sum(len(line) for line in self._lines.values())

    def __iter__(self) -> Iterator[Sequence]:
        for line in self._lines.values():
            yield from line

    def add(self, seq: Sequence) -> None:
        tenant = seq.tenant
        self._live[tenant] = self._live.get(tenant, 0) + 1
        self._weights[tenant] = seq.weight
        self._idle.pop(tenant, None)
        if tenant not in self._lines:
            self.counters[tenant] = max(self.counters.get(tenant, 0.0), self._floor())
        self._line(tenant).add(seq)

    def requeue(self, seq: Sequence) -> None:
        """Back to its place in its tenant's line, with no lift: it was being served."""
        self._line(seq.tenant).add(seq)

    def remove(self, seq: Sequence) -> None:
        line = self._lines[seq.tenant]
        line.remove(seq)
        if not line:
            del self._lines[seq.tenant]
            self._last_left = self.counters[seq.tenant]

    def peek(self) -> Sequence | None:
        if not self._lines:
            return None
        tenant = min(self._lines, key=lambda t: (self.counters[t], self._lines[t].peek().arrival_index))
        return self._lines[tenant].peek()

    def charge(self, seq: Sequence, num_tokens: int) -> None:
        self.counters[seq.tenant] += num_tokens / seq.weight

    def forget(self, seq: Sequence) -> None:
        """seq has finished: a tenant with nothing live keeps its counter among the idle."""
        tenant = seq.tenant
        self._live[tenant] -= 1
        if self._live[tenant]:
            return
        del self._live[tenant], self._weights[tenant]
        self._idle[tenant] = None
        while len(self._idle) > MAX_IDLE_TENANTS:
            del self.counters[self._idle.popitem(last=False)[0]]

    def may_preempt(self, waiting: Sequence, running: Sequence) -> bool:
        """Only a more urgent request, and across tenants only from one served more than its
        own: priority never buys one tenant service at another's fair share."""
        if running.priority <= waiting.priority:
            return False
        return running.tenant == waiting.tenant or self.counters[running.tenant] > self.counters[waiting.tenant]

    def victim_key(self, seq: Sequence) -> tuple[float, int, int]:
        return self.counters[seq.tenant], *_rank(seq)

    def underserved_head(self, num_slots: int) -> Sequence | None:
        """The head of the least-served backlogged tenant that runs at least one sequence
        fewer than its share of num_slots, while another runs at least one more than its own
        (with one tenant, or shares kept, nobody goes ahead)."""
        over = self._over_shares(num_slots)
        if max(over.values(), default=0.0) < 1:
            return None
        tenants = [t for t in self._lines if over[t] <= -1]
        if not tenants:
            return None
        return self._lines[min(tenants, key=lambda t: (self.counters[t], self._lines[t].peek().arrival_index))].peek()

    def slot_victim(self, running: list[Sequence], num_slots: int) -> Sequence | None:
        """The lowest-ranked (newest) sequence of the tenant furthest over its share, where
        that tenant runs at least one more than its share: after it leaves, neither tenant
        has cause to take the slot back."""
        over = self._over_shares(num_slots)
        candidates = [s for s in running if over[s.tenant] >= 1]
        return max(candidates, key=lambda s: (over[s.tenant], *_rank(s)), default=None)

    def _over_shares(self, num_slots: int) -> dict[str, float]:
        """The sequences each live tenant runs past its share of num_slots (negative: short
        of it), the total weight summed once: the scheduler asks every step."""
        total_weight = sum(self._weights.values())
        return {tenant: num_live - len(self._lines.get(tenant, ())) - num_slots * self._weights[tenant] / total_weight
                for tenant, num_live in self._live.items()}

    def _line(self, tenant: str) -> PriorityQueue:
        if tenant not in self._lines:
            self._lines[tenant] = PriorityQueue()
        return self._lines[tenant]

    def _floor(self) -> float:
        if self._lines:
            return min(self.counters[t] for t in self._lines)
        return self._last_left


def make_queue(policy: SchedulingPolicy) -> FcfsQueue | PriorityQueue | FairQueue:
    return {"fcfs": FcfsQueue, "priority": PriorityQueue, "fair": FairQueue}[policy]()
