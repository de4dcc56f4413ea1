"""Shared helpers for engine tests: Hugging Face reference generations on the same weights."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers


def hf_model(model_dir: Path, dtype: torch.dtype = torch.float32) -> transformers.GPT2LMHeadModel:
    return transformers.GPT2LMHeadModel.from_pretrained(model_dir, dtype=dtype).eval()


def hf_greedy(model: transformers.GPT2LMHeadModel, prompt: list[int], max_new_tokens: int) -> list[int]:
    """HF greedy continuation of one unpadded prompt, EOS ignored."""
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, do_sample=False,
            eos_token_id=None, pad_token_id=0,
        )
    return out[0, len(prompt):].tolist()


def write_peaked_gpt2_small(directory: Path, tokenizer: transformers.PreTrainedTokenizerBase) -> Path:
    """A GPT-2-small checkpoint (12 layers, 768 wide, GPT-2's own initializer) whose next-token
    distributions are peaked: the final LayerNorm's gain times 8 scales every logit by 8
    (nothing before it changes). At GPT-2's initializer the logits spread about 0.5 and the
    best token of 50257 gets ~0.03% of the mass, where almost any error hides; times 8 it gets
    ~75% on average, so a wrong logit moves a logprob visibly."""
    config = transformers.GPT2Config(n_layer=12, n_embd=768, n_head=12, n_positions=1024, vocab_size=50257)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    with torch.no_grad():
        model.transformer.ln_f.weight.mul_(8)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def hf_scores(model: transformers.GPT2LMHeadModel, prompt: list[int], continuation: list[int]) -> torch.Tensor:
    """[len(continuation), vocab]: HF's fp32 log-softmax at each continuation position, the
    continuation teacher-forced (row i: log P(next | prompt + continuation[:i]))."""
    with torch.inference_mode():
        logits = model(torch.tensor([prompt + continuation[:-1]])).logits[0, len(prompt) - 1:]
    return logits.float().log_softmax(-1)


def mixed_prompts(num: int, seed: int = 0) -> list[list[int]]:
    """Prompts of mixed lengths (1 to ~120 tokens) of random token ids."""
    generator = torch.Generator().manual_seed(seed)
    lengths = [1, 3, 7, 16, 17, 33, 64, 120, 5, 48, 90, 2][:num]
    return [torch.randint(0, 50257, (n,), generator=generator).tolist() for n in lengths]


def greedy_logprobs(llm, prompt: list[int], max_new_tokens: int) -> tuple[list[int], list[torch.Tensor]]:
    """One prompt alone through an engine, greedy: its tokens and each step's full-vocabulary
    logprobs, read off the model's output (one sampling row per step)."""
    from engine import SamplingParams

    steps: list[torch.Tensor] = []
    hook = llm.engine.runner.model.register_forward_hook(lambda _m, _a, out: steps.extend(out.log_softmax(-1)))
    try:
        out = llm.generate([prompt], SamplingParams(max_tokens=max_new_tokens, temperature=0, ignore_eos=True))
    finally:
        hook.remove()
    return out[0].token_ids, steps


def record_steps(engine) -> list[list[int]]:
    """Each step's tokens per sequence, as the runner is handed them."""
    steps: list[list[int]] = []
    run = engine.runner.run

    def recording(batch):
        steps.append(list(batch.num_new_tokens))
        return run(batch)

    engine.runner.run = recording
    return steps


def record_threads(engine) -> list[tuple[int, int]]:
    """Each step's (tokens, torch threads of the thread running it)."""
    steps: list[tuple[int, int]] = []
    run = engine.runner.run

    def recording(batch):
        steps.append((sum(batch.num_new_tokens), torch.get_num_threads()))
        return run(batch)

    engine.runner.run = recording
    return steps


def teacher_forced(llm, prompts: list[list[int]], continuations: list[list[int]],
                   num_top: int = 5) -> list[list]:
    """Each prompt run as a greedy generation runs (its prefill, then a decode step a token,
    batched with the others, on whatever path the engine's steps take), but each step's token
    forced to its continuation's: per prompt, every position's TokenLogprob of the given
    token with the position's top num_top. Teacher forcing: two engines scoring the same
    tokens are compared at every position, not only up to where their own choices part."""
    from engine import SamplingParams

    script = {tuple(p): c for p, c in zip(prompts, continuations)}
    assert len(script) == len(prompts), "prompts must differ: a sequence is found by its prompt"
    runner = llm.engine.runner
    sample, sampler = runner._sample, runner.sampler

    def forced(seqs, logits, greedy):
        tokens = torch.tensor([script[tuple(s.token_ids[:s.num_prompt_tokens])][s.num_output_tokens] for s in seqs])
        runner.sampler = lambda *_args: tokens
        try:
            return sample(seqs, logits, greedy)
        finally:
            runner.sampler = sampler

    runner._sample = forced
    try:
        params = [SamplingParams(max_tokens=len(c), temperature=0, ignore_eos=True, logprobs=num_top) for c in continuations]
        outputs = llm.generate(prompts, params)
    finally:
        del runner._sample
    assert [o.token_ids for o in outputs] == [list(c) for c in continuations]
    return [o.logprobs for o in outputs]
