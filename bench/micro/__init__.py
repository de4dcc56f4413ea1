"""Micro-benchmarks: one op or one engine step, measured in one process (attention,
linears, a prefill step, two configs' decode steps, the engine against its ceiling)."""
