"""The LoRA adapters the API serves, by name, as the Ingress owns them: those the app's
`lora_modules` declare and those `/v1/load_lora_adapter` adds at run time. A request's
`model` names the base model or one of them; engine replicas only follow (each reads an
adapter on the first request that names it: deployments/replicas/engine_adapters.py).

Every adapter's path is resolved inside the one directory `lora_dir`, symlinks followed,
before anything at the path is opened: `..`, a symlink out and an absolute path elsewhere
are refused, so a client that may load adapters can make the server read nothing else.

Each Ingress replica holds its own catalog: runtime loads and unloads would diverge between
replicas, so with `allow_runtime_lora_updating` the Ingress runs one replica (checked at its
start, where a config file's `deployments:` overrides are known; check_one_ingress_replica).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

from deployments.api.errors import ApiError, unknown_model
from engine.request.lora_request import LoraRequest

ADAPTER_CONFIG = "adapter_config.json"  # what PEFT's save_pretrained writes into an adapter's directory


def resolve_inside(root: Path, path: str) -> Path | None:
    """`path` (relative: under root) resolved with its symlinks followed; None where it leaves
    `root`, an already resolved directory. Only the path's links are looked at, no file read."""
    try:
        target = (root / path).resolve()  # an absolute `path` replaces root, as it should
    except (ValueError, OSError, RuntimeError):  # a NUL byte; a symlink loop (RuntimeError before Python 3.13)
        return None
    return target if target.is_relative_to(root) else None


def outside(path: str) -> ApiError:
    return ApiError(400, f"lora_path {path!r} does not resolve inside the adapters directory (lora_dir)",
                    param="lora_path")


@dataclass
class LoraCatalog:
    base_name: str  # the served model's name: a request naming it runs no adapter
    root: Path | None = None  # lora_dir, resolved; None: no adapters
    adapters: dict[str, LoraRequest] = field(default_factory=dict)
    allow_runtime_updating: bool = False

    @classmethod
    def from_args(cls, base_name: str, lora_dir: str | None, modules: dict[str, str],
                  allow_runtime_updating: bool) -> LoraCatalog:
        """The catalog the app's args declare; a ValueError naming the arg where they cannot work."""
        if lora_dir is None:
            if modules or allow_runtime_updating:
                arg = "lora_modules" if modules else "allow_runtime_lora_updating"
                raise ValueError(f"{arg} needs lora_dir: every adapter's path is resolved inside that one directory")
            return cls(base_name)
        root = Path(lora_dir).resolve()
        if not root.is_dir():
            raise ValueError(f"lora_dir {lora_dir!r} is not a directory")
        adapters = {name: declared(root, name, path, base_name) for name, path in modules.items()}
        return cls(base_name, root, adapters, allow_runtime_updating)

    def lookup(self, name: str | None) -> LoraRequest | None:
        """The adapter a request's `model` names; None: the base model (or no name); an unknown
        name is a 404."""
        if name is None or name == self.base_name:
            return None
        if name not in self.adapters:
            raise unknown_model(name)
        return self.adapters[name]

    def resolve(self, name: str, path: str) -> LoraRequest:
        """A runtime load's adapter, not yet listed, with a load_id of its own (the clock's
        nanoseconds: no earlier load on any replica had it, across Ingress restarts too); a
        400 for a name taken or a path outside."""
        self.check_name_is_free(name)
        target = None if self.root is None else resolve_inside(self.root, path)
        if target is None:
            raise outside(path)
        return LoraRequest(name, str(target), time.time_ns())

    def add(self, lora: LoraRequest) -> None:
        self.check_name_is_free(lora.name)  # again: another load of the name may have finished meanwhile
        self.adapters[lora.name] = lora

    def remove(self, name: str) -> LoraRequest:
        if name not in self.adapters:
            raise ApiError(404, f"the LoRA adapter {name!r} cannot be found", param="lora_name",
                           code="model_not_found")
        return self.adapters.pop(name)

    def check_name_is_free(self, name: str) -> None:
        if name == self.base_name or name in self.adapters:
            raise ApiError(400, f"the LoRA adapter {name!r} has already been loaded" if name in self.adapters
                           else f"{name!r} is the base model's name", param="lora_name")

    def check_runtime_updating(self) -> None:
        """The load and unload routes exist only with allow_runtime_lora_updating (as vLLM's)."""
        if not self.allow_runtime_updating:
            raise ApiError(404, "Not Found")

    def cards(self, created: int) -> list[dict]:
        """/v1/models' card of each adapter, vLLM's shape."""
        return [{"id": name, "object": "model", "created": created, "owned_by": "rayinfer", "root": lora.path,
                 "parent": self.base_name} for name, lora in self.adapters.items()]


def declared(root: Path, name: str, path: str, base_name: str) -> LoraRequest:
    """One of lora_modules, checked at build: a ValueError naming it where it cannot be served."""
    if name == base_name:
        raise ValueError(f"lora_modules: {name!r} is the served model's name; name the adapter otherwise")
    target = resolve_inside(root, path)
    if target is None:
        raise ValueError(f"lora_modules: {name!r}'s path {path!r} does not resolve inside lora_dir {str(root)!r}")
    if not (target / ADAPTER_CONFIG).is_file():
        raise ValueError(f"lora_modules: {name!r}'s path {str(target)!r} has no {ADAPTER_CONFIG}")
    return LoraRequest(name, str(target))


def check_one_ingress_replica(num_replicas: int | None, is_autoscaling: bool) -> None:
    """For allow_runtime_lora_updating: runtime loads change one Ingress replica's catalog; with
    more than one, a request would find an adapter or not by the replica it landed on."""
    if is_autoscaling or num_replicas != 1:
        raise ValueError("allow_runtime_lora_updating needs exactly one Ingress replica (num_replicas: 1, no "
                         "autoscaling_config): each replica holds its own catalog of adapters")
