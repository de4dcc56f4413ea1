"""Load and benchmark tools. At the top, what a user runs: locustfile.py, bench.py (any
OpenAI-compatible server), engine_bench.py (offline engine vs HF and vLLM), make_checkpoint,
lmeval_check, fuzz, real_clients.sh. client/ is what those tools send and how they read and
report it. The harness behind the results page: peers/ (vLLM and transformers serve side
by side), micro/ (one op or one step), scale/ (replicas and routing), chaos/ (faults and
killed replicas)."""
