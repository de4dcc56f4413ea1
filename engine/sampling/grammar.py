"""Structured outputs' grammars: each constraint compiled once against the model's tokenizer.

xgrammar (what vLLM and SGLang use) turns a JSON schema, a regex, an EBNF grammar or a list
of choices into a CompiledGrammar over the vocabulary; a request's GrammarMatcher (one per
sequence) walks it token by token and says which tokens may come next
(engine/sampling/grammar_mask.py). Compiled grammars are kept by their text, up to
MAX_CACHED_GRAMMARS, least recently used out first. Compiling takes milliseconds for the
usual schemas but has no bound, so the async front runs it on a thread of its own before
the request reaches the step loop (engine/frontend/async_engine.py).

JSON is compiled compact, as json.dumps writes it (", " and ": ", no other whitespace):
still any JSON value the schema allows, but a model cannot spend its tokens on
whitespace, and a schema's object has only the properties it lists (xgrammar's strict mode,
OpenAI's "strict": true), whatever the request's "strict" says. xgrammar's JSON strings take
raw control characters, which JSON forbids (json.loads refuses them): a JSON constraint's
rows never allow a token holding one (GrammarState.banned), and compact JSON needs none.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from engine.model.loader import load_tokenizer
from engine.request.constraint import Constraint
from engine.request.invalid_request import InvalidRequestError

if TYPE_CHECKING:  # imported where a constraint first needs it, not with every engine's start
    import xgrammar as xgr

MAX_CACHED_GRAMMARS = 256
_JSON_OBJECT_SCHEMA = '{"type": "object"}'
# xgrammar's errors start with where in its C++ they were raised: the client needs only why.
_ERROR_LOCATION = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: \(.*?\) is false: )?")


JSON_KINDS = ("json_schema", "json_object")


@dataclass
class GrammarState:
    """One sequence's place in its grammar. `banned`: a bitmask of the tokens its rows never
    allow beyond what the grammar says (for JSON: those holding a raw control character)."""

    matcher: xgr.GrammarMatcher
    banned: torch.Tensor | None = None  # [ceil(V / 32)] int32, a set bit bans its token

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Row `row` of bitmask: the tokens that may come next."""
        self.matcher.fill_next_token_bitmask(bitmask, row)
        if self.banned is not None:
            bitmask[row] &= ~self.banned

    def accept(self, token_id: int) -> bool:
        return self.matcher.accept_token(token_id)

    @property
    def is_terminated(self) -> bool:
        """Its end drawn: the stop token after a complete output."""
        return self.matcher.is_terminated()


@dataclass(frozen=True)
class CompileStats:
    num_compiles: int  # cache misses: grammars compiled
    compile_s: float  # their total time
    num_cache_hits: int


class GrammarCache:
    """Compiles and keeps grammars for one model's vocabulary; any thread may call it. The
    tokenizer is loaded on the first constrained request, not at engine start."""

    def __init__(self, model: str, vocab_size: int, eos_token_id: int, max_size: int = MAX_CACHED_GRAMMARS) -> None:
        """eos_token_id: the token that ends a complete output (the engine's EOS)."""
        self.model, self.vocab_size, self.eos_token_id, self.max_size = model, vocab_size, eos_token_id, max_size
        self._compiler: xgr.GrammarCompiler | None = None
        self._control_tokens: torch.Tensor | None = None  # for JSON: tokens holding a byte below 0x20
        self._grammars: OrderedDict[tuple[str, str], xgr.CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()
        self._num_compiles, self._compile_s, self._num_cache_hits = 0, 0.0, 0

    def compile(self, constraint: Constraint) -> xgr.CompiledGrammar:
        """The constraint's grammar, compiled now or earlier. Raises InvalidRequestError naming
        constraint.param where it does not compile (a bad schema, regex or grammar)."""
        with self._lock:
            grammar = self._grammars.get(constraint.key)
            if grammar is not None:
                self._grammars.move_to_end(constraint.key)
                self._num_cache_hits += 1
                return grammar
        compiler = self._tokenizer_compiler()
        started = time.perf_counter()
        grammar = _compile(compiler, constraint)
        with self._lock:
            self._num_compiles += 1
            self._compile_s += time.perf_counter() - started
            self._grammars[constraint.key] = grammar
            if len(self._grammars) > self.max_size:
                self._grammars.popitem(last=False)
        return grammar

    def state(self, constraint: Constraint, grammar: xgr.CompiledGrammar | None = None) -> GrammarState:
        """A new sequence's state at its grammar's start; `grammar`: compiled already, else now."""
        import xgrammar as xgr

        matcher = xgr.GrammarMatcher(grammar or self.compile(constraint))
        return GrammarState(matcher, self._control_tokens if constraint.kind in JSON_KINDS else None)

    def stats(self) -> CompileStats:
        with self._lock:
            return CompileStats(self._num_compiles, self._compile_s, self._num_cache_hits)

    def _tokenizer_compiler(self) -> xgr.GrammarCompiler:
        import xgrammar as xgr

        with self._lock:
            if self._compiler is None:
                info = xgr.TokenizerInfo.from_huggingface(load_tokenizer(self.model), vocab_size=self.vocab_size,
                                                          stop_token_ids=[self.eos_token_id])
                self._compiler = xgr.GrammarCompiler(info, cache_enabled=False)  # ours is the cache
                self._control_tokens = _bitmask_of(info, lambda token: any(byte < 0x20 for byte in token))
            return self._compiler


def _compile(compiler: xgr.GrammarCompiler, constraint: Constraint) -> xgr.CompiledGrammar:
    kind, spec = constraint.kind, constraint.spec
    try:
        if kind == "json_schema":
            return compiler.compile_json_schema(spec, any_whitespace=False)
        if kind == "json_object":
            return compiler.compile_json_schema(_JSON_OBJECT_SCHEMA, any_whitespace=False)
        if kind == "regex":
            return compiler.compile_regex(spec)
        if kind == "choice":
            return compiler.compile_grammar(choice_grammar(constraint.choices))
        return compiler.compile_grammar(spec)
    except (RuntimeError, ValueError, TypeError) as exc:
        why = _ERROR_LOCATION.sub("", str(exc).strip())
        raise InvalidRequestError(f"{constraint.param}: does not compile: {why}", constraint.param) from exc


def _bitmask_of(info: xgr.TokenizerInfo, picks) -> torch.Tensor:
    """[ceil(V / 32)] int32 with bit t set for each token t whose bytes `picks` takes."""
    import xgrammar as xgr

    bits = torch.zeros(xgr.get_bitmask_shape(1, info.vocab_size)[1] * 32, dtype=torch.bool)
    bits[[t for t, token in enumerate(info.decoded_vocab) if picks(token)]] = True
    weights = (1 << torch.arange(32, dtype=torch.int64))
    return (bits.view(-1, 32).long() * weights).sum(dim=1).to(torch.uint32).view(torch.int32)


def choice_grammar(choices: list[str]) -> str:
    """EBNF for exactly one of the strings: JSON's string escapes are EBNF's too."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)
