"""A request as the caller states it and what it gets back, with no torch: sampling
parameters and their limits, the rules a request must meet to ever run, the outputs and
chunks the engine hands out, and incremental detokenization with stop strings. The
processes that only check or tokenize requests (tokenizer replicas, the Ingress) import
this and nothing heavier."""
