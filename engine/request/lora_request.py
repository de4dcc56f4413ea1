"""Which LoRA adapter a request runs under, as it crosses from the Ingress to an engine
replica: the name the client used and the directory it was resolved to (always inside the
application's `lora_dir`). An engine replica that does not hold the adapter yet reads it
from `path` before the request starts (vLLM's LoRARequest, without its integer id).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoraRequest:
    name: str
    path: str
