# The engine replica's process environment from a config file's args: preloaded libraries
# where this machine has them (skipped with a warning where not) and extra variables, in
# the replica Ray starts (a real Serve instance, the tiny checkpoint).
from __future__ import annotations

import logging
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from deployments.app import AppArgs, build_app, engine_actor_options, engine_deployment_options
from deployments.replicas.engine_runtime import REPLICA_DEFAULTS, engine_env_vars, resolve_library
from deployments.replicas.ingress import ON_REPLICA_LOOP
from tests.serve_helpers import replica_process, running_app

ENGINE_ARGS = {"num_kv_blocks": 48, "max_num_seqs": 8, "max_num_batched_tokens": 128, "compile_decode": False}


def test_a_library_path_resolves_to_itself_and_a_missing_one_to_none(tmp_path: Path) -> None:
    library = tmp_path / "libfake.so"
    library.write_bytes(b"")
    assert resolve_library(str(library)) == library
    assert resolve_library(str(tmp_path / "libabsent.so")) is None
    assert resolve_library("no-such-library-anywhere") is None


def test_missing_libraries_are_skipped_with_a_warning_and_the_rest_preloaded(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    library = tmp_path / "libfake.so"
    library.write_bytes(b"")
    with caplog.at_level(logging.WARNING, logger="deployments.replicas.engine_runtime"):
        env = engine_env_vars(["no-such-library-anywhere", str(library)], {"KMP_BLOCKTIME": "1", "LD_PRELOAD": "/x.so"})
    assert env == {**REPLICA_DEFAULTS, "KMP_BLOCKTIME": "1", "LD_PRELOAD": f"{library}:/x.so"}
    assert "'no-such-library-anywhere' not found" in caplog.text


def test_without_preload_or_env_the_engine_gets_the_replica_defaults_alone() -> None:
    assert engine_actor_options(AppArgs(), 0) == {"num_cpus": 0.5, "num_gpus": 0,
                                                  "runtime_env": {"env_vars": REPLICA_DEFAULTS}}
    assert REPLICA_DEFAULTS == {"RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0"}
    options = engine_actor_options(AppArgs(engine_env={"KMP_AFFINITY": "disabled"}), 0)
    assert options["runtime_env"] == {"env_vars": {**REPLICA_DEFAULTS, "KMP_AFFINITY": "disabled"}}
    # engine_env may take the default back
    back = engine_actor_options(AppArgs(engine_env={"RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "1"}), 0)
    assert back["runtime_env"] == {"env_vars": {"RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "1"}}


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


def test_a_config_key_that_is_not_a_string_map_is_refused() -> None:
    with pytest.raises(ValueError, match="engine_env"):
        AppArgs.model_validate({"engine_env": ["KMP_AFFINITY=disabled"]})


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
def preloaded_app(tiny_gpt2_dir: Path) -> Iterator[str]:
    app = build_app({"model": str(tiny_gpt2_dir), "dtype": "float32", "engine": ENGINE_ARGS,
                     "tokenizer_num_replicas": 1, "engine_preload": ["tcmalloc", "no-such-library-anywhere"],
                     "engine_env": {"RAYINFER_TEST_MARK": "engine-env"}})
    with running_app(app, "rayinfer") as instance:
        yield instance.url


@pytest.mark.serve
def test_the_engine_replica_runs_with_the_configured_environment_and_serves(preloaded_app: str) -> None:
    replica = replica_process("EngineDeployment")
    assert replica.environ().get("RAYINFER_TEST_MARK") == "engine-env"
    assert replica.environ()["RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD"] == "0"
    tcmalloc = resolve_library("tcmalloc")
    if tcmalloc is not None:  # present on this machine: loaded before anything else
        assert tcmalloc.resolve() in {Path(m.path) for m in replica.memory_maps()}  # maps show the real file
        assert replica.environ()["LD_PRELOAD"] == str(tcmalloc)
    else:
        assert "LD_PRELOAD" not in replica.environ()
    body = {"prompt": "Hello", "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    response = httpx.post(f"{preloaded_app}/v1/completions", json=body, timeout=60)
    assert response.status_code == 200
    assert response.json()["usage"]["completion_tokens"] == 4


@pytest.mark.serve
def test_the_ingress_replica_runs_its_routes_and_routers_on_its_own_loop(preloaded_app: str) -> None:
    environ = replica_process("Ingress").environ()
    assert {name: environ.get(name) for name in ON_REPLICA_LOOP} == ON_REPLICA_LOOP
    assert "RAYINFER_TEST_MARK" not in environ  # engine_env is the engine's alone

