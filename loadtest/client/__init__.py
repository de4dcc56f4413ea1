"""What the load tools send and how they read it: workloads and prompts, targets (HTTP,
an in-process engine, a Serve handle), the SSE reader, results, tables and report files,
and the serve process a benchmark starts."""
