"""From a step's logits to its tokens: per-request logits controls (logit_bias, penalties,
min_tokens), the batched sampler, and the model's own logprobs."""
