"""The engine's front doors: the asyncio front (AsyncEngine: requests in, per-request
chunk streams out), the step loop thread that owns the engine, its inbox and messages,
admission's overload bounds, and the offline API (LLM.generate)."""
