"""The tuner's tables on disk (engine/core/tuner.py), one file a key: a later start with the
same key loads the table in milliseconds; any change to what decides the answer is another
key, so it tunes again.

The key holds what changes the answer: the CPU (its model name and flags, as /proc/cpuinfo
reads, and the probe's view of it under RAYINFER_CPU_ISA / ONEDNN_MAX_CPU_ISA /
ATEN_CPU_CAPABILITY), the cores the engine runs on, the dtype, torch's version, our kernels'
build (their sources' fingerprint), the model's shapes, the options being tuned, and the
tuner's own version. RAYINFER_TUNING_DIR overrides where the files live (tests).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
from pathlib import Path

import torch

import engine.kernels.kernel_sources as kernel_sources
import engine.kernels.native as native
from engine.core.tuner import Timing, Tuning
from engine.kernels.cpu import cpu_features

logger = logging.getLogger(__name__)

TUNING_DIR_ENV = "RAYINFER_TUNING_DIR"
TUNER_VERSION = 3  # raise it when the candidates or the rules change
_ISA_ENVS = ("RAYINFER_CPU_ISA", "ONEDNN_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY")

TuningKey = dict[str, object]


def tuning_dir() -> Path:
    return Path(os.environ.get(TUNING_DIR_ENV) or Path.home() / ".cache" / "rayinfer" / "tuning")


def tuning_key(dtype: torch.dtype, threads: int, model_shapes: dict[str, int], options: dict[str, object]) -> TuningKey:
    """options: each tuned option's setting (what is `auto`, and so measured)."""
    return {
        "tuner": TUNER_VERSION, "cpu": _cpuinfo("model name"), "cpu_flags": _digest(_cpuinfo("flags")),
        "probe": cpu_features().summary(), "isa_env": {name: os.environ.get(name, "") for name in _ISA_ENVS},
        "threads": threads, "dtype": str(dtype), "torch": torch.__version__,
        "kernels": kernel_sources.library_stem(native.isa_build(), torch.__version__),
        "model": model_shapes, "options": options,
    }


def load(key: TuningKey) -> Tuning | None:
    """The table saved under `key`, or None (none saved, or unreadable: tune again)."""
    path = _path(key)
    try:
        saved = json.loads(path.read_text())
        if saved["key"] != json.loads(json.dumps(key)):  # as save wrote it: tuples read back as lists
            return None
        fields = saved["tuning"]
        choices = fields.get("graph_or_eager")
        return Tuning(**{**fields, "timings": tuple(Timing(**timing) for timing in fields["timings"]),
                         "graph_or_eager": None if choices is None else tuple((rows, path) for rows, path in choices)})
    except (OSError, ValueError, KeyError, TypeError):
        return None


def save(key: TuningKey, tuning: Tuning) -> Path | None:
    """Write the table under `key`, atomically (another engine may be reading it); None where
    the directory is not writable (logged: the next start tunes again)."""
    path = _path(key)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        scratch = path.with_suffix(f".{os.getpid()}.tmp")
        scratch.write_text(json.dumps({"key": key, "tuning": dataclasses.asdict(tuning)}, indent=1))
        scratch.replace(path)
    except OSError as exc:
        logger.warning("tuning: could not save the table to %s (%r); the next start tunes again", path, exc)
        return None
    return path


def _path(key: TuningKey) -> Path:
    return tuning_dir() / f"{_digest(json.dumps(key, sort_keys=True))}.json"


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _cpuinfo(field: str) -> str:
    """The first value of `field` in /proc/cpuinfo ("" where there is none: not Linux)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return ""
    return next((line.partition(":")[2].strip() for line in lines if line.split(":")[0].strip() == field), "")
