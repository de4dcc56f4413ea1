"""Batch tensors in, model forward, sampled tokens (and logprobs where asked) out."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch

import engine.core.kv_pool as kv_pool
from engine.model.attention import AttentionGroup, AttentionMetadata
from engine.model.cuda_graphs import CudaGraphDecode
from engine.model.decode_graph import DecodeGraph, layer_caches
from engine.lora.lora_linear import LoraBatch
from engine.lora.slots import LoraSlots
from engine.sampling.grammar_mask import GrammarMask
from engine.sampling.logits_controls import LogitsControls
from engine.sampling.logprobs import PromptScoring, TokenLogprob, token_logprobs
from engine.model.gpt2 import GPT2LMHead
from engine.sampling.sampler import Sampler, SamplingBatch, seeded_uniform
from engine.speculative.acceptance import accepted_tokens, rewind
from engine.core.scheduler import ScheduledBatch
from engine.core.sequence import Sequence


@dataclass
class ModelOutput:
    """One step's results: per sampling sequence its token and (where asked) its logprob, a
    speculating sequence once per token it keeps, in order; per sequence scoring its prompt,
    the logprobs of the prompt positions this step computed."""

    sampled: list[Sequence]
    token_ids: list[int]
    logprobs: list[TokenLogprob | None]
    prompt_logprobs: list[tuple[Sequence, list[TokenLogprob]]] = field(default_factory=list)
    mask_s: float | None = None  # structured outputs' masks, where a row had one
    num_accepted: dict[Sequence, int] = field(default_factory=dict)  # per speculating sequence, proposals kept


def _samples(seq: Sequence, num_new: int) -> bool:
    """Whether seq samples this step: its last known token (and any proposals after it) is
    computed, and it generates."""
    return seq.num_computed_tokens + num_new == seq.num_tokens + len(seq.draft_token_ids) and seq.params.max_tokens > 0


def _num_sampled_rows(seq: Sequence) -> int:
    """A speculating sequence samples at its last token and at each proposal: k + 1 rows."""
    return 1 + len(seq.draft_token_ids)


class ModelRunner:
    def __init__(self, model: GPT2LMHead, num_blocks: int, block_size: int, sampler: Sampler,
                 decode_graph: DecodeGraph | CudaGraphDecode | None = None, graph_prefill_tokens: int = 0):
        self.model = model
        self.decode_graph = decode_graph
        self.graph_prefill_tokens = graph_prefill_tokens  # EngineConfig's
        self.block_size = block_size
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        config = model.config
        # One tensor for every layer's k and v (the decode graph writes them all at once);
        # the model reads and writes each layer's pair through views of it.
        shape = (config.n_layer, 2, config.n_head, num_blocks, block_size, config.n_embd // config.n_head)
        self.kv_pool = kv_pool.allocate(shape, self.dtype, self.device)
        self.kv_caches = layer_caches(self.kv_pool)
        self.sampler = sampler
        self.lora: LoraSlots | None = None  # the adapters' slots, where LoRA is on (max_loras > 0)

    @staticmethod
    def kv_bytes_per_block(model_config, block_size: int, dtype: torch.dtype) -> int:
        return 2 * model_config.n_layer * block_size * model_config.n_embd * dtype.itemsize

    def run(self, batch: ScheduledBatch) -> ModelOutput:
        """One forward over the batch; returns what the sequences sampled and scored.

        A sequence samples when this step computes its last known token (a prefill chunk
        that stops short of the prompt's end samples nothing; a prompt-only request,
        max_tokens 0, never samples). A sequence that wants prompt logprobs also gets the
        logits of each prompt position this step computes. A speculating sequence's rows,
        its last token and its proposals, run as a prefill chunk's, and every one samples.
        """
        # Single-token queries first: they attend as the decode group.
        order = sorted(range(len(batch.seqs)), key=lambda i: batch.num_new_tokens[i] > 1)
        seqs = [batch.seqs[i] for i in order]
        num_new = [batch.num_new_tokens[i] for i in order]
        sampling = [s for s, n in zip(seqs, num_new) if _samples(s, n)]
        scoring = PromptScoring.of(seqs, num_new)
        indices = self._logits_indices(seqs, num_new)
        if scoring is not None:
            indices = torch.cat([self._tensor(scoring.flat_indices), indices])
        logits, greedy = self._forward(seqs, num_new, indices, graph=scoring is None and self._fits_graph(num_new))
        num_scored = 0 if scoring is None else len(scoring.flat_indices)
        output = self._sample(sampling, logits[num_scored:], None if greedy is None else greedy[num_scored:])
        if scoring is not None:
            output.prompt_logprobs = scoring.logprobs(logits[:num_scored], self.device)
        return output

    def _fits_graph(self, num_new: list[int]) -> bool:
        """Decode steps, and steps of up to graph_prefill_tokens with prefill chunks among
        them, take the compiled graph where there is one. A longer step's time is its
        products, which the eager path runs as well, and the graph's attention reads a
        chunk's rows one by one."""
        if self.decode_graph is None:
            return False
        return all(n == 1 for n in num_new) or sum(num_new) <= self.graph_prefill_tokens

    def _forward(self, seqs: list[Sequence], num_new: list[int], indices: torch.Tensor,
                 graph: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits of the rows `indices` picks; on the compiled graph (`graph`), also each
        row's greedy token (None from the eager path), and the logits in the model's dtype
        (float32 from the eager path)."""
        input_ids, positions, slots = self._flat_tokens(seqs, num_new)
        lora_slots = self._lora_slots(seqs, num_new)
        if not graph:
            meta = self._attention_metadata(seqs, num_new, slots)
            lora = None if lora_slots is None else LoraBatch.of(lora_slots, self.lora.stacks,
                                                                 "kernel" if self.lora.kernel else "dense")
            return self.model(input_ids, positions, self.kv_caches, meta, logits_indices=indices, lora=lora), None
        rows = [(seq, first) for seq, n, first in zip(seqs, num_new, itertools.accumulate([0] + num_new)) for _ in range(n)]
        tables = self._block_tables([seq for seq, _ in rows])
        first_rows = self._tensor([first for _, first in rows])
        return self.decode_graph(input_ids, positions, self.kv_pool, tables, slots, first_rows, indices, lora_slots)

    def _lora_slots(self, seqs: list[Sequence], num_new: list[int]) -> torch.Tensor | None:
        """Each token's adapter slot (0: the base model's), where a row has an adapter: a step
        of base rows alone runs the base model as it is, eager or on the graph."""
        if self.lora is None or not any(seq.lora_slot for seq in seqs):
            return None
        return self._tensor([seq.lora_slot for seq, n in zip(seqs, num_new) for _ in range(n)])

    def _sample(self, seqs: list[Sequence], logits: torch.Tensor, greedy: torch.Tensor | None) -> ModelOutput:
        if not seqs:
            return ModelOutput([], [], [])
        rows = [seq for seq in seqs for _ in range(_num_sampled_rows(seq))]
        batch = self._sampling_batch(rows)
        seeded = {seq: seq.generator.get_state() for seq in seqs
                  if seq.draft_token_ids and seq.generator is not None and not seq.params.is_greedy}
        tokens = self.sampler(logits, batch, greedy)
        logprobs = self._logprobs(rows, logits, tokens)
        output = self._verify(seqs, tokens.tolist(), logprobs, seeded)
        output.mask_s = None if batch.grammar is None else batch.grammar.seconds
        return output

    def _logprobs(self, rows: list[Sequence], logits: torch.Tensor, tokens: torch.Tensor) -> list[TokenLogprob | None]:
        asked = [row for row, s in enumerate(rows) if s.params.logprobs is not None]
        logprobs: list[TokenLogprob | None] = [None] * len(rows)
        if asked:
            index = self._tensor(asked)
            computed = token_logprobs(logits[index].float(), tokens[index], [rows[row].params.logprobs for row in asked])
            for row, logprob in zip(asked, computed):
                logprobs[row] = logprob
        return logprobs

    @staticmethod
    def _verify(seqs: list[Sequence], tokens: list[int], logprobs: list[TokenLogprob | None],
                seeded: dict[Sequence, torch.Tensor]) -> ModelOutput:
        """Each sequence's tokens from its rows' draws: a speculating one keeps its proposals
        up to the first its draws reject (engine/speculative/acceptance.py)."""
        output, row = ModelOutput([], [], []), 0
        for seq in seqs:
            num_rows = _num_sampled_rows(seq)
            kept = accepted_tokens(seq.draft_token_ids, tokens[row : row + num_rows])
            output.sampled += [seq] * len(kept)
            output.token_ids += kept
            output.logprobs += logprobs[row : row + len(kept)]
            if seq.draft_token_ids:
                output.num_accepted[seq] = len(kept) - 1
            if seq in seeded:
                rewind(seq.generator, seeded[seq], len(kept), seeded_uniform)
            row += num_rows
        return output

    def _flat_tokens(self, seqs: list[Sequence], num_new: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The step's tokens, their positions and their KV slots, sequence after sequence."""
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        for seq, n in zip(seqs, num_new):
            start = seq.num_computed_tokens
            input_ids += seq.token_ids[start : start + n] + seq.draft_token_ids
            positions += range(start, start + n)
            slots += (seq.block_table[p // self.block_size] * self.block_size + p % self.block_size for p in range(start, start + n))
        return self._tensor(input_ids), self._tensor(positions), self._tensor(slots)

    def _attention_metadata(self, seqs: list[Sequence], num_new: list[int], slots: torch.Tensor) -> AttentionMetadata:
        """The eager path's: decodes (one token each, first) in one group, prefill chunks in another."""
        num_decodes = sum(n == 1 for n in num_new)
        return AttentionMetadata(
            slot_mapping=slots,
            num_decodes=num_decodes,
            decode=self._decode_group(seqs[:num_decodes]) if num_decodes else None,
            prefill=self._prefill_group(seqs[num_decodes:], num_new[num_decodes:], num_decodes) if num_decodes < len(seqs) else None,
            native_write=self.decode_graph is not None and self.decode_graph.native_write,
        )

    def _decode_group(self, seqs: list[Sequence]) -> AttentionGroup:
        context_lens = self._tensor([s.num_computed_tokens + 1 for s in seqs])
        tables = self._block_tables(seqs)
        keys = torch.arange(tables.shape[1] * self.block_size, device=self.device)
        mask = (keys.unsqueeze(0) < context_lens.unsqueeze(1)).unsqueeze(1)
        return AttentionGroup(tables, mask, None, None)

    def _prefill_group(self, seqs: list[Sequence], num_new: list[int], offset: int) -> AttentionGroup:
        max_q = max(num_new)
        starts = [s.num_computed_tokens for s in seqs]
        q_pos = torch.arange(max_q, device=self.device).unsqueeze(0)
        query_valid = q_pos < self._tensor(num_new).unsqueeze(1)
        flat_starts = torch.tensor([offset + sum(num_new[:i]) for i in range(len(seqs))], device=self.device)
        query_index = torch.where(query_valid, flat_starts.unsqueeze(1) + q_pos, 0)
        tables = self._block_tables(seqs)
        keys = torch.arange(tables.shape[1] * self.block_size, device=self.device)
        abs_pos = self._tensor(starts).unsqueeze(1) + q_pos  # [P, Q] position of each query
        # Causal over the sequence's whole context; padded query rows see key 0 (never NaN).
        mask = (keys[None, None, :] <= abs_pos[:, :, None]) & query_valid[:, :, None]
        mask[:, :, 0] = True
        return AttentionGroup(tables, mask, query_index, query_valid)

    def _block_tables(self, seqs: list[Sequence]) -> torch.Tensor:
        width = max(s.num_blocks for s in seqs)
        return self._tensor([s.block_table + [0] * (width - s.num_blocks) for s in seqs])

    def _logits_indices(self, seqs: list[Sequence], num_new: list[int]) -> torch.Tensor:
        indices, end = [], 0
        for seq, n in zip(seqs, num_new):
            end += n
            if _samples(seq, n):
                indices += range(end - _num_sampled_rows(seq), end)
        return self._tensor(indices)

    def _sampling_batch(self, seqs: list[Sequence]) -> SamplingBatch:
        vocab_size = self.model.config.vocab_size
        controls = LogitsControls.from_seqs(seqs, vocab_size, self.device)
        return SamplingBatch.from_params([s.params for s in seqs], [s.generator for s in seqs], vocab_size,
                                         self.device, controls, GrammarMask.of(seqs, vocab_size))

    def _tensor(self, values) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=self.device)

