"""Per-request state as the engine sees it: token ids, KV block table, status, timings."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from engine.request.outputs import RequestFailedError
from engine.sampling.grammar import GrammarState
from engine.sampling.logits_controls import TokenCounts
from engine.request.token_logprob import TokenLogprob
from engine.request.sampling_params import SamplingParams
from engine.request.scheduling import Scheduling

if TYPE_CHECKING:
    from engine.speculative.speculator import DraftState


class SequenceStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    FINISHED = enum.auto()


@dataclass
class RequestTimings:
    """Monotonic timestamps (time.monotonic()) of a request's life, for TTFT breakdowns."""

    arrival: float
    first_scheduled: float | None = None
    first_token: float | None = None

    @property
    def queue_wait_s(self) -> float | None:
        return None if self.first_scheduled is None else self.first_scheduled - self.arrival

    @property
    def prefill_s(self) -> float | None:
        """From first scheduled to first token: the prefill's share of TTFT."""
        if self.first_token is None or self.first_scheduled is None:
            return None
        return self.first_token - self.first_scheduled

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrival


class Sequence:
    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, block_size: int,
                 eos_token_id: int | None = None, scheduling: Scheduling = Scheduling()):
        self.request_id = request_id
        self.priority, self.tenant, self.weight = scheduling.priority, scheduling.tenant, scheduling.weight
        self.arrival_index = 0  # its place in arrival order, set by the scheduler
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.params = params
        self.block_size = block_size
        self.status = SequenceStatus.WAITING
        self.block_table: list[int] = []
        self.block_hashes: list[int] = []  # chained hashes of the full, computed blocks
        self.prompt_hashes: list[int] | None = None  # of the prompt's blocks (BlockManager.prompt_hashes)
        self.num_computed_tokens = 0  # tokens whose K/V are in the cache
        self.finish_reason: str | None = None
        self.timings = RequestTimings(arrival=time.monotonic())
        self.generator: torch.Generator | None = None  # per-request RNG when seeded
        # The tokens that end this sequence; min_tokens keeps them from being sampled.
        eos = () if eos_token_id is None or params.ignore_eos else (eos_token_id,)
        self.stop_token_ids: tuple[int, ...] = tuple(dict.fromkeys(eos + params.stop_token_ids))
        self.token_counts: TokenCounts | None = None  # for penalties, built on first use
        # Where the output is constrained (structured outputs): the grammar's state after the
        # output so far. It moves only as tokens are appended, so a preempted sequence keeps it.
        self.grammar: GrammarState | None = None
        # What failed this sequence alone inside a step (its grammar's mask, say): the step's
        # postprocess ends it with finish_reason "error" instead of appending its token.
        self.failure: Exception | None = None
        # Logprobs, where the request asks for them: of each prompt token given its prefix
        # (the first has none), filled in as prefill chunks compute them; of the output so far.
        self.prompt_logprobs: list[TokenLogprob | None] | None = None if params.prompt_logprobs is None else [None]
        self.cumulative_logprob: float | None = None if params.logprobs is None else 0.0
        # Speculative decoding: the tokens proposed after the last one, verified in this step's
        # rows beside it (set by the scheduler, cleared once the step is done), and the proposer.
        self.draft_token_ids: list[int] = []
        self.draft_state: DraftState | None = None
        # The LoRA adapter named (None: the base model), the slot it holds while running (0: none),
        # and its prefix cache seed (None: the base model's): no two adapters share KV blocks.
        self.lora_name: str | None = None
        self.lora_slot = 0
        self.cache_salt: int | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Still has prompt positions whose logprobs are to be computed."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < self.num_prompt_tokens

    def append_token(self, token_id: int, logprob: TokenLogprob | None) -> None:
        if self.grammar is not None and not self.grammar.accept(token_id):
            raise RequestFailedError(f"token {token_id} drawn outside its grammar's mask")
        self.token_ids.append(token_id)
        if self.token_counts is not None:
            self.token_counts.add(token_id)
        if logprob is not None:
            self.cumulative_logprob += logprob.logprob

    @property
    def num_blocks(self) -> int:
        return len(self.block_table)

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def block_tokens(self, index: int) -> list[int]:
        start = index * self.block_size
        return self.token_ids[start : start + self.block_size]
