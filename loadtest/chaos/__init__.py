"""Faults on purpose: a bounded chaos run of mixed valid and broken requests and its verdict,
and an engine replica SIGKILLed under load."""
