"""LoRA adapters in PEFT's format, served from one base model: each adapter's greedy output is
PEFT's token for token (fp32, the reference path), alone and with three adapters and the base
model mixed in one batch, eager and on the compiled graph, which takes an adapter loaded after
it compiled without compiling again; the shipped dtype and graph score as HF fp32 does at
GPT-2-small's size. What the engine cannot serve exactly is refused at load time, by name;
max_loras slots hold the resident adapters, least recently used evicted, never one a running
request uses; and the prefix cache never shares KV between adapters."""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path

import peft
import pytest
import torch
import transformers

from bench.peers.peft_peer import peft_model
from engine import LLM, AsyncEngine, EngineConfig, SamplingParams
from engine.lora.adapter import LoraAdapterError, load_adapter
from engine.request.invalid_request import InvalidRequestError
from tests.engine_helpers import hf_model, mixed_prompts, record_steps

MAX_TOKENS = 16
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
# Three adapters of different ranks, targets and scalings (rsLoRA for "b").
ADAPTERS = {
    "a": dict(r=4, lora_alpha=8, target_modules=["c_attn"]),
    "b": dict(r=8, lora_alpha=16, target_modules=["c_proj", "c_fc"], use_rslora=True),
    "c": dict(r=16, lora_alpha=16, target_modules=["c_attn", "c_proj", "c_fc"]),
}


def save_adapter(base_dir: Path, directory: Path, seed: int, **lora_config) -> Path:
    """A non-zero PEFT adapter of base_dir's model (PEFT's init_lora_weights=False: random A and B)."""
    torch.manual_seed(seed)
    model = transformers.GPT2LMHeadModel.from_pretrained(base_dir)
    peft.get_peft_model(model, peft.LoraConfig(init_lora_weights=False, **lora_config)).save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def adapters(tiny_gpt2_dir, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("loras")
    return {name: save_adapter(tiny_gpt2_dir, root / name, seed, **config)
            for seed, (name, config) in enumerate(ADAPTERS.items())}


@pytest.fixture(scope="module")
def peft_fp32(tiny_gpt2_dir, adapters) -> peft.PeftModel:
    return peft_model(hf_model(tiny_gpt2_dir), adapters)


def peft_greedy(model: peft.PeftModel, prompts: list[list[int]], names: list[str | None],
                max_new_tokens: int = MAX_TOKENS) -> list[list[int]]:
    """PEFT's greedy continuations of equal-length prompts in one batch, each row under its
    adapter (None: the base model): PEFT's own mixed-adapter batch."""
    assert len({len(p) for p in prompts}) == 1, "one batch without padding"
    with torch.inference_mode():
        out = model.generate(input_ids=torch.tensor(prompts), attention_mask=torch.ones(len(prompts), len(prompts[0]), dtype=torch.long),
                             max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, do_sample=False,
                             eos_token_id=None, pad_token_id=0, adapter_names=[n or "__base__" for n in names])
    return out[:, len(prompts[0]):].tolist()


def lora_llm(model_dir: Path, adapters: dict[str, Path], **config) -> LLM:
    options = dict(weights="pretrained", dtype="float32", device="cpu", linears="reference", compile_decode=False,
                   max_loras=3, max_lora_rank=16)
    llm = LLM(str(model_dir), **{**options, **config})
    for name, path in adapters.items():
        llm.engine.add_lora(name, str(path))
    return llm


def equal_length_prompts(num: int, length: int = 20, seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 50257, (num, length), generator=generator).tolist()


# --- correctness against PEFT -----------------------------------------------------------


def test_each_adapter_alone_is_peft_token_for_token_and_not_the_base_model(tiny_gpt2_dir, adapters, peft_fp32):
    llm = lora_llm(tiny_gpt2_dir, adapters)
    prompts = mixed_prompts(4)[1:]  # 3, 7 and 16 tokens
    for prompt in prompts:
        base = llm.generate([prompt], GREEDY)[0].token_ids
        assert base == peft_greedy(peft_fp32, [prompt], [None])[0]
        for name in adapters:
            ours = llm.generate([prompt], GREEDY, lora_name=name)[0].token_ids
            assert ours == peft_greedy(peft_fp32, [prompt], [name])[0], f"adapter {name}, prompt of {len(prompt)}"
            assert ours != base, f"adapter {name} does not change the output: the test would prove nothing"
    llm.engine.check_integrity()


def test_three_adapters_and_the_base_model_in_one_batch_are_peft_s_mixed_batch(tiny_gpt2_dir, adapters, peft_fp32):
    llm = lora_llm(tiny_gpt2_dir, adapters)
    steps = record_steps(llm.engine)
    prompts = equal_length_prompts(8)
    names = ["a", "b", "c", None, "c", None, "a", "b"]
    outputs = llm.generate(prompts, GREEDY, lora_name=names)
    assert steps[0] == [20] * 8  # every row, every adapter, in one step from the first
    assert [o.token_ids for o in outputs] == peft_greedy(peft_fp32, prompts, names)
    stats = llm.engine.lora_stats()
    assert stats.requests == {"a": 2, "b": 2, "c": 2}
    assert stats.generated_tokens == {name: 2 * MAX_TOKENS for name in "abc"}
    assert stats.prompt_tokens == {name: 2 * 20 for name in "abc"}
    assert (stats.num_adapters, stats.num_resident, stats.num_loads, stats.num_evictions) == (3, 3, 3, 0)
    llm.engine.check_integrity()
    assert llm.engine.stats().num_kv_blocks_used == 0


def test_chunked_prefill_of_mixed_adapters_is_peft_s(tiny_gpt2_dir, adapters, peft_fp32):
    """Prompts longer than a step's budget, prefilled in chunks beside other adapters' decodes."""
    llm = lora_llm(tiny_gpt2_dir, adapters, max_num_batched_tokens=16, max_num_seqs=4)
    prompts = equal_length_prompts(4, length=40, seed=1)
    names = [None, "a", "b", "c"]
    assert [o.token_ids for o in llm.generate(prompts, GREEDY, lora_name=names)] == peft_greedy(peft_fp32, prompts, names)


def test_preempted_requests_give_back_their_slots_and_recompute_under_their_adapters(tiny_gpt2_dir, adapters,
                                                                                     peft_fp32):
    """A block pool too small for the batch, two slots for three adapters: preempted requests
    unpin their adapters, and when readmitted take a slot again (maybe another) and recompute."""
    llm = lora_llm(tiny_gpt2_dir, adapters, max_loras=2, num_kv_blocks=6, max_num_batched_tokens=64)
    prompts = equal_length_prompts(6, length=20, seed=8)
    names = ["a", "b", "c", None, "a", "c"]
    outputs = llm.generate(prompts, GREEDY, lora_name=names)
    assert llm.engine.stats().num_preemptions > 0
    assert [o.token_ids for o in outputs] == peft_greedy(peft_fp32, prompts, names)
    llm.engine.check_integrity()


def num_compiled_graphs() -> int:
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def test_the_compiled_graph_takes_adapters_loaded_after_it_compiled_and_agrees_with_eager(tiny_gpt2_dir, adapters):
    """The graphs (the base model's, and the one of steps with adapter rows) compile while the
    engine is built, before any adapter is known; the adapters' weights are inputs (not
    constants frozen in, as `linears: reference` freezes the base weights), so adapters added
    later run on it, mixed, with no new compile."""
    compiled = LLM(str(tiny_gpt2_dir), weights="pretrained", dtype="float32", device="cpu", linears="reference",
                   compile_decode=True, max_loras=3)
    graphs = num_compiled_graphs()
    eager = lora_llm(tiny_gpt2_dir, adapters)
    for name, path in adapters.items():
        compiled.engine.add_lora(name, str(path))
    prompts = equal_length_prompts(8, seed=2)
    names = [None, "a", "b", "c"] * 2
    ours = compiled.generate(prompts, GREEDY, lora_name=names)
    assert [o.token_ids for o in ours] == [o.token_ids for o in eager.generate(prompts, GREEDY, lora_name=names)]
    assert compiled.engine.runner.decode_graph.num_steps >= MAX_TOKENS - 1  # the decodes took the graph
    base_only = compiled.generate(prompts[:2], GREEDY)  # the base model's own graph, compiled beside
    assert [o.token_ids for o in base_only] == [o.token_ids for o in eager.generate(prompts[:2], GREEDY)]
    assert compiled.engine.runner.decode_graph.num_steps >= 2 * (MAX_TOKENS - 1)
    assert num_compiled_graphs() == graphs
    compiled.engine.check_integrity()


ERROR_FACTOR, FLOOR = 4, {"bfloat16": 0.125, "float32": 0.01}  # the shipped-config test's (test_serve_run.py)


@pytest.fixture(scope="module")
def gpt2_small_with_adapter(tmp_path_factory, peaked_gpt2_small_dir) -> tuple[Path, Path]:
    model_dir = peaked_gpt2_small_dir
    adapter = save_adapter(model_dir, tmp_path_factory.mktemp("gpt2-small-lora") / "all", 0, r=8, lora_alpha=16,
                           target_modules=["c_attn", "c_proj", "c_fc"])
    return model_dir, adapter


def test_the_shipped_dtype_and_graph_with_an_adapter_score_as_hf_fp32_at_gpt2_small_size(gpt2_small_with_adapter):
    """GPT-2-small in this CPU's dtype (the shipped config), an adapter's rows and base rows in
    one batch, prompts scored on an eager prefill step (prompt logprobs keep a step off the
    graph) and tokens decoded on the compiled graph: every prompt token's and generated token's
    logprob is within ERROR_FACTOR x HF-PEFT's own error in that dtype + FLOOR of HF-PEFT fp32's,
    teacher-forced on the same tokens, and every generated token is in HF fp32's top 5."""
    model_dir, adapter = gpt2_small_with_adapter
    llm = LLM(str(model_dir), weights="pretrained", device="cpu", num_kv_blocks=64, max_num_seqs=8, max_loras=1)
    llm.engine.add_lora("all", str(adapter))
    dtype = llm.engine.model_info.dtype
    prompts, names = equal_length_prompts(4, length=12, seed=3), ["all", None, "all", None]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=1, prompt_logprobs=1)
    outputs = llm.generate(prompts, params, lora_name=names)
    assert llm.engine.runner.decode_graph.num_steps >= 7  # the decodes took the graph
    fp32_reference = peft_model(hf_model(model_dir, torch.float32), {"all": adapter})
    reference = fp32_reference if dtype == "float32" else peft_model(hf_model(model_dir, getattr(torch, dtype)),
                                                                      {"all": adapter})  # an AVX2 CPU's dtype is fp32
    outside, not_top5 = [], []
    for index, (prompt, name, out) in enumerate(zip(prompts, names, outputs)):
        tokens = prompt + out.token_ids
        fp32, in_dtype = score(fp32_reference, tokens, name), score(reference, tokens, name)
        ours = [entry.logprob for entry in out.prompt_logprobs[1:]] + [entry.logprob for entry in out.logprobs]
        assert len(ours) == len(tokens) - 1
        for position, (token, logprob) in enumerate(zip(tokens[1:], ours)):
            expected = fp32[position, token].item()
            hf_error, error = abs(in_dtype[position, token].item() - expected), abs(logprob - expected)
            if error > ERROR_FACTOR * hf_error + FLOOR[dtype]:
                outside.append(f"prompt {index}, position {position}: off by {error:.4f}, HF {dtype} by {hf_error:.4f}")
            if position >= len(prompt) - 1 and token not in fp32[position].topk(5).indices.tolist():
                not_top5.append(f"prompt {index}, position {position}")
    assert outside == [] and not_top5 == [], (outside, not_top5)


def score(model: peft.PeftModel, tokens: list[int], name: str | None) -> torch.Tensor:
    """[len(tokens) - 1, vocab]: HF's log-softmax of each next token given the ones before it,
    under the adapter (None: the base model)."""
    with torch.inference_mode():
        logits = model(torch.tensor([tokens[:-1]]), adapter_names=[name or "__base__"]).logits
    return logits[0].float().log_softmax(-1)


def test_the_async_engine_loads_adapters_on_its_step_loop_and_streams_each_request_under_its_own(
        tiny_gpt2_dir, adapters, peft_fp32):
    """What the serving layer wires: add_lora / list_loras / remove_lora, generate(lora_name=)."""
    engine = AsyncEngine(EngineConfig(model=str(tiny_gpt2_dir), weights="pretrained", dtype="float32", device="cpu",
                                      linears="reference", compile_decode=False, max_loras=2))
    prompts, names = equal_length_prompts(3, seed=7), ["a", None, "b"]

    async def tokens(request_id: str, prompt: list[int], name: str | None) -> list[int]:
        return [t async for chunk in engine.generate(request_id, prompt, GREEDY, lora_name=name) for t in chunk.token_ids]

    async def main():
        for name in ("a", "b"):
            assert (await engine.add_lora(name, str(adapters[name]))).rank == ADAPTERS[name]["r"]
        assert [info.name for info in await engine.list_loras()] == ["a", "b"]
        outputs = await asyncio.gather(*(tokens(str(i), p, n) for i, (p, n) in enumerate(zip(prompts, names))))
        with pytest.raises(InvalidRequestError, match="LoRA adapter 'c' is not loaded"):
            await tokens("x", prompts[0], "c")
        assert await engine.remove_lora("a")
        return outputs, await engine.lora_stats()

    try:
        outputs, stats = asyncio.run(main())
    finally:
        engine.shutdown()
    assert outputs == peft_greedy(peft_fp32, prompts, names)
    assert stats.requests == {"a": 1, "b": 1} and stats.num_adapters == 1


# --- refusals ---------------------------------------------------------------------------


def edited(adapter: Path, directory: Path, **changes) -> Path:
    """A copy of the adapter with adapter_config.json's fields changed."""
    shutil.copytree(adapter, directory)
    config = json.loads((directory / "adapter_config.json").read_text())
    (directory / "adapter_config.json").write_text(json.dumps({**config, **changes}))
    return directory


def test_a_directory_without_an_adapter_or_with_a_corrupt_one_is_refused_by_name(adapters, tmp_path):
    with pytest.raises(LoraAdapterError, match=r"'none': no adapter_config.json in"):
        load_adapter("none", tmp_path, tiny_config(), max_rank=16)
    corrupt = tmp_path / "corrupt"
    shutil.copytree(adapters["a"], corrupt)
    (corrupt / "adapter_model.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(LoraAdapterError, match=r"'corrupt': cannot read adapter_model.safetensors"):
        load_adapter("corrupt", corrupt, tiny_config(), max_rank=16)


def test_an_adapter_saved_as_bin_loads_as_its_safetensors_twin(adapters, tmp_path):
    from safetensors.torch import load_file

    as_bin = tmp_path / "bin"
    shutil.copytree(adapters["b"], as_bin)
    torch.save(load_file(as_bin / "adapter_model.safetensors"), as_bin / "adapter_model.bin")
    (as_bin / "adapter_model.safetensors").unlink()
    ours, twin = (load_adapter("b", path, tiny_config(), max_rank=16) for path in (as_bin, adapters["b"]))
    assert ours.weights.keys() == twin.weights.keys() and len(ours.weights) == 2 * 3  # layers x (attn and mlp c_proj, c_fc)
    assert all(torch.equal(x, y) for key in ours.weights for x, y in zip(ours.weights[key], twin.weights[key]))
    assert ours.scaling == twin.scaling == 16 / 8 ** 0.5  # rsLoRA: alpha / sqrt(r)


def tiny_config() -> transformers.GPT2Config:
    return transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=50257)


def test_a_dora_adapter_is_refused_by_name(tiny_gpt2_dir, tmp_path):
    dora = save_adapter(tiny_gpt2_dir, tmp_path / "dora", 0, r=4, target_modules=["c_attn"], use_dora=True)
    with pytest.raises(LoraAdapterError, match=r"'dora': use_dora=True is not supported"):
        load_adapter("dora", dora, tiny_config(), max_rank=16)


def test_an_unknown_target_module_is_refused_by_name(adapters, tmp_path):
    other = edited(adapters["a"], tmp_path / "q", target_modules=["c_attn", "q_proj"])
    with pytest.raises(LoraAdapterError, match=r"target module\(s\) \['q_proj'\] not supported"):
        load_adapter("q", other, tiny_config(), max_rank=16)


def test_a_rank_past_max_lora_rank_is_refused_by_the_engine(tiny_gpt2_dir, adapters):
    llm = LLM(str(tiny_gpt2_dir), weights="pretrained", dtype="float32", device="cpu", compile_decode=False,
              max_loras=1, max_lora_rank=8)
    with pytest.raises(ValueError, match=r"'c': rank r=16 exceeds max_lora_rank=8"):
        llm.engine.add_lora("c", str(adapters["c"]))
    assert llm.engine.list_loras() == []


def test_an_adapter_of_a_model_of_another_shape_is_refused_by_name(tmp_path):
    small = tmp_path / "base32"
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=50257)
    transformers.GPT2LMHeadModel(config).save_pretrained(small)
    adapter = save_adapter(small, tmp_path / "a32", 0, r=4, target_modules=["c_fc"])
    with pytest.raises(LoraAdapterError, match=r"layer 0 mlp_fc: lora_A \(4, 32\), lora_B \(128, 4\) do not fit "
                                               r"the base model's 64 -> 256"):
        load_adapter("a32", adapter, tiny_config(), max_rank=16)


@pytest.mark.parametrize("change, named", [
    ({"bias": "all"}, r"bias='all' is not supported"),
    ({"layers_to_transform": [0]}, r"layers_to_transform=\[0\] is not supported"),
    ({"target_modules": ".*c_attn"}, r"must list module names \(no regex\)"),
    ({"peft_type": "IA3"}, r"peft_type 'IA3' is not LORA"),
])
def test_other_options_the_engine_cannot_serve_are_refused_by_name(adapters, tmp_path, change, named):
    with pytest.raises(LoraAdapterError, match=named):
        load_adapter("x", edited(adapters["a"], tmp_path / "x", **change), tiny_config(), max_rank=16)


def test_lora_off_is_the_default_and_refuses_adapters_and_requests_naming_one(tiny_gpt2_dir, adapters):
    llm = LLM(str(tiny_gpt2_dir), weights="pretrained", dtype="float32", device="cpu", compile_decode=False)
    assert EngineConfig().max_loras == 0 and EngineConfig().max_lora_rank == 16
    assert llm.engine.loras is None and llm.engine.runner.lora is None and llm.engine.scheduler.loras is None
    with pytest.raises(ValueError, match="LoRA is off: start the engine with max_loras > 0"):
        llm.engine.add_lora("a", str(adapters["a"]))
    with pytest.raises(InvalidRequestError, match="LoRA adapter 'a' is not loaded") as error:
        llm.generate([[1, 2, 3]], GREEDY, lora_name="a")
    assert error.value.param == "model"
    for bad in ({"max_loras": -1}, {"max_loras": 1.5}, {"max_lora_rank": 0}):
        with pytest.raises(ValueError, match=f"{next(iter(bad))} must be"):
            EngineConfig(**bad)


# --- slots: LRU eviction, pins ----------------------------------------------------------


def resident(llm: LLM) -> set[str]:
    return {info.name for info in llm.engine.list_loras() if info.is_resident}


def test_two_slots_for_three_adapters_evict_the_least_recently_used(tiny_gpt2_dir, adapters, peft_fp32):
    llm = lora_llm(tiny_gpt2_dir, adapters, max_loras=2)
    prompt = equal_length_prompts(1, seed=4)
    expected = {name: peft_greedy(peft_fp32, prompt, [name])[0] for name in "abc"}
    for name, then_resident in [("a", {"a"}), ("b", {"a", "b"}), ("a", {"a", "b"}), ("c", {"a", "c"}),
                                ("b", {"b", "c"})]:
        assert llm.generate(prompt, GREEDY, lora_name=name)[0].token_ids == expected[name]
        assert resident(llm) == then_resident, f"after {name}"
    stats = llm.engine.lora_stats()
    assert (stats.num_loads, stats.num_evictions) == (4, 2)
    llm.engine.check_integrity()


def test_an_adapter_a_running_request_uses_is_never_evicted_a_third_waits_for_a_slot(tiny_gpt2_dir, adapters,
                                                                                      peft_fp32):
    llm = lora_llm(tiny_gpt2_dir, adapters, max_loras=2)
    engine = llm.engine
    prompts = equal_length_prompts(4, seed=5)
    names = ["a", "b", "c", None]
    for index, (prompt, name) in enumerate(zip(prompts, names)):
        engine.add_request(str(index), prompt, SamplingParams(max_tokens=MAX_TOKENS - 4 * index, temperature=0,
                                                              ignore_eos=True), lora_name=name)
    tokens: dict[str, list[int]] = {str(i): [] for i in range(4)}
    waited = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.request_id].append(out.token_id)
        running = {s.lora_name for s in engine.scheduler.running}
        assert running - {None} <= resident(llm)  # every running adapter holds its slot
        waited += any(s.lora_name == "c" for s in engine.scheduler.waiting)
        engine.check_integrity()
    assert waited > 0  # "c" found both slots pinned (the base request did not wait)
    assert resident(llm) == {"a", "c"}  # "b" ended first (fewer tokens): its slot went to "c"
    for index, (prompt, name) in enumerate(zip(prompts, names)):
        assert tokens[str(index)] == peft_greedy(peft_fp32, [prompt], [name], MAX_TOKENS - 4 * index)[0]


def test_an_adapter_in_use_cannot_be_removed_and_an_unused_one_can(tiny_gpt2_dir, adapters):
    llm = lora_llm(tiny_gpt2_dir, {"a": adapters["a"]})
    llm.engine.add_request("r", [1, 2, 3], GREEDY, lora_name="a")
    with pytest.raises(ValueError, match=r"LoRA adapter 'a' is in use by 1 request\(s\), e.g. 'r'"):
        llm.engine.remove_lora("a")
    llm.engine.abort_request("r")
    assert llm.engine.remove_lora("a") and llm.engine.list_loras() == [] and not llm.engine.remove_lora("a")
    llm.engine.add_lora("b", str(adapters["b"]))
    with pytest.raises(ValueError, match="'b' is already loaded"):
        llm.engine.add_lora("b", str(adapters["b"]))
    llm.engine.check_integrity()


# --- prefix cache -----------------------------------------------------------------------


def test_the_same_prompt_under_two_adapters_shares_no_kv_blocks(tiny_gpt2_dir, adapters, peft_fp32):
    llm = lora_llm(tiny_gpt2_dir, adapters)
    prompt = equal_length_prompts(1, length=50, seed=6)  # three full blocks of 16
    blocks = llm.engine.block_manager
    for name in ("a", "b", None):
        assert llm.generate(prompt, GREEDY, lora_name=name)[0].token_ids == peft_greedy(peft_fp32, prompt, [name])[0]
        assert blocks.num_prefix_hit_tokens == 0, f"{name} took another adapter's blocks"
    assert llm.generate(prompt, GREEDY, lora_name="b")[0].token_ids == peft_greedy(peft_fp32, prompt, ["b"])[0]
    assert blocks.num_prefix_hit_tokens == 48  # its own blocks, once more
    llm.engine.check_integrity()
