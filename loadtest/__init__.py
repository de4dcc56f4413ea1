"""The load tools a user runs against a server: locustfile.py, bench.py (any OpenAI-compatible
server), fuzz.py, chaos/ (faults and killed replicas), scale/ (replicas and routing),
make_checkpoint. client/ is what those tools send and how they read and report it. Peer
set-ups and micro-benchmarks live outside the package, in bench/."""
