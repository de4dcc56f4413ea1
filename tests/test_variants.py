# bench/peers/variants.py: several designs of the app as applications of one Serve config, and
# the table of their alternating rounds.
from __future__ import annotations

from pathlib import Path

import yaml

from bench.peers.peer_table import TableWorkload
from loadtest.client.results import Summary, summarize_run, RunInfo
from loadtest.client.sse_reader import StreamRecord
from bench.peers.variants import Round, Variant, table, variants_config

ROOT = Path(__file__).resolve().parents[1]


def config_with_engine_keys(tmp_path: Path) -> Path:
    """configs/gpt2.yaml with an engine key of its own, which a variant's engine args must keep."""
    config = yaml.safe_load((ROOT / "configs" / "gpt2.yaml").read_text())
    config["applications"][0]["args"]["engine"] = {"max_num_seqs": 48}
    path = tmp_path / "base.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def test_each_variant_is_an_application_at_its_own_prefix_with_its_args_and_env(tmp_path: Path) -> None:
    variants = [Variant.parse("base", "{}"),
                Variant.parse("fast", '{"args": {"max_chunks_per_s": 50, "engine": {"num_threads": 2}},'
                                      ' "env": {"OMP_WAIT_POLICY": "passive"}}')]
    config = variants_config(config_with_engine_keys(tmp_path), tmp_path, "bfloat16", variants)
    base, fast = config["applications"]
    assert (base["name"], base["route_prefix"], fast["name"], fast["route_prefix"]) == ("base", "/base", "fast", "/fast")
    assert "runtime_env" not in base and fast["runtime_env"] == {"env_vars": {"OMP_WAIT_POLICY": "passive"}}
    assert fast["args"]["max_chunks_per_s"] == 50 and base["args"]["max_chunks_per_s"] == "auto"  # the file's own
    assert fast["args"]["engine"]["max_num_seqs"] == 48  # the file's other engine keys stay
    yaml.safe_dump(config)  # what serve run reads


def test_variants_ask_ray_for_token_cpus_and_keep_their_engine_threads(tmp_path: Path) -> None:
    variants = [Variant.parse("two", "{}"), Variant.parse("one", '{"args": {"engine_num_cpus": 0.75}}')]
    config = variants_config(ROOT / "configs" / "gpt2.yaml", tmp_path, "bfloat16", variants)
    two, one = config["applications"]
    # gpt2.yaml's engine_num_cpus 1.5 runs 2 torch threads (ceil); 0.75 runs 1, as build_app sizes them.
    assert (two["args"]["engine"]["num_threads"], one["args"]["engine"]["num_threads"]) == (2, 1)
    for app in (one, two):
        assert app["args"]["engine_num_cpus"] <= 0.01
        cpus = [d["ray_actor_options"]["num_cpus"] for d in app["deployments"] if d["name"] != "EngineDeployment"]
        assert cpus and all(c <= 0.01 for c in cpus)


def test_a_variant_with_an_unknown_key_is_refused() -> None:
    try:
        Variant.parse("bad", '{"arg": {}}')
    except SystemExit as exit_:
        assert "arg" in str(exit_)
    else:
        raise AssertionError("an unknown key was accepted")


def _result(tok_s: float, ttft_ms: float) -> object:
    record = StreamRecord(start=0.0, api="completions")
    result = summarize_run(RunInfo("x", "http://x", "completions"), TableWorkload().concurrent(), [record], 1.0)
    result.output_throughput = tok_s
    result.ttft_ms = Summary(ttft_ms, ttft_ms, ttft_ms, ttft_ms)
    return result


def test_the_table_has_every_round_and_each_variants_median() -> None:
    rounds = [Round("a", _result(100, 50), None), Round("b", _result(300, 10), None),
              Round("b", _result(200, 30), None), Round("a", _result(120, 40), None),
              Round("a", _result(110, 60), None), Round("b", _result(250, 20), None)]
    text = table([Variant("a", {}, {}), Variant("b", {}, {})], rounds, TableWorkload())
    lines = text.splitlines()
    assert len(lines) == 2 + 6 + 2
    assert lines[-2].startswith("| **median** | a | 110.0, 50.0 |")
    assert lines[-1].startswith("| **median** | b | 250.0, 20.0 |")
