"""The Ingress deployment: the HTTP routes, calling the tokenizer and engine deployments by
handle. Each route is a line handing the request to deployments/api/serving.py; the OpenAI
completions and chat routes share one body there.
"""

import asyncio
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, PlainTextResponse
from ray import serve
from ray.serve.handle import DeploymentHandle

from deployments.api.encoding import Encoder
from deployments.api.engine_client import EngineClient
from deployments.api.handles import over_grpc
from deployments.api.http_body import DEFAULT_MAX_BODY_BYTES, documented_body
from deployments.api.lora_catalog import LoraCatalog, check_one_ingress_replica
from deployments.api.prompt_encoding import DEFAULT_LOCAL_MAX_CHARS, PromptEncoding
from deployments.api.protocol import (ChatBody, CompletionBody, DetokenizeBody, GenerateBody, LoadLoraBody,
                                      TokenizeBody, UnloadLoraBody)
from deployments.api.responses import CHAT, COMPLETIONS
from deployments.api.routes import api
from deployments.api.security import ApiKeys
from deployments.api.serving import Serving
from deployments.observability.logs import route_logs_to_serve
from deployments.observability.metrics import TokenizerMetrics
from engine.model.loader import load_tokenizer
from engine.request.detokenizer import TokenVocab

# The routes, and the routers of the handles they call, run on the replica's own event
# loop rather than on a loop in a thread each: two thread hops less for every chunk
# relayed from the engine to the proxy.
# The routes never block the loop (long prompts are tokenized in the tokenizer deployment,
# the model steps in the engine).
# A config file's ray_actor_options for Ingress replace this whole dict, so
# the configs repeat these variables.
ON_REPLICA_LOOP = {"RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0", "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "0"}


async def build_serving(tokenizer: DeploymentHandle, engine: EngineClient, model_name: str, model: str,
                        api_keys: list[str] | None, max_body_bytes: int, local_encode_max_chars: int,
                        tenant_by_user: bool = False, loras: LoraCatalog | None = None) -> Serving:
    """A replica's Serving: the tokenizer of `model` (the engine's checkpoint), loaded here for
    local encodes and detokenizing while the engine starts: its model_info waits for the engine."""
    tokenizer = over_grpc(tokenizer)
    hf_tokenizer, info = await asyncio.gather(asyncio.to_thread(load_tokenizer, model), engine.model_info())
    if info.name != model:
        raise ValueError(f"the engine serves {info.name!r}, not {model!r}: the routes would tokenize for another model")
    encoding = PromptEncoding(tokenizer, Encoder(hf_tokenizer), local_encode_max_chars, TokenizerMetrics("ingress"))
    keys = ApiKeys.from_config(api_keys, tenant_by_user)
    return Serving(tokenizer, encoding, engine, model_name, keys, max_body_bytes, info,
                   TokenVocab.from_tokenizer(hf_tokenizer), loras or LoraCatalog(model_name))


def check_replicas_for(loras: LoraCatalog | None) -> None:
    """Read here, not at build: a config file's `deployments:` list sets the Ingress's replicas
    after build_app has run."""
    if loras is None or not loras.allow_runtime_updating:
        return
    # Serve's own config of this deployment; a Ray without it fails here, loudly.
    config = serve.get_replica_context()._deployment_config
    check_one_ingress_replica(config.num_replicas, config.autoscaling_config is not None)


# The deployment comes last: @serve.ingress pickles the app (and the globals its routes
# use) when it decorates the class.


@serve.deployment(
    ray_actor_options={"num_cpus": 0.25, "runtime_env": {"env_vars": ON_REPLICA_LOOP}},
    graceful_shutdown_timeout_s=30,
    # Past max_ongoing_requests + max_queued_requests the proxy answers 429 + Retry-After
    # itself (plain text). Serve counts requests still being assigned as queued: keep this
    # well above a burst.
    max_ongoing_requests=512, max_queued_requests=256,
    backpressure_config={"status_code": 429, "retry_after_s": 1},
)
@serve.ingress(api)
class Ingress:
    async def __init__(self, tokenizer: DeploymentHandle, engine: DeploymentHandle, model_name: str, model: str,
                       api_keys: list[str] | None = None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
                       local_encode_max_chars: int = DEFAULT_LOCAL_MAX_CHARS, tenant_by_user: bool = False,
                       loras: LoraCatalog | None = None) -> None:
        route_logs_to_serve("engine")
        check_replicas_for(loras)
        self.serving = await build_serving(tokenizer, EngineClient(engine), model_name, model, api_keys,
                                           max_body_bytes, local_encode_max_chars, tenant_by_user, loras)

    @api.post("/v1/completions", openapi_extra=documented_body(CompletionBody))
    async def completions(self, request: Request) -> Any:
        return await self.serving.openai(request, CompletionBody, COMPLETIONS)

    @api.post("/v1/chat/completions", openapi_extra=documented_body(ChatBody))
    async def chat_completions(self, request: Request) -> Any:
        return await self.serving.openai(request, ChatBody, CHAT)

    @api.post("/generate", openapi_extra=documented_body(GenerateBody))
    async def generate(self, request: Request) -> Any:
        return await self.serving.generate(request)

    @api.post("/tokenize", openapi_extra=documented_body(TokenizeBody))
    async def tokenize(self, request: Request) -> dict:
        return await self.serving.tokenize(request)

    @api.post("/detokenize", openapi_extra=documented_body(DetokenizeBody))
    async def detokenize(self, request: Request) -> dict:
        return await self.serving.detokenize(request)

    @api.get("/tokenizer_info")
    async def tokenizer_info(self, request: Request) -> dict:
        return await self.serving.tokenizer_info(request)

    @api.get("/version")
    async def version(self, request: Request) -> dict:
        return self.serving.version(request)

    @api.get("/metrics")
    async def metrics(self, request: Request) -> PlainTextResponse:
        return await self.serving.metrics(request)

    @api.get("/v1/models")
    async def models(self, request: Request) -> dict:
        return self.serving.models(request)

    @api.post("/v1/load_lora_adapter", openapi_extra=documented_body(LoadLoraBody))
    async def load_lora_adapter(self, request: Request) -> PlainTextResponse:
        return await self.serving.load_lora(request)

    @api.post("/v1/unload_lora_adapter", openapi_extra=documented_body(UnloadLoraBody))
    async def unload_lora_adapter(self, request: Request) -> PlainTextResponse:
        return await self.serving.unload_lora(request)

    @api.get("/health")
    async def health(self) -> JSONResponse:
        return await self.serving.health()
