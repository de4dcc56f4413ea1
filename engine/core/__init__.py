"""One engine step: schedule -> run -> postprocess (LLMEngine). The continuous-batching
scheduler, the paged KV blocks with the prefix cache and their memory pool, each request's
sequence state, the model runner (batch tensors in, sampled tokens out), which
implementation each hot op runs, and the step's threads, log and memory upkeep."""
