"""The Serve application: `import_path: deployments.app:build_app` in configs/*.yaml.

    Ingress ──encode──▶ TokenizerDeployment   (CPU, autoscaled; prompts too long to encode in the ingress)
            ──generate (stream)──▶ EngineDeployment   (a replica per GPU where the cluster has them)

Options a config file's `deployments:` list sets (replicas, autoscaling,
max_ongoing_requests, ray_actor_options) override the code's; the engine's
ray_actor_options are left to build_app, which decides its GPU.
"""

from __future__ import annotations

import math
from typing import Any, Literal

import ray
from pydantic import BaseModel, ConfigDict, Field, model_validator
from ray import serve

from deployments.routing.chunk_budget import ChunkBudget
from deployments.replicas.engine_deployment import EngineDeployment
from deployments.replicas.engine_runtime import engine_runtime_env
from deployments.api.http_body import DEFAULT_MAX_BODY_BYTES
from deployments.api.lora_catalog import LoraCatalog
from deployments.replicas.ingress import Ingress
from deployments.api.prompt_encoding import DEFAULT_LOCAL_MAX_CHARS
from deployments.replicas.tokenizer_deployment import TokenizerDeployment
from engine import EngineConfig
from engine.model.loader import WeightsMode


class AppArgs(BaseModel):
    """The `args:` of an application in a Serve config file."""

    model_config = ConfigDict(extra="forbid")

    model: str = "gpt2"  # a Hugging Face id or a local checkpoint directory
    served_model_name: str | None = None  # the `model` in API responses; defaults to `model`
    weights: WeightsMode = "auto"
    dtype: str = "auto"  # auto: bf16 on GPUs and on CPUs with fast bf16, else fp32
    device: str = "auto"  # auto: cuda when the engine replica got a GPU
    seed: int = 0
    engine: dict[str, Any] = Field(default_factory=dict)  # any other EngineConfig field
    engine_num_cpus: float = 0.5  # also sizes its torch threads: ceil(engine_num_cpus)
    engine_num_gpus: float | Literal["auto"] = "auto"  # auto: 1 if the cluster has a GPU, else 0
    # Engine replicas where the engine runs on CPU (None: the deployment's own, one); with a
    # GPU each, always the deployment's own. A config file's num_replicas overrides both.
    engine_cpu_replicas: int | None = Field(None, ge=1)
    # Past this many engine->ingress chunks a second, tokens are packed several per chunk;
    # auto: 50 a CPU of the engine replica's node, None: every token its own chunk
    # (deployments/routing/chunk_budget.py).
    max_chunks_per_s: ChunkBudget = "auto"
    tokenizer_num_replicas: int | None = None  # None: the deployment's autoscaling_config
    tokenizer_max_batch_size: int = Field(32, ge=1)
    tokenizer_batch_wait_s: float = Field(0.0, ge=0)
    # A request whose prompts hold at most this many characters (text, or the chat template's)
    # or token ids in all is encoded in the ingress itself, a longer one by the tokenizer
    # deployment; 0: every prompt by the deployment (deployments/api/prompt_encoding.py).
    local_encode_max_chars: int = Field(DEFAULT_LOCAL_MAX_CHARS, ge=0)
    # Bearer keys the API requires (none: open). Prefer the RAYINFER_API_KEYS environment
    # variable: these args are part of the Serve config the dashboard shows.
    # An entry may name its tenant and weight: "KEY name=team-a weight=2" (deployments/api/security.py).
    api_keys: list[str] = Field(default_factory=list)
    # Without API keys, a request's `user` field names its tenant (fair shares per user; the
    # metrics label it by a short hash). With keys, the key does.
    tenant_by_user: bool = False
    max_body_bytes: int = Field(DEFAULT_MAX_BODY_BYTES, ge=1)  # larger bodies get 413
    # LoRA adapters (docs/lora.md, "Serving adapters"): the one directory every adapter's path
    # is resolved inside; the adapters served from the start, name -> path (relative: under
    # lora_dir); whether POST /v1/load_lora_adapter and /v1/unload_lora_adapter exist (they
    # need one Ingress replica). The engine's `max_loras` defaults to DEFAULT_MAX_LORAS then.
    lora_dir: str | None = None
    lora_modules: dict[str, str] = Field(default_factory=dict)
    allow_runtime_lora_updating: bool = False

    @model_validator(mode="before")
    @classmethod
    def _no_removed_args(cls, args: Any) -> Any:
        """A config still setting an arg that is gone is told what replaced it, not just that
        the key is unknown."""
        for name, instead in _REMOVED_ARGS.items():
            if isinstance(args, dict) and name in args:
                raise ValueError(f"the app arg `{name}: {args[name]}` is gone: {instead}; delete the arg")
        return args


_REMOVED_ARGS = {
    "ingress": "the HTTP routes always run in their own Ingress deployment (`ingress: engine` is no longer served)",
    "engine_cpu_bind": "engine replicas' threads run where the OS schedules them",
    "engine_preload": "the engine replica preloads no libraries; set LD_PRELOAD in the application's "
                      "`runtime_env: {env_vars: ...}` to try one",
    "engine_env": "set environment variables in the application's `runtime_env: {env_vars: ...}`",
}


def build_app(args: dict) -> serve.Application:
    """Serve's application builder: it must take exactly the args dict."""
    return make_app(args)


def make_app(args: dict, deployment_options: dict[str, dict] | None = None,
             engine_class: type | None = None) -> serve.Application:
    """For Python callers such as tests and benchmarks: `deployment_options` (deployment name
    -> Serve options), as a config file's `deployments:` list sets them for `serve run`;
    `engine_class`, a subclass of the engine deployment's class to run in its place (tests
    inject faults with one, benchmarks log load with another)."""
    app_args = AppArgs.model_validate(args)
    options = deployment_options or {}
    num_gpus = engine_num_gpus(app_args)
    config = engine_config(app_args, num_gpus)
    tokenizer = TokenizerDeployment
    if app_args.tokenizer_num_replicas is not None:
        tokenizer = tokenizer.options(num_replicas=app_args.tokenizer_num_replicas, autoscaling_config=None)
    tokenizer_app = tokenizer.options(**options.get("TokenizerDeployment", {})).bind(
        app_args.model, app_args.tokenizer_max_batch_size, app_args.tokenizer_batch_wait_s)
    engine_args = (config, app_args.max_chunks_per_s)
    served_name = app_args.served_model_name or app_args.model
    loras = LoraCatalog.from_args(served_name, app_args.lora_dir, app_args.lora_modules,
                                  app_args.allow_runtime_lora_updating)
    http_args = (served_name, app_args.model, app_args.api_keys, app_args.max_body_bytes,
                 app_args.local_encode_max_chars, app_args.tenant_by_user, loras)
    engine_options = engine_deployment_options(app_args, num_gpus) | options.get("EngineDeployment", {})
    if engine_class is not None:
        engine_options["func_or_class"] = engine_class
    engine_app = EngineDeployment.options(**engine_options).bind(*engine_args)
    return Ingress.options(**options.get("Ingress", {})).bind(tokenizer_app, engine_app, *http_args)


def engine_deployment_options(args: AppArgs, num_gpus: float) -> dict:
    options: dict[str, Any] = {"ray_actor_options": engine_actor_options(args, num_gpus)}
    if num_gpus == 0 and args.engine_cpu_replicas is not None:
        options["num_replicas"] = args.engine_cpu_replicas
    return options


def engine_actor_options(args: AppArgs, num_gpus: float) -> dict:
    return {"num_cpus": args.engine_num_cpus, "num_gpus": num_gpus,
            "runtime_env": engine_runtime_env()}


def engine_config(args: AppArgs, num_gpus: float) -> EngineConfig:
    # A replica without a reserved GPU must not take one it happens to see.
    device = "cpu" if num_gpus == 0 and args.device == "auto" else args.device
    # Threads sized to the CPUs the replica asked Ray for, so replicas sharing a box do not
    # oversubscribe it; `engine: {num_threads: N}` overrides.
    engine = {"num_threads": max(1, math.ceil(args.engine_num_cpus)), **lora_engine_options(args), **args.engine}
    try:
        return EngineConfig(model=args.model, weights=args.weights, dtype=args.dtype, device=device,
                            seed=args.seed, **engine)
    except TypeError as error:  # an unknown key in `engine:`
        raise ValueError(f"bad engine args {sorted(args.engine)}: {error}") from None


# Adapter slots where the app serves adapters and `engine: {max_loras: N}` is not set: a few
# resident at once (more are read back, least recently used evicted), each slot a few MB.
DEFAULT_MAX_LORAS = 4


def lora_engine_options(args: AppArgs) -> dict[str, int]:
    """max_loras where adapters are served but the engine args leave it out; a ValueError where
    the engine args turn LoRA off under adapters the app args serve."""
    serves = sorted(name for name, is_set in (("lora_modules", bool(args.lora_modules)),
                                              ("allow_runtime_lora_updating", args.allow_runtime_lora_updating))
                    if is_set)
    if not serves:
        if args.lora_dir is not None:
            raise ValueError("lora_dir is set but no adapter can be served: add lora_modules or "
                             "allow_runtime_lora_updating: true, or delete lora_dir")
        return {}
    if args.engine.get("max_loras") == 0:
        raise ValueError(f"engine.max_loras: 0 turns LoRA off, but {' and '.join(serves)} serve adapters")
    return {} if "max_loras" in args.engine else {"max_loras": DEFAULT_MAX_LORAS}


def engine_num_gpus(args: AppArgs) -> float:
    if args.engine_num_gpus != "auto":
        return args.engine_num_gpus
    if args.device == "cpu":
        return 0
    return 1 if args.device.startswith("cuda") or cluster_num_gpus() >= 1 else 0


def cluster_num_gpus() -> float:
    if ray.is_initialized():
        return ray.cluster_resources().get("GPU", 0)
    # `serve run module:build_app` builds the app before it connects to Ray; torch only then
    # (a config file's app is built in a Ray task, which then needs no torch).
    import torch

    return torch.cuda.device_count()
