"""Continuous batching: which sequences run this step, and how many tokens each.

Each step spends a token budget (max_num_batched_tokens): running decodes first (one token
each), then running prefills continue, then waiting requests are admitted in the order of the
scheduling policy (engine/core/queue_policy.py: first come first served, by priority, or fair
shares between tenants) while budget, batch slots (max_num_seqs) and KV blocks last. A
prompt longer than what is left of the budget is prefilled in chunks over several steps, so it never stalls running decodes
for more than one step's worth of tokens. When a running sequence needs a block and none is
free, the newest not-yet-scheduled running sequence is preempted: its blocks are freed and
it goes back to the front of the waiting queue, to be recomputed later. Under the priority
and fair policies the victim is the lowest-ranked one instead, and a waiting request that
finds the batch full preempts running ones it outranks (recompute, as vLLM's priority policy).
Under the fair policy a tenant running fewer sequences than its share of the slots, while
another runs more, has its waiting requests prefilled in a step of their own before the
batch's decodes, taking where the batch is full the newest slot of the tenant over its share.

A waiting prompt whose leading blocks another prompt is computing right now (admitted this
step, or prefilling in chunks) and no cache holds yet waits, in its place in the queue, until
they are in the prefix cache, rather than computing them a second time: a burst of requests
on one new system prompt computes it once (those behind it are admitted meanwhile).

With speculative decoding (engine/speculative/), a running decode may verify tokens proposed
after its last one in the same step: 1 + k tokens, blocks for all of them. Proposals come
out of the step's budget and rows (the speculator's cap), and take only blocks beyond one
per running sequence, so they never preempt anything; where that leaves less, fewer.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.core.block_manager import BlockManager
from engine.core.queue_policy import SchedulingPolicy, make_queue
from engine.core.sequence import Sequence, SequenceStatus
from engine.speculative.speculator import Speculator

# Leading blocks a waiting prompt must share with one being computed to wait for it: a step
# of latency for it, against computing them twice.
MIN_SHARED_BLOCKS_TO_WAIT = 2

if TYPE_CHECKING:
    from engine.lora.registry import LoraRegistry


@dataclass
class ScheduledBatch:
    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    num_prompt_tokens: int = 0  # of the tokens scheduled, those in their prompts

    def add(self, seq: Sequence, num_new_tokens: int) -> None:
        """num_new_tokens counts seq.draft_token_ids, the proposals it verifies, if any."""
        self.seqs.append(seq)
        self.num_new_tokens.append(num_new_tokens)
        if seq.num_computed_tokens < seq.num_prompt_tokens:
            self.num_prompt_tokens += min(num_new_tokens, seq.num_prompt_tokens - seq.num_computed_tokens)

    @property
    def is_empty(self) -> bool:
        return not self.seqs


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 policy: SchedulingPolicy = "fcfs", speculator: Speculator | None = None):
        self.block_manager = block_manager
        self.speculator = speculator
        self._draft_rows_left = 0  # proposals the step being scheduled may still take
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting = make_queue(policy)
        self.running: list[Sequence] = []  # in admission order: the last is the newest
        self.num_preemptions = 0
        self._num_added = 0
        # LoRA adapters' slots (engine/lora/registry.py): a running sequence pins its adapter's,
        # and a waiting one whose adapter finds no slot is passed over until one frees.
        self.loras: LoraRegistry | None = None

    def add(self, seq: Sequence) -> None:
        seq.arrival_index = self._num_added
        self._num_added += 1
        self.waiting.add(seq)

    def remove(self, seq: Sequence) -> None:
        """Take seq out of the queues and give back its blocks (finish or abort)."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
            self._release_lora(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        self.waiting.forget(seq)
        seq.status = SequenceStatus.FINISHED

    def schedule(self) -> ScheduledBatch:
        self._preempt_for_waiting()
        batch = self._schedule_ahead()
        if batch.is_empty:
            batch = self._schedule_step()
        for seq, num_new in zip(batch.seqs, batch.num_new_tokens):
            self.waiting.charge(seq, num_new)
        return batch

    def _schedule_ahead(self) -> ScheduledBatch:
        """The fair policy's tenants short of their share of the slots (queue_policy.py) have
        their waiting requests prefilled in a step of their own, before the running decodes:
        a first token after one short step rather than a full batch's. Where the batch is
        full, each takes the slot of a sequence the policy names (preempted, recomputed later)."""
        batch, budget = ScheduledBatch(), self.max_num_batched_tokens
        while budget > 0 and (seq := self.waiting.underserved_head(self.max_num_seqs)) is not None:
            if len(self.running) >= self.max_num_seqs and not self._free_slot():
                break
            if not self._admit(seq, batch, budget):
                break
            budget -= batch.num_new_tokens[-1]
        return batch

    def _free_slot(self) -> bool:
        victim = self.waiting.slot_victim(self.running, self.max_num_seqs)
        if victim is not None:
            self._preempt(victim)
        return victim is not None

    def _schedule_step(self) -> ScheduledBatch:
        """Running decodes, running prefills, then waiting requests in the policy's order."""
        batch = ScheduledBatch()
        budget = self.max_num_batched_tokens
        if self.speculator is not None:
            num_decodes = sum(s.num_tokens - s.num_computed_tokens == 1 for s in self.running)
            self._draft_rows_left = self.speculator.row_budget(num_decodes)
        # Decodes (one token left to compute) before prefills still in progress.
        for seq in sorted(self.running, key=lambda s: s.num_tokens - s.num_computed_tokens > 1):
            if budget == 0:
                break
            if seq.status is SequenceStatus.RUNNING and self._schedule_running(seq, batch, budget):
                budget -= batch.num_new_tokens[-1]
        in_flight = self._blocks_in_flight()
        deferred: list[Sequence] = []
        while budget > 0 and self.waiting and len(self.running) < self.max_num_seqs:
            seq = self.waiting.peek()
            if self._waits_for_blocks(seq, in_flight) or not self._can_acquire_lora(seq):
                self.waiting.remove(seq)
                deferred.append(seq)
                continue
            if not self._admit(seq, batch, budget):
                break
            budget -= batch.num_new_tokens[-1]
            in_flight.update(self._uncommitted_prompt_blocks(seq))
        for seq in reversed(deferred):
            self.waiting.requeue(seq)
        return batch

    def _preempt_for_waiting(self) -> None:
        """Preempt running sequences the next waiting one outranks (the policy decides), until
        it would find a batch slot and KV blocks for its first chunk."""
        while (seq := self.waiting.peek()) is not None:
            outranked = [s for s in reversed(self.running) if self.waiting.may_preempt(seq, s)]
            if not outranked or self._has_room_for(seq):
                return
            self._preempt(max(outranked, key=self.waiting.victim_key))

    def _has_room_for(self, seq: Sequence) -> bool:
        """A slot, and blocks for seq's first chunk once every running sequence has taken
        what its known tokens need (no prefix hits counted: an upper bound)."""
        if len(self.running) >= self.max_num_seqs:
            return False
        bm = self.block_manager
        needed = sum(bm.num_new_blocks_needed(s, s.num_tokens) for s in self.running)
        first_chunk = min(seq.num_tokens, self.max_num_batched_tokens)
        return bm.can_allocate(needed + bm.num_new_blocks_needed(seq, first_chunk))

    def _blocks_in_flight(self) -> set[int]:
        """Keys of prompt blocks that running sequences are computing and have not cached yet."""
        in_flight: set[int] = set()
        for seq in self.running:
            if seq.num_computed_tokens < seq.num_prompt_tokens:
                in_flight.update(self._uncommitted_prompt_blocks(seq))
        return in_flight

    def _uncommitted_prompt_blocks(self, seq: Sequence) -> list[int]:
        if not self.block_manager.enable_prefix_caching:
            return []
        return self.block_manager.prompt_hashes(seq)[len(seq.block_hashes):]

    def _waits_for_blocks(self, seq: Sequence, in_flight: set[int]) -> bool:
        """Whether seq's prompt, past what the cache holds, begins with at least
        MIN_SHARED_BLOCKS_TO_WAIT blocks that are being computed now."""
        if not in_flight or seq.needs_prompt_logprobs:  # a prompt scored takes no cached blocks
            return False
        cached, shared = self.block_manager.hash_to_block_id, 0
        for block_hash in self.block_manager.prompt_hashes(seq):
            if block_hash in in_flight:
                shared += 1
            elif block_hash not in cached or shared:
                break
        return shared >= MIN_SHARED_BLOCKS_TO_WAIT

    def _schedule_running(self, seq: Sequence, batch: ScheduledBatch, budget: int) -> bool:
        num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
        drafts = self._drafts(seq, budget - num_new)  # within the free blocks: they never preempt
        num_new += len(drafts)
        needed = self.block_manager.num_new_blocks_needed(seq, seq.num_computed_tokens + num_new)
        while not self.block_manager.can_allocate(needed):
            victim = self._preemption_victim(batch)
            self._preempt(victim)
            if victim is seq:
                return False
        self.block_manager.allocate(seq, seq.num_computed_tokens + num_new)
        seq.draft_token_ids = drafts
        batch.add(seq, num_new)
        return True

    def _drafts(self, seq: Sequence, budget: int) -> list[int]:
        """Proposals for seq to verify this step, if it is a decode: within the step's budget
        and rows, and the free blocks beyond one per running sequence."""
        if self.speculator is None or seq.num_tokens - seq.num_computed_tokens != 1:
            return []
        bm = self.block_manager
        spare_blocks = max(bm.num_free_blocks - len(self.running), 0)
        free_slots = (seq.num_blocks + spare_blocks) * bm.block_size - seq.num_tokens
        drafts = self.speculator.propose(seq, min(budget, self._draft_rows_left, free_slots))
        self._draft_rows_left -= len(drafts)
        return drafts

    def _admit(self, seq: Sequence, batch: ScheduledBatch, budget: int) -> bool:
        first_time = seq.timings.first_scheduled is None
        if self.loras is not None and not self.loras.acquire(seq):
            return False
        seq.num_computed_tokens = self.block_manager.allocate_cached_prefix(seq)
        num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
        needed = self.block_manager.num_new_blocks_needed(seq, seq.num_computed_tokens + num_new)
        if not self.block_manager.can_allocate(needed):
            self.block_manager.free(seq)  # hand back the prefix hits; retry next step
            seq.num_computed_tokens = 0
            self._release_lora(seq)
            return False
        self.block_manager.allocate(seq, seq.num_computed_tokens + num_new)
        self.block_manager.record_prefix_lookup(seq.num_tokens, seq.num_computed_tokens)
        self.waiting.remove(seq)
        self.running.append(seq)
        seq.status = SequenceStatus.RUNNING
        if first_time:
            seq.timings.first_scheduled = time.monotonic()
        batch.add(seq, num_new)
        return True

    def _preemption_victim(self, batch: ScheduledBatch) -> Sequence:
        """The lowest-ranked running sequence not yet in the batch (fcfs: the newest admitted)."""
        scheduled = set(map(id, batch.seqs))
        return max((s for s in reversed(self.running) if id(s) not in scheduled), key=self.waiting.victim_key)

    def _can_acquire_lora(self, seq: Sequence) -> bool:
        return self.loras is None or seq.lora_name is None or self.loras.can_acquire(seq.lora_name)

    def _release_lora(self, seq: Sequence) -> None:
        if self.loras is not None:
            self.loras.release(seq)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._release_lora(seq)
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        self.waiting.requeue(seq)
        self.num_preemptions += 1
