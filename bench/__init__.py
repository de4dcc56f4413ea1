"""Studies outside the package (not in the wheel): rayinfer against its peers (peers/), one
op or one step at a time (micro/), the engine against HF and vLLM offline (engine_bench), and
every row of BENCHMARKS.md measured again (results_page). Each runs as `python -m bench.<module>`
from the repository's root (bench/README.md)."""
