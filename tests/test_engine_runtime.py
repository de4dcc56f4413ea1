# The engine replica's process environment: the replica's default variables, in the replica
# Ray starts (a real Serve instance, the tiny checkpoint); the app args that build it.
from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml

from deployments.app import AppArgs, build_app, engine_actor_options, engine_deployment_options
from deployments.replicas.engine_runtime import REPLICA_DEFAULTS
from deployments.replicas.ingress import ON_REPLICA_LOOP
from tests.serve_helpers import replica_process, running_app

ENGINE_ARGS = {"num_kv_blocks": 48, "max_num_seqs": 8, "max_num_batched_tokens": 128, "compile_decode": False}


def test_the_engine_gets_the_replica_defaults() -> None:
    assert engine_actor_options(AppArgs(), 0) == {"num_cpus": 0.5, "num_gpus": 0,
                                                  "runtime_env": {"env_vars": REPLICA_DEFAULTS}}
    assert REPLICA_DEFAULTS == {"RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0"}


@pytest.mark.parametrize("name, value", [("engine_cpu_bind", "auto"), ("engine_preload", ["tcmalloc"]),
                                         ("engine_env", {"KMP_AFFINITY": "disabled"})])
def test_a_removed_app_arg_is_refused_by_name(name: str, value: object) -> None:
    """Options measured and dropped: a config still setting one is told at build, not ignored."""
    with pytest.raises(ValueError, match=f"the app arg `{name}: .*` is gone"):
        build_app({"model": "gpt2", name: value})


@pytest.mark.parametrize("layout", ["engine", "deployment"])
def test_an_app_arg_choosing_where_the_routes_run_is_refused_by_name(layout: str) -> None:
    """The routes run in the Ingress deployment alone: a config still naming a layout is
    told so at build, not served in another."""
    with pytest.raises(ValueError, match=f"`ingress: {layout}` is gone"):
        build_app({"model": "gpt2", "ingress": layout})


def test_engine_cpu_replicas_sets_the_replica_count_on_cpu_and_never_on_gpus() -> None:
    """engine_cpu_replicas: 2 runs 2 CPU replicas, and the same config still runs as is on a 1-GPU machine."""
    args = AppArgs(engine_cpu_replicas=2, engine_num_cpus=0.75)
    assert engine_deployment_options(args, 0)["num_replicas"] == 2
    assert "num_replicas" not in engine_deployment_options(args, 1)
    assert "num_replicas" not in engine_deployment_options(AppArgs(), 0)  # the deployment's own


def test_an_unknown_app_arg_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="no_such_arg"):
        AppArgs.model_validate({"no_such_arg": 1})


def test_a_removed_engine_option_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="compile_attention"):
        build_app({"model": "gpt2", "engine_num_gpus": 0, "engine": {"compile_attention": True}})


@pytest.mark.parametrize("config", sorted((Path(__file__).resolve().parents[1] / "configs").glob("*.yaml")),
                         ids=lambda path: path.name)
def test_every_config_file_validates(config: Path) -> None:
    application = yaml.safe_load(config.read_text())["applications"][0]
    AppArgs.model_validate(application["args"])


def test_the_shipped_configs_app_builds_without_importing_torch() -> None:
    """`serve run` builds a config file's app in a Ray task of its own before any replica
    starts: torch there would be seconds on the way to the first answer. (In that task the
    cluster says how many GPUs it has; engine_num_gpus: 0 stands for a CPU cluster's answer.)"""
    code = ("import sys, yaml; from deployments.app import build_app; "
            "args = yaml.safe_load(open('configs/gpt2.yaml'))['applications'][0]['args']; "
            "build_app({**args, 'engine_num_gpus': 0}); "
            "print(sorted(m for m in ('torch', 'engine.core.llm_engine') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[1],
                            capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"


@pytest.fixture(scope="module")
def served_app(tiny_gpt2_dir: Path) -> Iterator[str]:
    app = build_app({"model": str(tiny_gpt2_dir), "dtype": "float32", "engine": ENGINE_ARGS,
                     "tokenizer_num_replicas": 1})
    with running_app(app, "rayinfer") as instance:
        yield instance.url


@pytest.mark.serve
def test_the_engine_replica_runs_with_the_replica_defaults_and_serves(served_app: str) -> None:
    replica = replica_process("EngineDeployment")
    assert replica.environ()["RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD"] == "0"
    body = {"prompt": "Hello", "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    response = httpx.post(f"{served_app}/v1/completions", json=body, timeout=60)
    assert response.status_code == 200
    assert response.json()["usage"]["completion_tokens"] == 4


@pytest.mark.serve
def test_the_ingress_replica_runs_its_routes_and_routers_on_its_own_loop(served_app: str) -> None:
    environ = replica_process("Ingress").environ()
    assert {name: environ.get(name) for name in ON_REPLICA_LOOP} == ON_REPLICA_LOOP

