"""Per-request sampling parameters, validated at construction.

Fields follow OpenAI's and vLLM's definitions. Every rule that needs only the parameters
is checked here, against the limits in engine/request/sampling_limits.py (which the HTTP bodies
declare too); the rules that need the model (token ids below the vocabulary size, prompt +
max_tokens within the context) live in engine/request/request_rules.py.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import cached_property

from engine.request.constraint import Constraint
from engine.request.invalid_request import InvalidRequestError
from engine.request.sampling_limits import (
    GREEDY_BELOW_TEMPERATURE, INT64_MIN, LOGIT_BIAS, LOGPROBS, MAX_STOP_STRINGS, MAX_TOKENS, MIN_P, MIN_TOKENS,
    NUM_SEQUENCES, PENALTY, REPETITION_PENALTY, SEED, TEMPERATURE, TOKEN_ID, TOP_K, TOP_P,
)


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16  # 0 only with prompt_logprobs: score the prompt, generate nothing
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 (or -1) disables top-k
    min_p: float = 0.0  # drop tokens less likely than min_p x the most likely one
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0  # EOS and stop_token_ids cannot be sampled before this many tokens
    # Penalties as vLLM applies them: presence and frequency over the tokens generated so
    # far (logit -= presence * [count > 0] + frequency * count); repetition (CTRL, as
    # Hugging Face) over prompt and generated tokens (positive logits / r, negative * r).
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit
    # Logprobs of the model's own distribution (log_softmax of the raw logits in float32,
    # before any penalty, bias, temperature or filter: vLLM's "raw_logprobs").
    logprobs: int | None = None  # per generated token: its logprob and the top-k; 0 = its own only
    prompt_logprobs: int | None = None  # per prompt token given its prefix (the first: None)
    # Several sequences per prompt: the caller submits fan_out()'s params, one request each,
    # and keeps the n with the highest cumulative logprob (best_of) or all n. A request the
    # engine runs is always one sequence (n == 1, best_of None or 1).
    n: int = 1
    best_of: int | None = None
    # Structured outputs: every token drawn keeps the output a prefix of something the
    # constraint allows, and the request ends ("stop") where the constraint says it is complete.
    constraint: Constraint | None = None

    def __post_init__(self) -> None:
        # Accept lists (and a lone string for stop) at the boundary, store tuples.
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop or ()))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        if isinstance(self.logit_bias, dict):  # a private copy: the params are frozen
            object.__setattr__(self, "logit_bias", dict(self.logit_bias))
        self.validate()

    def validate(self) -> None:
        """Raise InvalidRequestError naming the first field outside its limit. Construction
        runs it; the engine runs it again when it admits a request, for params that reached
        it without construction (unpickled from a Ray handle's caller, changed in place)."""
        self._validate()
        self._validate_controls()
        self._validate_logprobs()
        self._validate_constraint()

    def _validate(self) -> None:
        MAX_TOKENS.check("max_tokens", self.max_tokens)
        if self.max_tokens == 0 and self.prompt_logprobs is None:
            raise _invalid("max_tokens", "must be an integer >= 1 (0 only with prompt_logprobs, to score the prompt)")
        for name, bound in (("temperature", TEMPERATURE), ("top_p", TOP_P), ("top_k", TOP_K), ("min_p", MIN_P)):
            bound.check(name, getattr(self, name))
        if self.seed is not None:
            SEED.check("seed", self.seed)
        if len(self.stop) > MAX_STOP_STRINGS:
            raise _invalid("stop", f"holds at most {MAX_STOP_STRINGS} strings, got {len(self.stop)}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise _invalid("stop", "strings must be non-empty strings")
        if not all(TOKEN_ID.contains(t) for t in self.stop_token_ids):
            raise _invalid("stop_token_ids", f"must each be {TOKEN_ID.describe()}, got {list(self.stop_token_ids)}")

    def _validate_controls(self) -> None:
        if not MIN_TOKENS.contains(self.min_tokens) or self.min_tokens > self.max_tokens:
            raise _invalid("min_tokens", f"must be an integer in [0, max_tokens={self.max_tokens}], "
                                         f"got {self.min_tokens!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            PENALTY.check(name, getattr(self, name))
        REPETITION_PENALTY.check("repetition_penalty", self.repetition_penalty)
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise _invalid("logit_bias", f"must map token ids to numbers, got {type(self.logit_bias).__name__}")
            if not all(TOKEN_ID.contains(t) for t in self.logit_bias):
                raise _invalid("logit_bias", f"keys must be token ids, each {TOKEN_ID.describe()}")
            if not all(LOGIT_BIAS.contains(b) for b in self.logit_bias.values()):
                raise _invalid("logit_bias", f"values must each be {LOGIT_BIAS.describe()}")
        NUM_SEQUENCES.check("n", self.n)
        if self.best_of is not None and (not NUM_SEQUENCES.contains(self.best_of) or self.best_of < self.n):
            raise _invalid("best_of", f"must be an integer >= n ({self.n}), got {self.best_of!r}")

    def _validate_logprobs(self) -> None:
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                LOGPROBS.check(name, value)

    def _validate_constraint(self) -> None:
        if self.constraint is None:
            return
        if not isinstance(self.constraint, Constraint):
            raise _invalid("constraint", f"must be a Constraint, got {type(self.constraint).__name__}")
        if self.min_tokens > 0:  # the constraint alone says where the output may end
            raise _invalid("min_tokens", f"must be 0 with structured outputs ({self.constraint.param})")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW_TEMPERATURE

    @property
    def num_sequences(self) -> int:
        """How many sequences the caller runs for this prompt: best_of, else n."""
        return self.best_of or self.n

    @cached_property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    @cached_property
    def has_logit_controls(self) -> bool:
        """Whether the sampler must change this request's logits before temperature."""
        return self.has_penalties or bool(self.logit_bias) or self.min_tokens > 0

    @cached_property
    def logit_bias_items(self) -> tuple[tuple[int, ...], tuple[float, ...]]:
        """(token ids, biases) of logit_bias, for building the batch's index tensors."""
        items = (self.logit_bias or {}).items()
        return tuple(t for t, _ in items), tuple(float(b) for _, b in items)

    def fan_out(self) -> list[SamplingParams]:
        """The params of each sequence to run for this prompt: num_sequences of them, each
        one sequence (n = 1). A seeded request's i-th sequence gets seed + i (as vLLM does),
        so they differ yet reproduce. With best_of > n the engine must rank by cumulative
        logprob, so each sequence asks for logprobs (at least 0); the caller returns the
        logprobs only where the client asked for them."""
        if self.num_sequences == 1 and self.best_of is None:
            return [self]
        logprobs = self.logprobs if self.best_of is None or self.best_of == self.n else max(self.logprobs or 0, 0)
        return [
            dataclasses.replace(self, n=1, best_of=None, logprobs=logprobs, seed=nth_seed(self.seed, i))
            for i in range(self.num_sequences)
        ]


def nth_seed(seed: int | None, index: int) -> int | None:
    """The seed of a seeded request's index-th sequence: seed + index, wrapped within int64,
    so that the last seed a client may send still gives n seeds that differ."""
    return None if seed is None else (seed + index - INT64_MIN) % 2**64 + INT64_MIN


def select_best(cumulative_logprobs: list[float | None], n: int) -> list[int]:
    """Indices of the n sequences with the highest cumulative logprob, best first (best_of)."""
    if any(c is None for c in cumulative_logprobs):
        raise ValueError("ranking needs every sequence's cumulative_logprob: run fan_out()'s params")
    return sorted(range(len(cumulative_logprobs)), key=lambda i: -cumulative_logprobs[i])[:n]


def _invalid(param: str, rule: str) -> InvalidRequestError:
    return InvalidRequestError(f"{param} {rule}", param)
