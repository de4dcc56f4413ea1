"""Token sampling, vectorised over the batch.

Structured outputs' token masks (engine/sampling/grammar_mask.py) go first: -inf for every
token a constrained row's grammar does not allow next. Logit controls (logit_bias,
min_tokens, penalties: engine/sampling/logits_controls.py) then change the rows that use them. Greedy rows then take the argmax. Other rows are scaled by
temperature, filtered by min_p (tokens less likely than min_p x the row's most likely one),
then by top-k and top-p (only when some row asks for it, over its 1024 most likely tokens
where they hold the mass asked for), and sampled by inverting their CDF: one uniform draw
per row, found in the row's cumulative sum. That is one random number per row where an
exponential race (or torch.multinomial) draws one per vocabulary entry, on CPU a cost
next to the model's forward's. On CPU the draw is
our C++ kernel (engine/kernels/csrc/sampling.cpp) where it builds: the same inverse CDF in two
passes over a row, with no cumulative sum over the vocabulary. Seeded rows draw their
uniform from their own generator, so a seeded request gets the same tokens whatever else is
in the batch.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.kernels.inductor import compile_for
from engine.sampling.grammar_mask import GrammarMask
from engine.sampling.logits_controls import LogitsControls
from engine.request.sampling_params import SamplingParams


@dataclass
class SamplingBatch:
    temperatures: torch.Tensor  # [S] float32, 0 for greedy rows
    top_ps: torch.Tensor  # [S] float32
    top_ks: torch.Tensor  # [S] int64, vocab size where disabled
    min_ps: torch.Tensor | None  # [S] float32; None when no sampled row sets min_p
    generators: list[torch.Generator | None]  # per row: its own when seeded
    all_greedy: bool
    needs_filter: bool
    controls: LogitsControls | None = None  # None when no row uses any
    grammar: GrammarMask | None = None  # None when no row is constrained

    @classmethod
    def from_params(cls, params: list[SamplingParams], generators: list[torch.Generator | None], vocab_size: int,
                    device: torch.device, controls: LogitsControls | None = None,
                    grammar: GrammarMask | None = None) -> SamplingBatch:
        sampled = [p for p in params if not p.is_greedy]
        top_ks = [p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params]  # past it: all of it
        return cls(
            temperatures=torch.tensor([0.0 if p.is_greedy else p.temperature for p in params], dtype=torch.float32,
                                      device=device),
            top_ps=torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device),
            top_ks=torch.tensor(top_ks, dtype=torch.int64, device=device),
            min_ps=torch.tensor([p.min_p for p in params], dtype=torch.float32, device=device)
            if any(p.min_p > 0 for p in sampled) else None,
            generators=generators,
            all_greedy=not sampled,
            needs_filter=any(0 < p.top_k < vocab_size or p.top_p < 1 for p in sampled),
            controls=controls,
            grammar=grammar,
        )


def draw(logits: torch.Tensor, temperatures: torch.Tensor, uniforms: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's argmax, and a token drawn from softmax(logits / temperature) at its uniform
    [S, 1]. A few passes over [S, V] that torch.compile fuses into one or two kernels."""
    probs = torch.softmax(logits / temperatures.unsqueeze(1), dim=-1)
    return logits.argmax(dim=-1), _sample_inverse_cdf(probs, uniforms)


Draw = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


class Sampler:
    def __init__(self, seed: int, device: torch.device, compiled: bool = False, native: Draw | None = None):
        """compiled: `draw` through torch.compile (compile_decode); warm_up compiles it.
        native: our C++ draw (torch.ops.rayinfer.draw), in place of either; with it, greedy
        rows take our argmax too, and neither needs float32 logits."""
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self.native = native
        self.is_compiled = compiled and native is None
        if native is not None:
            self._draw, self._argmax = native, torch.ops.rayinfer.argmax
        else:
            self._draw = compile_for(device, draw, dynamic=True) if compiled else draw
            self._argmax = functools.partial(torch.argmax, dim=-1)

    @torch.inference_mode()
    def warm_up(self, vocab_size: int) -> None:
        """Compile the draw now, on scratch rows, rather than in the first sampled step."""
        device = self.generator.device
        self._draw_rows(torch.zeros(2, vocab_size, device=device), torch.ones(2, device=device),
                        torch.zeros(2, 1, device=device))

    # Inference mode throughout: the draw's inputs are then inference tensors whatever made
    # them (the model, the controls, the filters), and dynamo, which guards on that, keeps one graph.
    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, batch: SamplingBatch, greedy: torch.Tensor | None = None) -> torch.Tensor:
        """logits [S, V] (float32, or the model's dtype: converted here where read) -> token
        ids [S]. Never changes logits in place. `greedy`: each row's argmax where the caller
        has it already (the compiled decode graph's)."""
        if batch.grammar is not None:  # first: bias and penalties then move only allowed tokens
            logits = batch.grammar.apply(logits)
            greedy = None
        if batch.controls is not None:
            logits = batch.controls.apply(logits.float())
            greedy = None  # the controls may have moved it
        if batch.all_greedy:
            return self._argmax(logits) if greedy is None else greedy
        is_greedy = batch.temperatures == 0
        temperatures = torch.where(is_greedy, 1.0, batch.temperatures)
        filters = batch.min_ps is not None or batch.needs_filter
        if self.native is None or filters:  # our draw reads the model's dtype; torch's and the filters want float32
            logits = logits.float()
        if filters:  # filters see the scaled logits
            logits, temperatures = logits / temperatures.unsqueeze(1), torch.ones_like(temperatures)
            if batch.min_ps is not None:
                logits = _filter_min_p(logits, batch.min_ps)
            if batch.needs_filter:
                logits = _filter_top_k_top_p(logits, batch.top_ks, batch.top_ps)
        # Scaling and the filters keep each row's argmax where it was: it is still the greedy token.
        row_greedy, sampled = self._draw_rows(logits, temperatures,
                                              self._uniforms(len(logits), batch.generators, logits.device))
        return torch.where(is_greedy, row_greedy if greedy is None else greedy, sampled)

    def _draw_rows(self, logits: torch.Tensor, temperatures: torch.Tensor,
                   uniforms: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """draw; compiled, one row is padded to two: dynamo would specialise a graph for one."""
        if len(logits) != 1 or not self.is_compiled:
            return self._draw(logits, temperatures, uniforms)
        greedy, sampled = self._draw(logits.repeat(2, 1), temperatures.repeat(2), uniforms.repeat(2, 1))
        return greedy[:1], sampled[:1]

    def _uniforms(self, num_rows: int, generators: list[torch.Generator | None], device: torch.device) -> torch.Tensor:
        """[S, 1] uniforms in [0, 1): from each seeded row's own generator, else the engine's."""
        uniforms = torch.rand(num_rows, 1, generator=self.generator, device=device)
        for row, generator in enumerate(generators):
            if generator is not None:
                uniforms[row] = seeded_uniform(generator)
        return uniforms


def seeded_uniform(generator: torch.Generator) -> torch.Tensor:
    """A seeded row's draw: one call on its generator per row (speculation rewinds by it)."""
    return torch.rand(1, generator=generator, device=generator.device)


def _filter_min_p(logits: torch.Tensor, min_ps: torch.Tensor) -> torch.Tensor:
    """-inf where p < min_p * p_max, compared in log space: logit < max_logit + log(min_p).
    A row with min_p 0 compares against -inf and keeps everything."""
    threshold = logits.amax(dim=-1, keepdim=True) + min_ps.log().unsqueeze(1)
    return logits.masked_fill(logits < threshold, float("-inf"))


def _sample_inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """The first token whose cumulative probability exceeds u * total: token i with
    probability p_i. `right=True` never lands on a zero-probability (filtered) token, whose
    cumulative sum equals its predecessor's."""
    cdf = probs.cumsum(dim=-1)
    total = cdf[:, -1:]  # not 1.0: float32 sums drift by ~1e-6
    # u * total can round up to total itself, past every token: keep it strictly below.
    targets = torch.minimum(uniforms * total, torch.nextafter(total, torch.zeros_like(total)))
    # A row of NaNs (which the limits keep out) would search past the end: a token id the
    # next step cannot embed, failing every request in it. Clamped, it stays in the vocabulary.
    return torch.searchsorted(cdf, targets, right=True).squeeze(1).clamp_(max=probs.shape[-1] - 1)


# Top-p and top-k keep the few most likely tokens. Ranking only this many (torch.topk) rather
# than sorting all 50257 makes them cheap for a peaked distribution (a trained model's); a
# row whose top_p reaches past these candidates' mass (a flat distribution: random weights)
# falls back to the full sort and pays for the topk too.
_NUM_CANDIDATES = 1024


def _filter_top_k_top_p(logits: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor) -> torch.Tensor:
    """-inf outside each row's top-k, then outside the smallest prefix whose mass reaches top_p."""
    vocab = logits.shape[-1]
    limited_k = top_ks[top_ks < vocab]
    k = min(vocab, max(_NUM_CANDIDATES, int(limited_k.max()) if len(limited_k) else 0))
    row_lse = torch.logsumexp(logits, dim=-1)  # each row's whole mass, once
    if k == vocab:
        return _filter_sorted(logits, *logits.sort(dim=-1, descending=True), top_ks, top_ps, row_lse)
    values, order = logits.topk(k, dim=-1)
    filtered = _filter_sorted(logits, values, order, top_ks, top_ps, row_lse)
    candidates_mass = (torch.logsumexp(values, dim=-1) - row_lse).exp()
    short = (top_ks > k) & (candidates_mass < top_ps)  # top-p reaches past the candidates
    if short.any():
        rows = short.nonzero().squeeze(1)
        row_logits = logits[rows]  # one copy of these rows, sorted and filtered
        ranked = row_logits.sort(dim=-1, descending=True)
        filtered[rows] = _filter_sorted(row_logits, *ranked, top_ks[rows], top_ps[rows], row_lse[rows])
    return filtered


def _filter_sorted(logits: torch.Tensor, sorted_logits: torch.Tensor, order: torch.Tensor,
                   top_ks: torch.Tensor, top_ps: torch.Tensor, row_lse: torch.Tensor) -> torch.Tensor:
    """Filters each row's ranked tokens: its whole vocabulary, or its top candidates where
    they hold its top-k or its top-p mass. Tokens not in `order` are dropped. row_lse: the
    logsumexp of each row's whole vocabulary."""
    ranks = torch.arange(sorted_logits.shape[-1], device=logits.device).unsqueeze(0)
    drop = ranks >= top_ks.unsqueeze(1)
    masked = sorted_logits.masked_fill(drop, float("-inf"))
    # Each token's share of the row's mass after the top-k cut: of the top-k where the row
    # has one, else of the whole vocabulary (not just of the candidates).
    has_top_k = top_ks <= sorted_logits.shape[-1]
    norm = torch.where(has_top_k, torch.logsumexp(masked, dim=-1), row_lse)
    probs = (masked - norm.unsqueeze(1)).exp()
    # Keep the smallest prefix whose mass reaches top_p: drop a token when the mass before it does.
    drop |= (probs.cumsum(dim=-1) - probs) >= top_ps.unsqueeze(1)
    drop[:, 0] = False
    kept = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter_(-1, order, kept)
