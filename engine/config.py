"""Engine configuration: one frozen dataclass, validated once at construction.

Its defaults are the fast, correct path on the machine it runs on, the same for the offline
`LLM`, an `AsyncEngine` and the served app: configs/*.yaml set only what they change. A test
or script that wants an engine up at once passes compile_decode=False.

It is validated where it is made, and that may be a process without torch (the Serve app's
build): torch is imported by the properties that resolve device and dtype, where the engine runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Literal, get_args

from engine.kernels.cpu import cpu_features, usable_cpus
from engine.model.loader import WeightsMode, check_weights_mode
from engine.request.scheduling import SchedulingPolicy
from engine.speculative.config import SpeculativeConfig

if TYPE_CHECKING:
    import torch

LinearsMode = Literal["auto", "reference"]
# A hot op's implementation: our C++ kernel (native), torch's (torch), or native where it runs (auto).
KernelChoice = Literal["auto", "native", "torch"]
LinearChoice = Literal["auto", "native", "brgemm", "torch"]  # small_batch_linear's: KernelChoice's and brgemm

_DTYPES = {  # name -> torch's name for it
    "float32": "float32",
    "fp32": "float32",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "fp16": "float16",
}


@dataclass(frozen=True)
class EngineConfig:
    model: str = "gpt2"
    weights: WeightsMode = "auto"
    dtype: str = "auto"  # float32 | bfloat16 | float16 | auto (bf16 where the hardware runs it natively)
    device: str = "auto"  # cpu | cuda | cuda:N | auto (cuda where present)
    # auto: on CPU, projections and LM head on oneDNN-prepacked weights where the CPU probe
    # says oneDNN runs this dtype (engine/model/packed_linear.py); reference: F.linear everywhere,
    # the path that is token-exact with Hugging Face in fp32.
    linears: LinearsMode = "auto"
    # Decode steps (and short steps with prefill chunks: graph_prefill_tokens) through one
    # torch.compile'd graph of the whole forward with the weights frozen in
    # (engine/model/decode_graph.py), on the same linears as the eager steps. The graph compiles while
    # the engine is built (tens of seconds); where it cannot compile, decode steps stay eager,
    # with a warning. auto: on on CPU, in bf16 and fp32, then per step size the faster of the
    # graph and its step run eagerly (measured: engine/core/tuner.py); on CUDA inside
    # cuda_graphs' graphs. true: the graph for every step it takes.
    # The sampler's draw (argmax, or softmax and an inverse-CDF draw) compiles with it on CPU, so
    # a sampled step leaves eager ATen too.
    compile_decode: bool | Literal["auto"] = "auto"
    # On CUDA, steps of one-token rows (decodes) replayed from CUDA graphs captured before the
    # engine serves, one per bucket of rows and block-table width (engine/model/cuda_graphs.py);
    # other steps run eagerly. With compile_decode (auto on CUDA: on) the graphs hold the
    # compiled step, Triton kernels for the fused pieces.
    # auto: on CUDA (vLLM's default; false is its enforce_eager), except with LoRA on
    # (max_loras > 0), whose rows the captured graphs do not take yet; true: the same, and an
    # error off CUDA or with LoRA on.
    cuda_graphs: bool | Literal["auto"] = "auto"
    # The compiled decode graph's attention. native: our C++ kernel (engine/kernels/native_attention.py,
    # built once per machine for the probed ISA); torch: the same math as a PyTorch
    # expression inductor compiles; auto: where ours builds, the faster of the two, measured on
    # this machine before the graph compiles (engine/core/tuner.py; cached), else torch, logged.
    decode_attention: KernelChoice = "auto"
    # Steps of up to this many tokens with prefill chunks among them (new prompts, chunks of
    # long ones, beside decodes) take the compiled graph too, its attention reading each
    # chunk's rows causally; longer ones, and steps that score prompt logprobs, run eagerly.
    # 0: decode-only steps alone. Past 64 rows (our C++ linears' limit) the graph runs oneDNN's
    # products as eager steps do, and 128 is where it stops beating the eager step.
    graph_prefill_tokens: int = 128
    # The sampler's draw (argmax and an inverse-CDF draw per row). native: our C++ kernel
    # (engine/kernels/csrc/sampling.cpp, built with decode_attention's); torch: torch ops, compiled
    # with compile_decode; auto: on CPU where ours builds, the faster of the two for the decode
    # graph's steps, measured before it compiles (engine/core/tuner.py; cached), ours until
    # then and without the graph; else torch, logged.
    sampler: KernelChoice = "auto"
    # Prepacked linears (linears: auto) on small steps. native: our C++ kernels over a second
    # copy of the weights, kept beside the packed ones (the linears' weights take twice the
    # memory): in bf16 on AVX-512 BF16, steps of 1 to 64 rows on the weights in panels
    # (engine/kernels/csrc/blocked_linear.cpp); in fp32 on the AVX2 build, the same on fp32 panels
    # (engine/kernels/csrc/blocked_linear_f32.cpp); elsewhere, steps of one to three rows on the plain
    # weights (engine/kernels/csrc/small_linear.cpp; the decode graph pads one row to two): oneDNN
    # is slow on so few rows. torch: oneDNN's product for every step (an
    # opaque op in the decode graph: engine/kernels/onednn_linear.py). auto: ours on CPU where
    # the linears are packed and they build, up to the row count where oneDNN's gets faster,
    # measured on this machine with the decode graph's compile (engine/core/tuner.py; cached);
    # until then, and without the graph, up to the kernel's own limit. Else oneDNN's, logged.
    # Where oneDNN's brgemm ukernel runs bf16 (avx512_core or newer; AMX tiles where the CPU
    # has them), auto measures it too, on the same panels (engine/kernels/csrc/brgemm_linear.cpp),
    # for the counts between ours and oneDNN's product. brgemm: it for every step up to 64
    # rows, oneDNN's product past them; an error where it does not run. One option, not a new
    # one: the three are candidates for the same steps, and `auto` picks among them.
    small_batch_linear: LinearChoice = "auto"
    seed: int = 0
    block_size: int = 16
    # KV pool size: a block count wins over a memory budget; neither means "fit max_num_seqs
    # full-length sequences, capped by kv_cache_memory_gb's default".
    num_kv_blocks: int | None = None
    kv_cache_memory_gb: float | None = None
    max_num_seqs: int = 64
    # Prefill + decode tokens per step. auto: on CPU with the decode graph, the graph's bound
    # (graph_prefill_tokens, at least max_num_seqs), so that every step takes it and a wave of
    # new prompts is prefilled in groups whose first tokens come a group at a time; else 512
    # (or max_num_seqs, if more).
    max_num_batched_tokens: int | Literal["auto"] = "auto"
    max_model_len: int | None = None  # defaults to the model's n_positions
    enable_prefix_caching: bool = True
    # Overload bounds on requests admitted but not yet past their first token (queued or
    # prefilling): past either, AsyncEngine.generate raises EngineOverloadedError at once.
    # None: no bound. The defaults hold 32 prompts of 512 tokens; past them a caller gets 429.
    max_waiting_requests: int | None = 128
    max_waiting_tokens: int | None = 16384
    # Who goes next from the waiting line (engine/core/queue_policy.py). fcfs: arrival order.
    # priority: a request's `priority` (vLLM's: lower first; arrival order among equals), and
    # a waiting request preempts lower-priority running ones when the batch is full. fair:
    # fair shares of service between tenants (the virtual token counter), priority within
    # each tenant; the waiting bounds above hold per tenant too, as its weight's share
    # (engine/frontend/admission.py). With one tenant, fair is the priority policy.
    scheduling_policy: SchedulingPolicy = "fair"
    # The priorities a request may ask for, both ends included; under fcfs only 0.
    priority_range: tuple[int, int] = (-100, 100)
    num_threads: int | None = None  # torch CPU threads; None = every core this process may use
    # Steps of at most this many tokens (one stream's decodes) run on one torch thread, the
    # rest on num_threads: in a server the other processes on the engine's cores stall a
    # small step's OpenMP barriers more than a second thread speeds it up, in bf16; in fp32,
    # twice the bytes a step, the second thread wins (engine/core/step_threads.py).
    # 0: every step on num_threads; auto: measured on this machine with the decode graph's
    # compile (engine/core/tuner.py; cached): the largest step one thread runs at most 30%
    # slower than num_threads; until then, and without the graph, 1 on CPU in bf16, else 0.
    one_thread_max_tokens: int | Literal["auto"] = "auto"
    # Speculative decoding by prompt lookup (engine/speculative/): {method: ngram,
    # num_speculative_tokens, prompt_lookup_max, prompt_lookup_min, max_step_rows}; a config
    # file's mapping becomes a SpeculativeConfig. On by default: where proposals fail a
    # sequence backs off and a full batch takes none, so it costs nothing where it wins
    # nothing. None: off.
    speculative: SpeculativeConfig | None = SpeculativeConfig()
    # LoRA adapters (vLLM's names): at most max_loras resident at once, each of rank up to
    # max_lora_rank, served from the one base model, rows of several in one step
    # (engine/lora/). 0: LoRA off, the model exactly as without it.
    max_loras: int = 0
    max_lora_rank: int = 16
    # Adapters an engine replica keeps read in memory (vLLM's name; None: max_loras): past it
    # the replica forgets the least recently used one no request uses, and reads it again
    # from its path when a request next names it (deployments/replicas/engine_adapters.py).
    # The offline engine keeps what add_lora read until remove_lora: its adapters have no
    # path a request carries to read them again.
    max_cpu_loras: int | None = None

    def __post_init__(self) -> None:
        check_weights_mode(self.weights)
        object.__setattr__(self, "speculative", SpeculativeConfig.of(self.speculative))
        if self.dtype != "auto" and self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of auto, {', '.join(_DTYPES)}; got {self.dtype!r}")
        for name in ("compile_decode", "cuda_graphs"):
            if getattr(self, name) not in (True, False, "auto"):
                raise ValueError(f"{name} must be true, false or auto, got {getattr(self, name)!r}")
        self._check_kernel_choices()
        if self.linears not in ("auto", "reference"):
            raise ValueError(f"linears must be auto or reference, got {self.linears!r}")
        if not (self.device in ("auto", "cpu") or self.device.startswith("cuda")):
            raise ValueError(f"device must be auto, cpu or cuda[:N], got {self.device!r}")
        _require_positive("block_size", self.block_size)
        _require_positive("max_num_seqs", self.max_num_seqs)
        self._check_lora()
        if self.max_num_batched_tokens != "auto":
            _require_positive("max_num_batched_tokens", self.max_num_batched_tokens)
        if self.num_kv_blocks is not None:
            _require_positive("num_kv_blocks", self.num_kv_blocks)
        if not (isinstance(self.graph_prefill_tokens, int) and self.graph_prefill_tokens >= 0):
            raise ValueError(f"graph_prefill_tokens must be an integer >= 0, got {self.graph_prefill_tokens!r}")
        if not (self.one_thread_max_tokens == "auto" or (isinstance(self.one_thread_max_tokens, int)
                                                         and self.one_thread_max_tokens >= 0)):
            raise ValueError(f"one_thread_max_tokens must be an integer >= 0 or auto, got {self.one_thread_max_tokens!r}")
        if self.scheduling_policy not in get_args(SchedulingPolicy):
            raise ValueError(f"scheduling_policy must be fcfs, priority or fair, got {self.scheduling_policy!r}")
        _check_priority_range(self.priority_range)
        object.__setattr__(self, "priority_range", tuple(self.priority_range))  # a config file's list
        for name in ("max_waiting_requests", "max_waiting_tokens"):
            if getattr(self, name) is not None:
                _require_positive(name, getattr(self, name))
        if self.kv_cache_memory_gb is not None and not self.kv_cache_memory_gb > 0:
            raise ValueError(f"kv_cache_memory_gb must be > 0, got {self.kv_cache_memory_gb}")
        if self.max_num_batched_tokens != "auto" and self.max_num_batched_tokens < self.max_num_seqs:
            # Every running sequence must be able to decode in every step.
            raise ValueError("max_num_batched_tokens must be >= max_num_seqs")

    def _check_kernel_choices(self) -> None:
        for name in ("decode_attention", "sampler"):
            if getattr(self, name) not in get_args(KernelChoice):
                raise ValueError(f"{name} must be auto, native or torch, got {getattr(self, name)!r}")
        if self.small_batch_linear not in get_args(LinearChoice):
            raise ValueError(f"small_batch_linear must be auto, native, brgemm or torch, got {self.small_batch_linear!r}")

    def _check_lora(self) -> None:
        _require_positive("max_lora_rank", self.max_lora_rank)
        if not (isinstance(self.max_loras, int) and not isinstance(self.max_loras, bool) and self.max_loras >= 0):
            raise ValueError(f"max_loras must be an integer >= 0, got {self.max_loras!r}")
        if self.max_cpu_loras is not None and not (isinstance(self.max_cpu_loras, int)
                                                   and self.max_cpu_loras >= max(self.max_loras, 1)):
            raise ValueError(f"max_cpu_loras must be an integer >= max_loras, got {self.max_cpu_loras!r}")

    @property
    def num_cpu_loras(self) -> int:
        """max_cpu_loras resolved: the most adapters an engine replica keeps read."""
        return self.max_loras if self.max_cpu_loras is None else self.max_cpu_loras

    @property
    def allowed_priorities(self) -> tuple[int, int]:
        """priority_range resolved: (0, 0) under fcfs, where a priority would order nothing."""
        return (0, 0) if self.scheduling_policy == "fcfs" else self.priority_range

    @cached_property
    def torch_device(self) -> torch.device:
        import torch

        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError(f"device={self.device!r} but CUDA is not available")
        return torch.device(self.device)

    @cached_property
    def torch_dtype(self) -> torch.dtype:
        import torch

        if self.dtype != "auto":
            return getattr(torch, _DTYPES[self.dtype])
        if self.torch_device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.bfloat16 if cpu_features().has_fast_bf16 else torch.float32

    @cached_property
    def one_thread_tokens(self) -> int:
        """one_thread_max_tokens resolved before any measurement (the tuner may move auto's):
        0 off the CPU, where torch's threads don't run steps."""
        if self.torch_device.type != "cpu":
            return 0
        if self.one_thread_max_tokens == "auto":
            import torch

            return 1 if self.torch_dtype == torch.bfloat16 else 0
        return self.one_thread_max_tokens

    @cached_property
    def decode_compiled(self) -> bool:
        """Whether decode steps run through the compiled graph (compile_decode resolved)."""
        if self.compile_decode == "auto":
            # On CUDA only inside CUDA graphs: launched from Python, inductor's kernels are
            # slower than the eager step.
            return self.torch_device.type == "cpu" or self.decode_graphed
        return bool(self.compile_decode)

    @cached_property
    def decode_graphed(self) -> bool:
        """Whether decode steps replay CUDA graphs (cuda_graphs resolved)."""
        on_cuda = self.torch_device.type == "cuda"
        if self.cuda_graphs is True and self.max_loras:
            raise ValueError("cuda_graphs: true does not take LoRA rows yet: set max_loras: 0, or cuda_graphs: auto "
                             "(off with LoRA on)")
        if self.cuda_graphs is True and not on_cuda:
            raise ValueError(f"cuda_graphs: true needs a CUDA device, not {self.torch_device}")
        return on_cuda and self.cuda_graphs is not False and not self.max_loras

    def step_tokens(self, cpu_graph: bool) -> int:
        """max_num_batched_tokens resolved; cpu_graph: whether the engine's steps take the
        compiled CPU graph (compile_decode on, and it compiled)."""
        if self.max_num_batched_tokens != "auto":
            return self.max_num_batched_tokens
        if cpu_graph and self.graph_prefill_tokens:
            return max(self.graph_prefill_tokens, self.max_num_seqs)
        return max(512, self.max_num_seqs)

    @cached_property
    def cpu_threads(self) -> int:
        if self.num_threads is not None:
            return self.num_threads
        return usable_cpus()


def _check_priority_range(bounds: object) -> None:
    if not (isinstance(bounds, (tuple, list)) and len(bounds) == 2
            and all(isinstance(b, int) and not isinstance(b, bool) for b in bounds) and bounds[0] <= 0 <= bounds[1]):
        raise ValueError(f"priority_range must be two integers [low, high] with low <= 0 <= high, got {bounds!r}")


def _require_positive(name: str, value: int) -> None:
    if not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")

