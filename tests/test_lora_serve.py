"""LoRA adapters over real HTTP, against real Ray Serve serving the tiny checkpoint and real
PEFT adapters: a request's `model` names an adapter declared in the config (`lora_modules`)
or loaded at run time (`/v1/load_lora_adapter`), streamed or not, and its greedy output is
the offline engine's under the same adapter, not the base model's; the response names the
adapter; /v1/models lists each adapter with the base model as parent; a name loaded again
reads its files again. The engine holds one
adapter at a time (max_loras 1), so adapters named in turn, or at once, evict each other and
each still answers as under it alone. An unknown name is a
404, a path that leaves lora_dir a 400 with nothing read, an adapter the engine refuses a
400 naming why; an unloaded adapter is a 404 at once while the request streaming under it
finishes. Args that cannot work are refused when the app is built. (Without
allow_runtime_lora_updating the routes do not exist: tests/test_serve_api.py, whose app has
the default args.)"""

from __future__ import annotations

import asyncio
import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from ray import serve

from deployments.api.lora_catalog import check_one_ingress_replica
from deployments.app import DEFAULT_MAX_LORAS, AppArgs, engine_config, make_app
from engine import LLM, SamplingParams
from tests.http_helpers import PROMPTS, Stream, assert_openai_error, run_async, sse_payloads
from tests.serve_helpers import MODEL, deleted_at_exit, running_app, shared_serve, tiny_app_args
from tests.test_lora import save_adapter

pytestmark = pytest.mark.serve

APP = "lora"
KEY = "sk-lora"
MAX_TOKENS = 12
MAX_LORA_RANK = 8
ADAPTERS = {  # saved under lora_dir; "sql" is declared in the config, the others loaded at run time
    "sql": dict(r=4, lora_alpha=8, target_modules=["c_attn"]),
    "poem": dict(r=8, lora_alpha=16, target_modules=["c_proj", "c_fc"], use_rslora=True),
    "wide": dict(r=16, lora_alpha=16, target_modules=["c_attn"]),  # past MAX_LORA_RANK
}


@pytest.fixture(scope="module")
def lora_dir(tiny_gpt2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("adapters")
    for seed, (name, config) in enumerate(ADAPTERS.items()):
        save_adapter(tiny_gpt2_dir, root / name, seed, **config)
    return root


@pytest.fixture(scope="module")
def outside(lora_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A good adapter outside lora_dir (loaded, it would serve), and a symlink to it inside."""
    directory = tmp_path_factory.mktemp("elsewhere") / "adapter"
    shutil.copytree(lora_dir / "poem", directory)
    (lora_dir / "escape").symlink_to(directory, target_is_directory=True)
    return directory


def lora_args(model_dir: Path, lora_dir: Path, **overrides) -> dict:
    return tiny_app_args(model_dir, lora_dir=str(lora_dir), lora_modules={"sql": "sql"}, api_keys=[KEY],
                         allow_runtime_lora_updating=True, engine={"max_lora_rank": MAX_LORA_RANK, "max_loras": 1},
                         **overrides)


@pytest.fixture(scope="module")
def base_url(tiny_gpt2_dir: Path, lora_dir: Path, outside: Path) -> Iterator[str]:
    with running_app(make_app(lora_args(tiny_gpt2_dir, lora_dir)), APP) as instance:
        yield instance.url


@pytest.fixture(scope="module")
def http_headers() -> dict[str, str]:
    return {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def oai(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def offline(tiny_gpt2_dir: Path, lora_dir: Path) -> dict[str | None, list[str]]:
    """The offline engine's greedy texts of PROMPTS, by adapter (None: the base model)."""
    llm = LLM(str(tiny_gpt2_dir), dtype="float32", compile_decode=False, max_loras=2, max_lora_rank=MAX_LORA_RANK)
    for name in ("sql", "poem"):
        llm.engine.add_lora(name, str(lora_dir / name))
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    return {name: [out.text for out in llm.generate(PROMPTS, params, lora_name=name)] for name in (None, "sql", "poem")}


def greedy(model: str, prompt: str, **fields) -> dict:
    return {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
            **fields}


def streamed_text(http: httpx.Client, body: dict) -> tuple[str, set[str]]:
    """A streamed completion's text and the `model` its chunks name."""
    with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
        assert response.status_code == 200, response.read()
        chunks = [json.loads(p) for p in sse_payloads(response) if p != "[DONE]"]
    return "".join(c["choices"][0]["text"] for c in chunks), {c["model"] for c in chunks}


def load(http: httpx.Client, name: str, path: str) -> httpx.Response:
    return http.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path})


def unload(http: httpx.Client, name: str) -> httpx.Response:
    return http.post("/v1/unload_lora_adapter", json={"lora_name": name})


@pytest.fixture
def poem(http: httpx.Client) -> Iterator[str]:
    """The "poem" adapter loaded at run time for one test, unloaded after it (if still there)."""
    response = load(http, "poem", "poem")
    assert (response.status_code, response.text) == (200, "Success: LoRA adapter 'poem' added successfully.")
    yield "poem"
    unload(http, "poem")


def test_a_declared_adapter_answers_as_the_offline_engine_under_it_not_as_the_base_model(
        oai: openai.OpenAI, offline: dict) -> None:
    for i, prompt in enumerate(PROMPTS):
        completion = oai.completions.create(model="sql", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                            extra_body={"ignore_eos": True})
        assert completion.model == "sql"
        assert completion.choices[0].text == offline["sql"][i]
    assert offline["sql"] != offline[None]
    base = oai.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert (base.model, base.choices[0].text) == (MODEL, offline[None][0])


def test_a_declared_adapter_streams_the_same_text_and_names_itself_in_every_chunk(
        http: httpx.Client, offline: dict) -> None:
    assert streamed_text(http, greedy("sql", PROMPTS[1])) == (offline["sql"][1], {"sql"})


def test_chat_names_the_adapter_streamed_and_not(oai: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "Hi"}]
    chat = oai.chat.completions.create(model="sql", messages=messages, max_tokens=4, temperature=0)
    chunks = list(oai.chat.completions.create(model="sql", messages=messages, max_tokens=4, temperature=0,
                                              stream=True))
    assert chat.model == "sql" and {c.model for c in chunks} == {"sql"}
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == chat.choices[0].message.content


def test_models_lists_the_base_model_then_each_adapter_with_the_base_model_as_parent(
        oai: openai.OpenAI, http: httpx.Client, lora_dir: Path, poem: str) -> None:
    cards = {card["id"]: card for card in http.get("/v1/models").json()["data"]}
    assert list(cards) == [MODEL, "sql", "poem"]
    assert cards[MODEL]["parent"] is None
    for name in ("sql", "poem"):
        assert {k: cards[name][k] for k in ("object", "root", "parent")} == \
            {"object": "model", "root": str((lora_dir / name).resolve()), "parent": MODEL}
    assert [model.id for model in oai.models.list()] == [MODEL, "sql", "poem"]


def test_an_adapter_loaded_at_run_time_answers_as_the_offline_engine_streamed_and_not(
        http: httpx.Client, offline: dict, poem: str) -> None:
    whole = http.post("/v1/completions", json=greedy(poem, PROMPTS[2])).json()
    assert (whole["model"], whole["choices"][0]["text"]) == (poem, offline["poem"][2])
    assert streamed_text(http, greedy(poem, PROMPTS[2])) == (offline["poem"][2], {poem})
    assert offline["poem"] != offline[None] and offline["poem"] != offline["sql"]


def test_adapters_through_one_slot_evict_each_other_in_turn_and_at_once_and_each_answers_as_under_it_alone(
        base_url: str, http_headers: dict, http: httpx.Client, offline: dict, poem: str) -> None:
    for name in ("sql", poem, "sql", poem):  # each request's adapter evicts the other from the one slot
        answer = http.post("/v1/completions", json=greedy(name, PROMPTS[2])).json()
        assert answer["choices"][0]["text"] == offline[name][2]

    async def at_once(client: httpx.AsyncClient) -> list[httpx.Response]:  # one waits for the slot
        bodies = [greedy(name, PROMPTS[i]) for i in range(3) for name in ("sql", poem)]
        return await asyncio.gather(*(client.post("/v1/completions", json=body) for body in bodies))

    answers = run_async(at_once, base_url, http_headers)
    assert [a.json()["choices"][0]["text"] for a in answers] == \
        [offline[name][i] for i in range(3) for name in ("sql", poem)]


def test_an_unloaded_adapter_is_a_404_and_its_name_can_be_loaded_again(http: httpx.Client, poem: str) -> None:
    assert (unload(http, poem).status_code, unload(http, poem).status_code) == (200, 404)
    assert_openai_error(http.post("/v1/completions", json=greedy(poem, "Hi")), 404, "invalid_request_error", "model")
    assert load(http, poem, poem).status_code == 200
    assert http.post("/v1/completions", json=greedy(poem, "Hi")).status_code == 200


def test_a_name_loaded_again_from_the_same_path_answers_as_the_files_there_now(
        http: httpx.Client, lora_dir: Path, offline: dict) -> None:
    """Unloaded, its files rewritten in place (a new fine-tune saved over the old one), and
    loaded again under the same name and path: the answers are the new files', as vLLM reads
    them again, never the adapter the engine replica read before."""
    directory = lora_dir / "rewritten"
    shutil.copytree(lora_dir / "poem", directory)
    try:
        for source in ("poem", "sql"):
            if source == "sql":
                assert unload(http, "rewritten").status_code == 200
                shutil.rmtree(directory)
                shutil.copytree(lora_dir / source, directory)
            assert load(http, "rewritten", "rewritten").status_code == 200
            answer = http.post("/v1/completions", json=greedy("rewritten", PROMPTS[0])).json()
            assert answer["choices"][0]["text"] == offline[source][0]
    finally:
        unload(http, "rewritten")
        shutil.rmtree(directory, ignore_errors=True)


def test_loading_a_name_already_served_is_a_400(http: httpx.Client) -> None:
    for name in ("sql", MODEL):
        assert_openai_error(load(http, name, "poem"), 400, "invalid_request_error", "lora_name")


def test_an_unknown_model_is_a_404_in_openai_s_shape(http: httpx.Client) -> None:
    assert_openai_error(http.post("/v1/completions", json=greedy("nope", "Hi")), 404, "invalid_request_error", "model")
    chat = {"model": "nope", "messages": [{"role": "user", "content": "Hi"}]}
    assert_openai_error(http.post("/v1/chat/completions", json=chat), 404, "invalid_request_error", "model")
    assert_openai_error(unload(http, "nope"), 404, "invalid_request_error", "lora_name")


def test_a_path_outside_lora_dir_is_a_400_and_nothing_there_is_read(http: httpx.Client, outside: Path) -> None:
    """The adapter outside is a good one: read, it would load (a 200) and be listed."""
    for path in ("../" + outside.parent.name + "/adapter", "escape", str(outside), "sql/../../x", "sql\x00"):
        error = assert_openai_error(load(http, "out", path), 400, "invalid_request_error", "lora_path")
        assert "does not resolve inside the adapters directory" in error["message"]
    assert "out" not in [card["id"] for card in http.get("/v1/models").json()["data"]]


def test_an_adapter_the_engine_refuses_is_a_400_naming_why_and_is_not_listed(http: httpx.Client) -> None:
    error = assert_openai_error(load(http, "wide", "wide"), 400, "invalid_request_error", "lora_path")
    assert f"rank r=16 exceeds max_lora_rank={MAX_LORA_RANK}" in error["message"]
    error = assert_openai_error(load(http, "empty", "."), 400, "invalid_request_error", "lora_path")
    assert "no adapter_config.json" in error["message"]
    assert_openai_error(http.post("/v1/completions", json=greedy("wide", "Hi")), 404, "invalid_request_error", "model")


def test_the_load_routes_need_the_api_key(base_url: str) -> None:
    with httpx.Client(base_url=base_url) as anonymous:
        assert anonymous.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "poem"}).status_code == 401
        assert anonymous.post("/v1/unload_lora_adapter", json={"lora_name": "sql"}).status_code == 401


def test_a_request_streaming_under_an_adapter_unloaded_meanwhile_finishes(
        base_url: str, http_headers: dict, poem: str) -> None:
    async def scenario(client: httpx.AsyncClient) -> Stream:
        stream = Stream(client, greedy(poem, PROMPTS[0], max_tokens=400, stream=True))
        await stream.first_chunk.wait()
        assert (await client.post("/v1/unload_lora_adapter", json={"lora_name": poem})).status_code == 200
        refused = await client.post("/v1/completions", json=greedy(poem, "Hi"))
        assert refused.status_code == 404 and not stream.task.done()
        await stream.task
        return stream

    stream = run_async(scenario, base_url, http_headers)
    assert stream.status == 200 and stream.error is None and stream.payloads[-1] == "[DONE]"
    assert json.loads(stream.payloads[-2])["choices"][0]["finish_reason"] == "length"


# Args that cannot work are refused when the app is built, naming the arg.


def build(tmp_path: Path, **args) -> None:
    make_app({"model": str(tmp_path), "engine_num_gpus": 0, **args})


def test_adapters_need_lora_dir(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="lora_modules needs lora_dir"):
        build(tmp_path, lora_modules={"sql": "sql"})
    with pytest.raises(ValueError, match="allow_runtime_lora_updating needs lora_dir"):
        build(tmp_path, allow_runtime_lora_updating=True)
    with pytest.raises(ValueError, match="lora_dir is set but no adapter can be served"):
        build(tmp_path, lora_dir=str(tmp_path))


def test_a_declared_path_outside_lora_dir_or_without_an_adapter_is_refused(tmp_path: Path, lora_dir: Path,
                                                                          outside: Path) -> None:
    for path in ("../elsewhere", "escape", str(outside)):
        with pytest.raises(ValueError, match="lora_modules: 'x''s path .* does not resolve inside lora_dir"):
            build(tmp_path, lora_dir=str(lora_dir), lora_modules={"x": path})
    (lora_dir / "not-an-adapter").mkdir(exist_ok=True)
    with pytest.raises(ValueError, match="lora_modules: 'x''s path .* has no adapter_config.json"):
        build(tmp_path, lora_dir=str(lora_dir), lora_modules={"x": "not-an-adapter"})


def test_an_adapter_named_as_the_served_model_is_refused(tmp_path: Path, lora_dir: Path) -> None:
    with pytest.raises(ValueError, match="lora_modules: 'tiny' is the served model's name"):
        build(tmp_path, served_model_name="tiny", lora_dir=str(lora_dir), lora_modules={"tiny": "sql"})


def test_max_loras_defaults_to_a_few_slots_where_adapters_are_served_and_0_is_refused(lora_dir: Path) -> None:
    def max_loras(**args) -> int:
        return engine_config(AppArgs(lora_dir=str(lora_dir), **args), 0).max_loras

    assert max_loras(lora_modules={"sql": "sql"}) == DEFAULT_MAX_LORAS
    assert max_loras(allow_runtime_lora_updating=True, engine={"max_loras": 1}) == 1
    assert engine_config(AppArgs(), 0).max_loras == 0
    with pytest.raises(ValueError, match="engine.max_loras: 0 turns LoRA off, but lora_modules serve adapters"):
        max_loras(lora_modules={"sql": "sql"}, engine={"max_loras": 0})


def test_runtime_updating_with_two_ingress_replicas_fails_to_deploy_saying_why(tiny_gpt2_dir: Path,
                                                                                 lora_dir: Path) -> None:
    """Checked where the Ingress starts: a config file's `deployments:` list sets its replicas after the build."""
    two = {"Ingress": {"num_replicas": 2, "max_constructor_retry_count": 1}}  # one failed start is enough
    app = make_app(lora_args(tiny_gpt2_dir, lora_dir), deployment_options=two)
    shared_serve()
    with deleted_at_exit("lora-two-ingresses"):
        with pytest.raises(RuntimeError, match="Deploying application lora-two-ingresses failed"):
            serve.run(app, name="lora-two-ingresses", route_prefix="/two")
        ingress = serve.status().applications["lora-two-ingresses"].deployments["Ingress"]
        assert "allow_runtime_lora_updating needs exactly one Ingress replica" in ingress.message


def test_runtime_updating_needs_exactly_one_ingress_replica() -> None:
    check_one_ingress_replica(1, is_autoscaling=False)
    for num_replicas, is_autoscaling in ((2, False), (1, True), (None, True)):
        with pytest.raises(ValueError, match="allow_runtime_lora_updating needs exactly one Ingress replica"):
            check_one_ingress_replica(num_replicas, is_autoscaling)
