"""Speculative decoding by prompt lookup: n-gram proposals verified in the engine's own steps."""
