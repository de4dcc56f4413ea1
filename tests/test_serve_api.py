# The HTTP API as a client meets it: a real Ray Serve instance on CPU (2 tokenizer replicas,
# one engine replica, the FastAPI routes in an Ingress deployment), real HTTP, the real GPT-2 tokenizer and the tiny
# checkpoint from conftest.py.
from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import psutil
import pytest
import ray
from ray import serve

from deployments import app as app_module
from deployments.api.engine_replicas import EngineReplicas
from deployments.api.handles import over_grpc
from deployments.api.encoding import Encoded, EncodeRequest
from engine import LLM, SamplingParams
from loadtest.client.workload import Workload
from loadtest.client.handle_target import HandleTarget, run_over_handle
from tests.engine_faults import faulty_app
from tests.http_helpers import (
    PROMPTS, assert_openai_error, check_engine_integrity, engine_health, greedy, sse_payloads, wait_until_idle,
)
from tests.serve_helpers import replica_process, replica_processes, running_app, tiny_app_args

pytestmark = pytest.mark.serve

APP = "rayinfer"
# 48 blocks x 16 tokens = 768 tokens: requests within the 1024-token context that the
# engine, not the tokenizer, must reject.
ENGINE_ARGS = {"num_kv_blocks": 48, "max_num_seqs": 32, "max_num_batched_tokens": 256}


@pytest.fixture(scope="module")
def base_url(tiny_gpt2_dir: Path) -> Iterator[str]:
    app = faulty_app(tiny_app_args(tiny_gpt2_dir, engine=ENGINE_ARGS, tokenizer_num_replicas=2))
    with running_app(app, APP) as instance:
        yield instance.url


def test_the_routes_run_in_the_ingress_deployment(base_url: str) -> None:
    deployments = serve.status().applications[APP].deployments
    assert set(deployments) == {"TokenizerDeployment", "EngineDeployment", "Ingress"}
    assert serve.get_app_handle(APP).deployment_name == "Ingress"
    assert httpx.get(f"{base_url}/health", timeout=30).json()["status"] == "ok"


def torch_libraries(process: psutil.Process) -> set[str]:
    return {Path(m.path).name for m in process.memory_maps() if "/torch/" in m.path}


def test_the_replicas_that_never_run_the_model_never_load_torch(base_url: str) -> None:
    # Each is a scale-out unit of its own: torch would double its memory and start-up.
    light = ["TokenizerDeployment", "Ingress"]
    processes = [p for deployment in light for p in replica_processes(deployment, APP)]
    assert len(processes) == len(light) + 1  # two tokenizer replicas
    assert "libtorch_cpu.so" in torch_libraries(replica_process("EngineDeployment", APP))
    assert {p.pid: torch_libraries(p) for p in processes} == {p.pid: set() for p in processes}


def test_sse_stream_sends_token_chunks_then_usage_then_done(http: httpx.Client) -> None:
    body = greedy(PROMPTS[0], max_tokens=8, ignore_eos=True, stream=True, stream_options={"include_usage": True})
    with http.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        payloads = sse_payloads(response)
    assert payloads[-1] == "[DONE]"
    chunks = [json.loads(p) for p in payloads[:-1]]
    *token_chunks, usage_chunk = chunks
    assert len(token_chunks) >= 2  # streamed, not one blob
    assert all(c["object"] == "text_completion" and c["usage"] is None for c in token_chunks)
    assert [c["choices"][0]["finish_reason"] for c in token_chunks][-1] == "length"
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"]["completion_tokens"] == 8
    assert usage_chunk["usage"]["total_tokens"] == usage_chunk["usage"]["prompt_tokens"] + 8


def test_openai_client_completion(oai: openai.OpenAI) -> None:
    completion = oai.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
    assert completion.choices[0].finish_reason == "length"
    assert completion.choices[0].text
    assert completion.usage.completion_tokens == 6


def test_openai_client_completion_stream(oai: openai.OpenAI) -> None:
    stream = oai.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=6, temperature=0, stream=True,
                                    extra_body={"ignore_eos": True})
    chunks = list(stream)
    non_stream = oai.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=6, temperature=0,
                                        extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].text for c in chunks) == non_stream.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_openai_client_chat(oai: openai.OpenAI) -> None:
    chat = oai.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi there"}],
                                       max_tokens=5, temperature=0, extra_body={"ignore_eos": True})
    assert chat.choices[0].message.role == "assistant"
    assert chat.choices[0].message.content
    assert chat.choices[0].finish_reason == "length"
    assert chat.usage.completion_tokens == 5


def test_openai_client_chat_stream_with_usage(oai: openai.OpenAI) -> None:
    stream = oai.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi there"}],
                                         max_tokens=5, temperature=0, stream=True,
                                         stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].usage.completion_tokens == 5
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    non_stream = oai.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi there"}],
                                             max_tokens=5, temperature=0, extra_body={"ignore_eos": True})
    assert text == non_stream.choices[0].message.content


def test_chat_template_is_role_lines_ending_with_assistant(http: httpx.Client) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    chat = http.post("/v1/chat/completions", json={"model": "tiny", "messages": messages, "max_tokens": 4,
                                                     "temperature": 0}).json()
    completion = http.post("/v1/completions", json=greedy("system: Be brief.\nuser: Hi there\nassistant:",
                                                            max_tokens=4)).json()
    assert chat["usage"]["prompt_tokens"] == completion["usage"]["prompt_tokens"]
    assert chat["choices"][0]["message"]["content"] == completion["choices"][0]["text"]


def test_greedy_text_matches_the_offline_llm_on_the_same_weights(http: httpx.Client, tiny_gpt2_dir: Path) -> None:
    llm = LLM(str(tiny_gpt2_dir), dtype="float32", **ENGINE_ARGS, compile_decode=False)
    expected = llm.generate(PROMPTS, SamplingParams(max_tokens=24, temperature=0))
    for prompt, offline in zip(PROMPTS, expected):
        served = http.post("/v1/completions", json=greedy(prompt, max_tokens=24)).json()
        assert served["choices"][0]["text"] == offline.text
        assert served["choices"][0]["finish_reason"] == offline.finish_reason
        assert served["usage"]["completion_tokens"] == len(offline.token_ids)


def test_token_id_prompts_generate_like_their_text(http: httpx.Client, gpt2_tokenizer) -> None:
    ids = gpt2_tokenizer.encode(PROMPTS[2])
    by_ids = http.post("/v1/completions", json=greedy(ids)).json()
    by_text = http.post("/v1/completions", json=greedy(PROMPTS[2])).json()
    assert by_ids["choices"][0]["text"] == by_text["choices"][0]["text"]


def test_sixteen_concurrent_streams_all_complete(base_url: str) -> None:
    async def one(http: httpx.AsyncClient, i: int) -> tuple[int, str]:
        body = greedy(f"Request number {i} says", max_tokens=16, ignore_eos=True, stream=True,
                      stream_options={"include_usage": True})
        async with http.stream("POST", "/v1/completions", json=body) as response:
            payloads = [line.removeprefix("data: ") async for line in response.aiter_lines() if line]
        return json.loads(payloads[-2])["usage"]["completion_tokens"], payloads[-1]

    async def main() -> list[tuple[int, str]]:
        async with httpx.AsyncClient(base_url=base_url, timeout=60) as http:
            return await asyncio.gather(*(one(http, i) for i in range(16)))

    assert asyncio.run(main()) == [(16, "[DONE]")] * 16


def test_the_tokenizer_deployment_serves_from_two_replicas(base_url: str, gpt2_tokenizer) -> None:
    status = serve.status().applications[APP].deployments["TokenizerDeployment"]
    assert status.replica_states == {"RUNNING": 2}
    # Enough concurrent calls that both replicas and their batches are exercised.
    handle = serve.get_deployment_handle("TokenizerDeployment", APP)
    responses = [handle.encode.remote(EncodeRequest(prompt=f"prompt {i}", max_tokens=4)) for i in range(64)]
    results = [r.result(timeout_s=30) for r in responses]
    assert results == [Encoded(gpt2_tokenizer.encode(f"prompt {i}"), 4) for i in range(64)]


def test_openapi_documents_every_post_body_with_nested_models_inlined(http: httpx.Client) -> None:
    paths = http.get("/openapi.json").json()["paths"]

    def body(path: str) -> dict:
        post = paths[path]["post"]
        assert post["requestBody"]["required"] is True
        return post["requestBody"]["content"]["application/json"]["schema"]

    assert {"prompt", "max_tokens", "temperature", "stream", "stop", "n"} <= set(body("/v1/completions")["properties"])
    messages = body("/v1/chat/completions")["properties"]["messages"]
    assert {"role", "content"} <= set(messages["items"]["properties"])  # inlined, not a dangling $ref
    assert {"prompt", "max_new_tokens"} <= set(body("/generate")["properties"])
    assert "$ref" not in json.dumps([body(p) for p in ("/v1/completions", "/v1/chat/completions", "/generate")])
    assert http.get("/docs").status_code == 200


def test_openapi_states_each_fields_limits_for_clients_and_fuzzers(http: httpx.Client) -> None:
    """What tests/test_fuzz.py generates bodies from: the ranges the engine holds, and the
    values a field we cannot honour takes."""
    fields = http.get("/openapi.json").json()["paths"]["/v1/completions"]["post"]["requestBody"]["content"][
        "application/json"]["schema"]["properties"]
    top_k = fields["top_k"]["anyOf"][0]
    assert (top_k["minimum"], top_k["maximum"]) == (-1, pytest.approx(2**63 - 1))  # FastAPI's document: floats
    assert list(fields["logit_bias"]["anyOf"][0]["patternProperties"]) == ["^(0|[1-9][0-9]{0,18})$"]
    assert fields["use_beam_search"]["anyOf"] == [{"type": "null"}, {"const": False}]
    assert "no beam search" in fields["use_beam_search"]["description"]


def test_the_ingress_handles_stream_engine_chunks_over_grpc(base_url: str, tiny_gpt2_dir: Path) -> None:
    engine = over_grpc(serve.get_deployment_handle("EngineDeployment", APP))
    prompt_ids = [464, 3139, 286, 4881, 318]
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    response = engine.options(stream=True).generate.remote("grpc-test", prompt_ids, params)
    chunks = list(response)
    assert response.by_reference is False  # inline over gRPC, not object references
    expected = LLM(str(tiny_gpt2_dir), dtype="float32", **ENGINE_ARGS, compile_decode=False).generate([prompt_ids], params)[0]
    assert [t for c in chunks for t in c.token_ids] == expected.token_ids
    assert chunks[-1].finish_reason == "length"


def test_a_handle_sees_the_engine_replica_set_through_serves_router(base_url: str) -> None:
    """What the Ingress's replica watch reads (deployments/api/engine_replicas.py), live."""
    handle = over_grpc(serve.get_deployment_handle("EngineDeployment", APP))
    replicas = EngineReplicas(handle)
    handle.model_info.remote().result(timeout_s=30)  # the handle's router is built by its first call
    replicas.check_serve_internals()
    assert replicas.num_replicas() == 1


def test_the_benchmark_drives_the_engine_deployment_over_a_serve_handle(http: httpx.Client) -> None:
    workload = Workload(num_requests=4, prompt_tokens=8, max_tokens=5, temperature=0.0, concurrency=2, warmup=1)
    result = run_over_handle(HandleTarget(APP), workload)
    assert (result.successes, result.failures) == (4, 0), result.errors
    assert result.total_output_tokens == 4 * 5
    assert result.url == f"serve handle {APP}/EngineDeployment"
    assert result.ttft_ms.p50 > 0 and result.tpot_ms.p50 > 0
    assert ray.is_initialized()  # this test's own driver connection is left alone
    health = wait_until_idle(http)
    assert health["num_active_requests"] == 0 and health["stats"]["num_kv_blocks_used"] == 0


def test_a_client_disconnect_mid_stream_aborts_the_request_in_the_engine(http: httpx.Client) -> None:
    before = wait_until_idle(http)["stats"]["num_generated_tokens"]
    body = greedy(PROMPTS[0], max_tokens=700, ignore_eos=True, stream=True)
    with http.stream("POST", "/v1/completions", json=body) as response:
        lines = response.iter_lines()
        assert next(lines).startswith("data: ")
        assert engine_health(http)["num_active_requests"] == 1
    # Closing the response closed the connection mid-stream.
    health = wait_until_idle(http)
    assert health["num_active_requests"] == 0
    assert health["stats"]["num_kv_blocks_used"] == 0
    assert health["stats"]["num_generated_tokens"] - before < 700  # aborted, not run to the end
    check_engine_integrity(APP)


def test_a_stop_string_ends_the_stream_with_stop_and_aborts_the_engine_request(http: httpx.Client) -> None:
    full = http.post("/v1/completions", json=greedy(PROMPTS[0], max_tokens=40, ignore_eos=True)).json()
    text = full["choices"][0]["text"]
    stop = text[len(text) // 3 : len(text) // 3 + 3]
    before = wait_until_idle(http)["stats"]["num_generated_tokens"]
    body = greedy(PROMPTS[0], max_tokens=700, ignore_eos=True, stop=[stop], stream=True)
    with http.stream("POST", "/v1/completions", json=body) as response:
        chunks = [json.loads(p) for p in sse_payloads(response)[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == text[: text.index(stop)]
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    health = wait_until_idle(http)
    assert health["num_active_requests"] == 0 and health["stats"]["num_kv_blocks_used"] == 0
    assert health["stats"]["num_generated_tokens"] - before < 700
    check_engine_integrity(APP)


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", greedy(""), "prompt"),
        ("/v1/completions", greedy([50257]), "prompt"),  # one past GPT-2's vocabulary
        ("/v1/completions", greedy([-1]), "prompt"),
        ("/v1/completions", greedy(PROMPTS[0], max_tokens=1020), "max_tokens"),  # prompt + max_tokens > 1024
        ("/v1/completions", greedy(PROMPTS[0], temperature="hot"), "temperature"),
        ("/v1/completions", {"model": "tiny"}, "prompt"),
        ("/v1/chat/completions", {"model": "tiny", "messages": []}, "messages"),
        ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "robot", "content": "hi"}]}, "messages"),
        ("/generate", {"prompt": "hi", "max_new_tokens": 0}, "max_new_tokens"),
    ],
)
def test_bad_input_is_a_400_openai_error_naming_the_param(http: httpx.Client, path: str, body: dict,
                                                          param: str) -> None:
    response = http.post(path, json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["type"], error["param"]) == ("invalid_request_error", param)
    assert error["message"]


def test_malformed_json_is_a_400_not_a_422(http: httpx.Client) -> None:
    response = http.post("/v1/completions", content=b'{"prompt": "hi",', headers={"content-type": "application/json"})
    assert response.status_code == 400
    assert response.json()["error"]["type"] == "invalid_request_error"


def test_a_request_the_engine_rejects_before_any_token_is_a_400(http: httpx.Client) -> None:
    # Fits the 1024-token context but not the 48-block (768-token) KV cache.
    response = http.post("/v1/completions", json=greedy(PROMPTS[0], max_tokens=900, stream=True))
    assert response.status_code == 400, response.text
    message = response.json()["error"]["message"]
    assert "KV blocks" in message and "\n" not in message  # the engine's reason, not a traceback


def test_generate_streams_plain_text(http: httpx.Client) -> None:
    body = {"prompt": PROMPTS[1], "max_new_tokens": 10, "stream": True, "temperature": 0, "stop_on_eos": False}
    with http.stream("POST", "/generate", content=json.dumps(body)) as response:  # no content type, like curl -d
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/plain")
        pieces = list(response.iter_text())
    expected = http.post("/v1/completions", json=greedy(PROMPTS[1], max_tokens=10, ignore_eos=True)).json()
    assert "".join(pieces) == expected["choices"][0]["text"]
    assert "ttft;dur=" in response.headers["server-timing"]


def test_the_final_chunk_carries_the_server_timing_breakdown(http: httpx.Client) -> None:
    with http.stream("POST", "/v1/completions", json=greedy(PROMPTS[0], max_tokens=4, stream=True)) as response:
        chunks = [json.loads(p) for p in sse_payloads(response)[:-1]]
    assert all("server_timing" not in c for c in chunks[:-1])
    timing = chunks[-1]["server_timing"]
    assert set(timing) == {"tokenize_ms", "queue_wait_ms", "prefill_ms", "ttft_ms"}
    assert all(isinstance(v, float) and v >= 0 for v in timing.values())
    # The engine's share and the tokenizer's lie within the ingress-measured TTFT.
    assert timing["ttft_ms"] >= timing["tokenize_ms"]
    assert timing["ttft_ms"] >= timing["queue_wait_ms"] + timing["prefill_ms"]
    body = http.post("/v1/completions", json=greedy(PROMPTS[0], max_tokens=4)).json()
    assert set(body["server_timing"]) == set(timing)


def test_n_choices_run_as_separate_engine_requests(http: httpx.Client) -> None:
    before = wait_until_idle(http)["stats"]
    body = http.post("/v1/completions", json={"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 8, "n": 2,
                                                 "seed": 1, "ignore_eos": True}).json()
    assert [c["index"] for c in body["choices"]] == [0, 1]
    assert body["usage"]["completion_tokens"] == 16
    after = wait_until_idle(http)["stats"]
    # The engine counts a request's prompt once, at its first token: two requests, twice.
    assert after["num_prompt_tokens"] - before["num_prompt_tokens"] == 2 * body["usage"]["prompt_tokens"]
    assert after["num_generated_tokens"] - before["num_generated_tokens"] == 16


def test_models_and_health_report_the_engine(http: httpx.Client, tiny_gpt2_dir: Path) -> None:
    card = http.get("/v1/models").json()["data"][0]
    assert (card["id"], card["root"], card["weights"]) == ("tiny", str(tiny_gpt2_dir), "pretrained")
    assert card["max_model_len"] == 1024
    health = engine_health(http)
    assert health["status"] == "ok"
    assert health["stats"]["num_kv_blocks_total"] == ENGINE_ARGS["num_kv_blocks"]


def test_by_default_no_adapter_is_listed_and_the_lora_routes_do_not_exist(http: httpx.Client) -> None:
    """allow_runtime_lora_updating is off by default: the routes are 404s, as vLLM's (tests/test_lora_serve.py)."""
    assert [(card["id"], card["parent"]) for card in http.get("/v1/models").json()["data"]] == [("tiny", None)]
    for route, body in (("load", {"lora_name": "a", "lora_path": "a"}), ("unload", {"lora_name": "a"})):
        assert_openai_error(http.post(f"/v1/{route}_lora_adapter", json=body), 404, "invalid_request_error")


@pytest.mark.parametrize(("cluster_gpus", "num_gpus", "device"), [(0, 0, "cpu"), (1, 1, "auto"), (8, 1, "auto")])
def test_the_engine_takes_one_gpu_only_where_the_cluster_has_one(monkeypatch: pytest.MonkeyPatch, cluster_gpus: int,
                                                                 num_gpus: int, device: str) -> None:
    monkeypatch.setattr(app_module, "cluster_num_gpus", lambda: cluster_gpus)
    args = app_module.AppArgs.model_validate({"model": "gpt2"})
    assert app_module.engine_num_gpus(args) == num_gpus
    assert app_module.engine_config(args, num_gpus).device == device  # no GPU reserved: never touch one
