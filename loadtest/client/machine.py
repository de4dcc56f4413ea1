"""The line every benchmark report opens with: which CPU (as the engine's own probe sees it,
so an emulated AVX2 run says avx2), how many cores, and when. Figures from different CPU
kinds are not comparable, and this VM's speed drifts through the day."""

from __future__ import annotations

import os
import time

from engine.kernels.cpu import cpu_features


def utc_now() -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime())


def machine_line(started_utc: str, finished_utc: str) -> str:
    return (f"Machine: {cpu_features().summary()}, {os.cpu_count()} CPUs; "
            f"run {started_utc} to {finished_utc} UTC")
