"""The synchronous engine: add_request / step / abort. One step is schedule -> run -> postprocess."""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from engine.core.block_manager import BlockManager
from engine.config import EngineConfig, LinearsMode
from engine.kernels.cpu import cpu_features
from engine.model.cuda_graphs import CudaGraphDecode
from engine.model.decode_graph import DecodeGraph
from engine.model.graph_compile import BackgroundCompile
from engine.core.heap import limit_onednn_caches
from engine.core.kernel_choice import (apply_measured_choices, choose_graph_or_eager, decode_attention, lora_kernel,
                                       sampler_draw, small_batch_linear, use_forced_linear)
from engine.model.loader import ModelSource, load_state_dict, resolve_model
from engine.request.token_logprob import TokenLogprob
from engine.core.model_runner import ModelOutput, ModelRunner
from engine.model.gpt2 import GPT2LMHead
from engine.model.packed_linear import can_pack
from engine.model.progress import progress
from engine.request.invalid_request import InvalidRequestError
from engine.request.outputs import EngineStats, ModelInfo, StepOutput
from engine.request.request_rules import (
    check_context, check_kv_blocks, check_params, check_prompt, check_request_id_free, check_scheduling,
)
from engine.sampling.grammar import GrammarCache
from engine.sampling.sampler import Sampler, SamplingBatch
from engine.request.sampling_params import SamplingParams
from engine.request.scheduling import Scheduling
from engine.core.scheduler import ScheduledBatch, Scheduler
from engine.core.sequence import Sequence, SequenceStatus
from engine.speculative.speculator import Speculator
from engine.core.step_log import StepLog, StepRecord
from engine.core.step_threads import StepThreads
from engine.lora.registry import LoraInfo, LoraRegistry, LoraStats
from engine.lora.slots import LoraSlots

if TYPE_CHECKING:  # imported where a constraint first needs it, not with every engine's start
    import xgrammar as xgr

logger = logging.getLogger(__name__)

_DEFAULT_CPU_KV_GB = 2.0
_GPU_KV_FRACTION = 0.8  # of the memory free after loading weights
_TYPICAL_DECODE_BATCH = 32  # the rows the decode graph is compiled at (its heuristics' hint)


class LLMEngine:
    def __init__(self, config: EngineConfig, compile_in_background: bool = False,
                 on_compiled: Callable[[], None] | None = None):
        """compile_in_background: the CPU decode graph compiles on a thread of its own
        (engine/model/graph_compile.py) while steps run eagerly, and steps take it from the first
        step after it is ready (take_compiled_graph); otherwise it compiles here, before the
        engine serves. on_compiled: called on that thread when it is done."""
        self.config = config
        graphed = config.decode_graphed  # resolved where the engine runs: refuses cuda_graphs: true off CUDA
        limit_onednn_caches()
        self.step_threads = _set_up_threads(config)
        with progress(f"loading {config.model} ({config.weights} weights) and our C++ kernels"):
            source = resolve_model(config.model, config.weights)
            model = use_forced_linear(config, build_model(source, config.torch_dtype, config.torch_device, config.seed,
                                                          config.linears, few_rows=small_batch_linear(config)))
        hf = source.config
        self.max_model_len = min(config.max_model_len or hf.n_positions, hf.n_positions)
        self.eos_token_id = hf.eos_token_id if hf.eos_token_id is not None else hf.vocab_size - 1
        self.model_info = self._model_info(source)
        num_blocks = self._num_kv_blocks(model)
        self.block_manager = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.loras = self._lora_registry(model)
        self.runner = self._runner(model, num_blocks, graphed)
        self.runner.lora = None if self.loras is None else self.loras.slots
        self._compile = self._start_compile(on_compiled) if compile_in_background else None
        if self._compile is None:
            self.runner.decode_graph, self.runner.sampler = self._ready(self.runner.decode_graph)
        # the budget follows the graph steps take: eager steps until it is compiled, or where it cannot compile
        step_tokens = config.step_tokens(cpu_graph=isinstance(self.runner.decode_graph, DecodeGraph))
        self.speculator = None if config.speculative is None else Speculator(config.speculative, self.max_model_len)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, step_tokens, config.scheduling_policy,
                                   self.speculator)
        self.scheduler.loras = self.loras
        self._seqs: dict[str, Sequence] = {}
        self.step_log = StepLog()  # the replica's metrics drain it
        self._num_prompt_tokens = self._num_generated_tokens = self._num_constrained_requests = 0
        # Structured outputs' grammars; any thread may compile (AsyncEngine does, off the step loop).
        self.grammars = GrammarCache(config.model, hf.vocab_size, self.eos_token_id)
        logger.info("engine ready: %s (%s weights, %s, %s), %d KV blocks of %d tokens",
                    config.model, source.weights, self.model_info.dtype, self.model_info.device,
                    num_blocks, config.block_size)

    def _model_info(self, source: ModelSource) -> ModelInfo:
        config = self.config
        return ModelInfo(
            name=config.model, weights=source.weights, max_model_len=self.max_model_len,
            vocab_size=source.config.vocab_size, eos_token_id=self.eos_token_id,
            dtype=str(config.torch_dtype).removeprefix("torch."), device=str(config.torch_device),
            max_waiting_requests=config.max_waiting_requests, max_waiting_tokens=config.max_waiting_tokens,
            priority_range=config.allowed_priorities)

    def validate_request(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise InvalidRequestError (a ValueError) if the request can never run."""
        check_prompt(prompt_token_ids, self.model_info.vocab_size)
        check_params(params, self.model_info.vocab_size)
        check_context(len(prompt_token_ids), params.max_tokens, self.max_model_len)
        check_kv_blocks(len(prompt_token_ids) + params.max_tokens, self.config.block_size,
                        self.block_manager.num_blocks)
        # The request's row of the sampler's tensors, built once now on the CPU: a value they
        # cannot hold fails this request here, not a step that batches it with others.
        SamplingBatch.from_params([params], [None], self.model_info.vocab_size, torch.device("cpu"))

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    scheduling: Scheduling = Scheduling(), grammar: xgr.CompiledGrammar | None = None,
                    lora_name: str | None = None) -> None:
        """grammar: params.constraint's, compiled already (by AsyncEngine, off this thread);
        None compiles it here (self.grammars caches it). lora_name: an adapter add_lora loaded,
        or None for the base model."""
        check_request_id_free(request_id, self._seqs)
        check_scheduling(scheduling, self.model_info.priority_range)
        self.check_lora_name(lora_name)
        self.validate_request(prompt_token_ids, params)
        seq = Sequence(request_id, prompt_token_ids, params, self.config.block_size, self.eos_token_id, scheduling)
        if lora_name is not None:
            seq.lora_name, seq.cache_salt = lora_name, self.loras.adapters[lora_name].cache_seed
            self.loras.record(lora_name, is_request=True)
        if params.seed is not None:
            seq.generator = torch.Generator(device=self.config.torch_device).manual_seed(params.seed)
        if params.constraint is not None:
            seq.grammar = self.grammars.state(params.constraint, grammar)
            self._num_constrained_requests += 1
        self._seqs[request_id] = seq
        self.scheduler.add(seq)

    def abort_request(self, request_id: str) -> bool:
        seq = self._seqs.pop(request_id, None)
        if seq is None:
            return False
        self.scheduler.remove(seq)
        seq.finish_reason = "abort"
        return True

    def warmup(self) -> None:
        """Run one short request through prefill and decode, so the first real request
        doesn't pay for kernel selection and allocator growth; counters are then reset."""
        prompt = list(range(min(self.config.block_size - 1, 8) or 1))
        self.add_request("__warmup__", prompt or [0], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
        while self.has_unfinished_requests():
            self.step()
        self._num_prompt_tokens = self._num_generated_tokens = 0
        self.block_manager.reset_prefix_stats()
        self.step_log.drain()

    def has_unfinished_requests(self) -> bool:
        return bool(self._seqs)

    def step(self) -> list[StepOutput]:
        started = time.perf_counter()
        self.take_compiled_graph()
        batch = self.scheduler.schedule()
        if batch.is_empty:
            return []
        num_tokens = sum(batch.num_new_tokens)
        self.step_threads.for_step(num_tokens)
        output = self.runner.run(batch)
        outputs = self._postprocess(batch, output)
        self.step_log.append(StepRecord(time.perf_counter() - started, num_tokens, batch.num_prompt_tokens,
                                        output.mask_s))
        return outputs

    def _postprocess(self, batch: ScheduledBatch, output: ModelOutput) -> list[StepOutput]:
        for seq, num_new in zip(batch.seqs, batch.num_new_tokens):
            self._advance(seq, num_new, output.num_accepted.get(seq))
            self.block_manager.commit_full_blocks(seq)
        for seq, logprobs in output.prompt_logprobs:
            seq.prompt_logprobs.extend(logprobs)
        now = time.monotonic()
        # A speculating sequence's tokens one by one: the first that ends it ends its output.
        outputs = [self._append(seq, token, logprob, now)
                   for seq, token, logprob in zip(output.sampled, output.token_ids, output.logprobs)
                   if seq.finish_reason is None]
        for seq in output.num_accepted:
            if seq.status is SequenceStatus.RUNNING:  # its accepted proposals are its tokens now
                self.block_manager.commit_full_blocks(seq)
        for seq in batch.seqs:
            if seq.params.max_tokens == 0 and seq.num_computed_tokens == seq.num_tokens:
                outputs.append(self._finish_prompt_only(seq, now))
        return outputs

    def _advance(self, seq: Sequence, num_new: int, num_accepted: int | None) -> None:
        """The step's tokens computed; of a speculating sequence (num_accepted not None) only
        its last token and the proposals it keeps, and the blocks of the rest go back."""
        num_proposed, seq.draft_token_ids = len(seq.draft_token_ids), []
        if num_accepted is None:
            seq.num_computed_tokens += num_new
            return
        self.speculator.record(seq, num_proposed, num_accepted)
        seq.num_computed_tokens += num_new - (num_proposed - num_accepted)
        self.block_manager.trim(seq, seq.num_computed_tokens + 1)  # + the token drawn after them

    def _append(self, seq: Sequence, token: int, logprob: TokenLogprob | None, now: float) -> StepOutput:
        if seq.failure is None:
            try:
                seq.append_token(token, logprob)
            except Exception as exc:  # noqa: BLE001 - one request's constraint or values fail it alone
                seq.failure = exc
        if seq.failure is not None:
            return self._fail(seq)
        is_first = seq.timings.first_token is None
        if is_first:
            seq.timings.first_token = now
            self._num_prompt_tokens += seq.num_prompt_tokens
        self._num_generated_tokens += 1
        if seq.lora_name is not None:
            self.loras.record(seq.lora_name, seq.num_prompt_tokens if is_first else 0, 1)
        seq.finish_reason = self._finish_reason(seq, token)
        if seq.finish_reason is not None:
            self._finish(seq)
        return self._output(seq, token, logprob, is_first)

    def _fail(self, seq: Sequence) -> StepOutput:
        """seq alone ends, finish_reason "error", its blocks freed; the step's others go on."""
        # The type only: a message could quote the request.
        logger.error("request %s failed inside a step: %s", seq.request_id, type(seq.failure).__name__)
        seq.finish_reason = "error"
        self._finish(seq)
        return self._output(seq, None, None, is_first=False)

    def _finish_prompt_only(self, seq: Sequence, now: float) -> StepOutput:
        """A prompt-only request (max_tokens 0): done once its prompt is scored."""
        seq.timings.first_token = now
        self._num_prompt_tokens += seq.num_prompt_tokens
        seq.finish_reason = "length"
        self._finish(seq)
        return self._output(seq, None, None, is_first=True)

    def _output(self, seq: Sequence, token: int | None, logprob: TokenLogprob | None, is_first: bool) -> StepOutput:
        prompt_logprobs = tuple(seq.prompt_logprobs) if is_first and seq.prompt_logprobs is not None else None
        return StepOutput(seq.request_id, token, seq.finish_reason, seq.num_prompt_tokens, seq.timings, logprob,
                          seq.cumulative_logprob, prompt_logprobs)

    def _finish_reason(self, seq: Sequence, token: int) -> str | None:
        if token in seq.stop_token_ids:
            return "stop"
        if seq.grammar is not None and seq.grammar.is_terminated:  # its end, EOS, drawn under ignore_eos
            return "stop"
        if seq.num_output_tokens >= seq.params.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    def _finish(self, seq: Sequence) -> None:
        self.block_manager.commit_full_blocks(seq)  # a speculating sequence's accepted tokens, too
        self.scheduler.remove(seq)
        del self._seqs[seq.request_id]

    def stats(self) -> EngineStats:
        bm, seqs, compiles = self.block_manager, self._seqs.values(), self.grammars.stats()
        return EngineStats(
            num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
            num_kv_blocks_used=bm.num_used_blocks, num_kv_blocks_total=bm.num_blocks,
            prefix_cache_hit_rate=bm.prefix_cache_hit_rate, num_preemptions=self.scheduler.num_preemptions,
            num_prompt_tokens=self._num_prompt_tokens, num_generated_tokens=self._num_generated_tokens,
            num_prefix_queried_tokens=bm.num_prefix_queried_tokens, num_prefix_hit_tokens=bm.num_prefix_hit_tokens,
            num_pending_prompt_tokens=sum(max(s.num_prompt_tokens - s.num_computed_tokens, 0) for s in seqs),
            num_pending_decode_tokens=sum(s.params.max_tokens - s.num_output_tokens for s in seqs),
            num_constrained_requests=self._num_constrained_requests,
            num_grammar_compiles=compiles.num_compiles, grammar_compile_s=compiles.compile_s,
            num_spec_proposed_tokens=0 if self.speculator is None else self.speculator.num_proposed_tokens,
            num_spec_accepted_tokens=0 if self.speculator is None else self.speculator.num_accepted_tokens,
            taken_at=time.time(),
        )

    def check_integrity(self) -> None:
        """Assert the KV pool's invariants against the live sequences (tests call this)."""
        self.block_manager.check_integrity(list(self._seqs.values()))
        if self.loras is not None:
            self.loras.check_integrity(self.scheduler.running)

    # LoRA adapters (engine/lora/): what the serving layer wires to vLLM's
    # /v1/load_lora_adapter, /v1/unload_lora_adapter and /v1/models.
    def add_lora(self, name: str, path: str) -> LoraInfo:
        """Read and check a PEFT adapter directory; requests may name it from now on. Raises
        LoraAdapterError (a ValueError) naming what it refuses, ValueError where LoRA is off."""
        return self._lora_registry_on().add(name, path)

    def remove_lora(self, name: str) -> bool:
        """Forget the adapter (False: unknown). Raises ValueError while a request names it."""
        in_use = [s.request_id for s in self._seqs.values() if s.lora_name == name]
        if in_use:
            raise ValueError(f"LoRA adapter {name!r} is in use by {len(in_use)} request(s), e.g. {in_use[0]!r}")
        return self.loras is not None and self.loras.remove(name)

    def list_loras(self) -> list[LoraInfo]:
        return [] if self.loras is None else [self.loras.info(name) for name in self.loras.adapters]

    def lora_stats(self) -> LoraStats | None:
        return None if self.loras is None else self.loras.stats()

    def check_lora_name(self, lora_name: str | None) -> None:
        """Raise InvalidRequestError (param "model") unless lora_name is None or a loaded adapter."""
        if lora_name is not None and (self.loras is None or lora_name not in self.loras.adapters):
            raise InvalidRequestError(f"LoRA adapter {lora_name!r} is not loaded", param="model")

    def _lora_registry_on(self) -> LoraRegistry:
        if self.loras is None:
            raise ValueError("LoRA is off: start the engine with max_loras > 0")
        return self.loras

    def _lora_registry(self, model: GPT2LMHead) -> LoraRegistry | None:
        """The adapters' registry and slots where max_loras > 0 (config.decode_graphed is then
        off); None leaves the model as it is."""
        config = self.config
        if not config.max_loras:
            return None
        slots = LoraSlots(model.config, config.max_loras, config.max_lora_rank, config.torch_dtype, config.torch_device)
        slots.kernel = lora_kernel(config)
        return LoraRegistry(model.config, config.max_lora_rank, slots)

    def _runner(self, model: GPT2LMHead, num_blocks: int, graphed: bool) -> ModelRunner:
        """The model runner, with the graph its decode steps take where the config asks for one:
        CUDA graphs (`graphed`), or the compiled graph; not yet compiled or captured."""
        config, hf = self.config, model.config
        native_draw = sampler_draw(config)
        graph: DecodeGraph | CudaGraphDecode | None = None
        if graphed:
            graph = CudaGraphDecode(model, config.max_num_seqs, -(-self.max_model_len // config.block_size),
                                    argmax=native_draw is None, compiled=config.decode_compiled)
        elif config.decode_compiled:
            graph = DecodeGraph(model, config.torch_device, decode_attention(config, hf.n_embd // hf.n_head),
                                argmax_in_graph=native_draw is None, lora=None if self.loras is None else self.loras.slots)
        # On CUDA the draw stays eager: ATen's argmax, sort and cumsum are GPU kernels already,
        # and inductor cannot generate the compiled draw for CUDA: it fuses the argmax
        # into the cumsum's split-scan kernel ("NYI TritonSplitDimKernel reductions").
        compiled_draw = graph is not None and config.torch_device.type == "cpu"
        sampler = Sampler(config.seed, config.torch_device, compiled=compiled_draw, native=native_draw)
        prefill_tokens = CudaGraphDecode.max_prefill_tokens if graphed else config.graph_prefill_tokens
        return ModelRunner(model, num_blocks, config.block_size, sampler, graph,
                           prefill_tokens)

    def take_compiled_graph(self) -> None:
        """Steps take the decode graph from now on, if its background compile has ended since
        the last call (and it compiled; a failure was logged on the compile's thread). Called
        at each step's start, on the step loop's thread only."""
        if self._compile is None or not self._compile.is_done:
            return
        compiled, started = self._compile.take(), self._compile.started
        self._compile = None
        if compiled is None:
            return
        graph, self.runner.sampler = compiled
        if graph is None:
            return
        self.runner.decode_graph = graph
        self.scheduler.max_num_batched_tokens = self.config.step_tokens(cpu_graph=True)
        logger.info("decode graph ready after %.1f s; %s", time.monotonic() - started, graph.describe())

    def _start_compile(self, on_compiled: Callable[[], None] | None) -> BackgroundCompile | None:
        """The CPU decode graph and the sampler's draw compiling on a thread of their own, eager
        steps meanwhile; None where there is no such graph (CUDA graphs capture here)."""
        graph, sampler = self.runner.decode_graph, self.runner.sampler
        if not isinstance(graph, DecodeGraph):
            return None
        self.runner.decode_graph, self.runner.sampler = None, self._eager(sampler)
        return BackgroundCompile(functools.partial(self._tune_and_warm_up, graph, sampler), self.config.cpu_threads,
                                 "the tuner and the decode graph", on_compiled)

    def _ready(self, graph: DecodeGraph | CudaGraphDecode | None) -> tuple[DecodeGraph | CudaGraphDecode | None, Sampler]:
        """The decode graph compiled (or captured) now, not inside the first requests, and the
        sampler to run beside it; None where that fails and decode steps run eagerly."""
        if isinstance(graph, DecodeGraph):
            with progress("tuning and compiling the decode graph"):
                return self._tune_and_warm_up(graph, self.runner.sampler)
        return None if graph is None else self._capture(graph), self.runner.sampler

    def _tune_and_warm_up(self, graph: DecodeGraph, sampler: Sampler) -> tuple[DecodeGraph | None, Sampler]:
        """The measured choices first (engine/core/tuner.py), so that the graph is traced on
        them; where tuning fails, the defaults stand (logged) and the graph compiles on them."""
        try:
            tuning = apply_measured_choices(self.config, self.runner.model, self.step_threads, graph,
                                            self.runner.kv_pool, sampler)
            if tuning is not None and tuning.sampler == "torch":
                sampler = self._torch_draw(sampler)
        except Exception as exc:  # noqa: BLE001 - a slower default is still a correct one
            logger.warning("tuning failed (%r); the hot path's auto choices keep their defaults", exc)
        return self._warm_up(graph, sampler)

    def _warm_up(self, graph: DecodeGraph, sampler: Sampler) -> tuple[DecodeGraph | None, Sampler]:
        """The graph and the sampler's draw compiled now, not inside the first requests, once
        for every torch thread count (engine/kernels/inductor.py); None and an eager sampler (eager
        decode steps and sampling, logged) where the graph cannot compile here, e.g. no C++
        compiler for inductor. A draw that cannot compile alone runs eagerly beside the graph.
        Touches no engine state: it runs on the background compile's thread too."""
        model, kv_pool = self.runner.model, self.runner.kv_pool
        cached = choose_graph_or_eager(self.config, model, graph, kv_pool, measure=False)
        if not graph.is_eager_everywhere:  # else its step measured faster eagerly here: no compile
            try:
                graph.warm_up(kv_pool, min(self.config.max_num_seqs, _TYPICAL_DECODE_BATCH))
            except Exception as exc:  # noqa: BLE001 - any compile failure: serve on the eager path
                logger.warning("compile_decode: the decode graph did not compile (%r); decode steps run eagerly", exc)
                return None, self._eager(sampler)
            if cached is None:
                choose_graph_or_eager(self.config, model, graph, kv_pool, measure=True)
        try:
            sampler.warm_up(self.model_info.vocab_size)
        except Exception as exc:  # noqa: BLE001 - as the graph's
            logger.warning("compile_decode: the sampler's draw did not compile (%r); it runs on eager torch ops", exc)
            return graph, self._eager(sampler)
        return graph, sampler

    def _capture(self, graphs: CudaGraphDecode) -> CudaGraphDecode | None:
        """The CUDA graphs captured now. Where the compiled step cannot compile or capture,
        graphs of the eager step; where those cannot capture, None (eager decode steps). Logged."""
        try:
            graphs.capture(self.runner.kv_pool)
        except Exception as exc:  # noqa: BLE001 - any compile or capture failure: serve on a slower path
            if graphs.compiled:
                logger.warning("cuda_graphs: the compiled step did not capture (%r); graphs of the eager step", exc)
                return self._capture(graphs.eager())
            logger.warning("cuda_graphs: capture failed (%r); decode steps run eagerly", exc)
            return None
        return graphs

    def _torch_draw(self, sampler: Sampler) -> Sampler:
        """A sampler drawing on torch's ops, compiled, from the same random stream."""
        return self._drawing_from(sampler, Sampler(self.config.seed, self.config.torch_device, compiled=True))

    def _eager(self, sampler: Sampler) -> Sampler:
        """The sampler, or where its draw is compiled an eager one drawing from its random stream."""
        if not sampler.is_compiled:
            return sampler
        return self._drawing_from(sampler, Sampler(self.config.seed, self.config.torch_device, native=sampler.native))

    @staticmethod
    def _drawing_from(old: Sampler, new: Sampler) -> Sampler:
        new.generator = old.generator  # one stream across the switch
        return new

    def _num_kv_blocks(self, model: GPT2LMHead) -> int:
        config = self.config
        if config.num_kv_blocks is not None:
            return config.num_kv_blocks
        per_block = ModelRunner.kv_bytes_per_block(model.config, config.block_size, config.torch_dtype)
        if config.kv_cache_memory_gb is not None:
            return max(int(config.kv_cache_memory_gb * 2**30 // per_block), 1)
        enough = config.max_num_seqs * -(-self.max_model_len // config.block_size)
        return max(min(enough, int(_default_kv_budget(config.torch_device) // per_block)), 1)


def _set_up_threads(config: EngineConfig) -> StepThreads:
    """Torch's CPU threads for this process, and per step (engine/core/step_threads.py)."""
    if config.torch_device.type == "cpu":
        torch.set_num_threads(config.cpu_threads)
    return StepThreads(config.cpu_threads, config.one_thread_tokens)


def _default_kv_budget(device: torch.device) -> float:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free * _GPU_KV_FRACTION
    return _DEFAULT_CPU_KV_GB * 2**30


def _small_steps(model: GPT2LMHead) -> str:
    return (", ours for up to 64 rows (bf16 panels)" if model.lm_head.weight.dim() == 4 else ", ours for up to 3 rows")


def build_model(source: ModelSource, dtype: torch.dtype, device: torch.device, seed: int,
                linears: LinearsMode = "reference", few_rows: bool = False) -> GPT2LMHead:
    """The model on `device` in `dtype`; linears="auto" prepacks its linears where the CPU runs
    that (then its state dict no longer holds them), `few_rows` with our kernels for small steps."""
    with torch.device("meta"):
        model = GPT2LMHead(source.config)
    model.to_empty(device="cpu")
    if source.weights == "pretrained":
        model.load_hf_weights(load_state_dict(source.weight_files))
    else:
        model.init_random(seed)
    model = model.to(device=device, dtype=dtype).eval().requires_grad_(False)
    packed = linears == "auto" and can_pack(device, dtype)
    if packed:
        model.pack_linears(few_rows)
    if device.type == "cpu":
        logger.info("CPU: %s; linears: %s %s%s", cpu_features().summary(),
                    "oneDNN-prepacked" if packed else "F.linear", str(dtype).removeprefix("torch."),
                    _small_steps(model) if packed and few_rows else "")
    return model
