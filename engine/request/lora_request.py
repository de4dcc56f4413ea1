"""Which LoRA adapter a request runs under, as it crosses from the Ingress to an engine
replica: the name the client used and the directory it was resolved to (always inside the
application's `lora_dir`). An engine replica that does not hold the adapter yet reads it
from `path` before the request starts (vLLM's LoRARequest).

`load_id` tells loads of one name apart, as vLLM's `lora_int_id`: each runtime load gets a new
one, so a replica reads the adapter again after an unload and a load, even from the same
path (its files may have been rewritten meanwhile); adapters declared in the config have 0,
the same on every Ingress replica.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoraRequest:
    name: str
    path: str
    load_id: int = 0
