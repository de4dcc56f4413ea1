"""The model: GPT-2's modules, loading its config, weights and tokenizer, attention over
the paged cache, packed linears, and the compiled decode graphs (inductor on CPU, CUDA
graphs on GPU), compiled in the background with progress lines."""
