"""The scale-out benchmark's workloads: requests on a shared prefix share its exact leading
tokens, the hot workload puts its share on one prefix, the prefix-free one shares nothing,
and the ideal hit count is one miss per prefix."""

from __future__ import annotations

import inspect
from collections import Counter

import yaml

from deployments.routing.router import PrefixAffinityRouter
from loadtest.scale.prefix_workloads import PrefixWorkload


def test_requests_on_one_prefix_share_exactly_its_tokens(gpt2_tokenizer):
    workload = PrefixWorkload("shared", num_requests=40, num_prefixes=4, prefix_tokens=64, suffix_tokens=8)
    by_prefix: dict[int, list[list[int]]] = {}
    for index, prompt in workload.requests():
        by_prefix.setdefault(index, []).append(gpt2_tokenizer.encode(prompt))
    for prompts in by_prefix.values():
        assert all(len(ids) == 72 for ids in prompts)
        assert len({tuple(ids[:64]) for ids in prompts}) == 1
        assert len({tuple(ids[64:]) for ids in prompts}) == len(prompts)
    assert len({tuple(prompts[0][:64]) for prompts in by_prefix.values()}) == 4


def test_the_hot_workload_puts_its_share_on_one_prefix():
    indices = Counter(index for index, _ in PrefixWorkload("hot", num_requests=500, hot_share=0.8).requests())
    assert 0.75 < indices[0] / 500 < 0.9


def test_the_prefix_free_workload_shares_no_prefix():
    requests = PrefixWorkload("free", num_requests=50, prefix_tokens=32).requests()
    assert {index for index, _ in requests} == {None}
    assert len({tuple(prompt.split()[:8]) for _, prompt in requests}) == 50
    assert PrefixWorkload("free").ideal_hit_tokens(16) == 0


def test_the_ideal_is_one_miss_per_prefix():
    workload = PrefixWorkload("shared", num_requests=30, num_prefixes=3, prefix_tokens=40)
    assert workload.ideal_hit_tokens(16) == (30 - 3) * 32


def test_each_setup_is_judged_against_its_routers_bound_with_the_routers_own_defaults(tmp_path):
    """scale_bench: the config's request_router_kwargs, then the setup's; what both leave
    out is what PrefixAffinityRouter itself defaults to."""
    from bench.scale.scale_bench import router_kwargs

    config = tmp_path / "router.yaml"
    config.write_text(yaml.safe_dump({"applications": [{"deployments": [{
        "name": "EngineDeployment",
        "request_router_config": {"request_router_kwargs": {"load_bound_eps": 0.5}}}]}]}))
    kwargs = router_kwargs(config, "prefix-router:load_unit=work:decode_token_cost=2")
    defaults = inspect.signature(PrefixAffinityRouter.initialize_state).parameters
    assert (kwargs["load_bound_eps"], kwargs["load_unit"], kwargs["decode_token_cost"]) == (0.5, "work", 2)
    assert kwargs["key_blocks"] == defaults["key_blocks"].default
    assert router_kwargs(config, "serve-default")["decode_token_cost"] == defaults["decode_token_cost"].default
