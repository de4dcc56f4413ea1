"""The FastAPI app: its routes and error handlers, served by the Ingress deployment
(deployments/replicas/ingress.py, `ingress: deployment`, the default) or by the engine
replica itself (deployments/replicas/engine_server.py, `ingress: engine`).

Each route is a line handing the request to deployments/api/serving.py; the OpenAI completions
and chat routes share one body there.
"""

import asyncio
from typing import Annotated, Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from ray import serve
from ray.serve.handle import DeploymentHandle
from starlette.exceptions import HTTPException as StarletteHTTPException

from deployments.api.encoding import Encoder
from deployments.api.engine_client import EngineClient
from deployments.api.errors import ApiError, ErrorPolicy, as_api_error, invalid_body
from deployments.api.handles import over_grpc
from deployments.api.http_body import documented_body
from deployments.observability.metrics import RequestCounterMiddleware, TokenizerMetrics
from deployments.api.prompt_encoding import PromptEncoding
from deployments.api.protocol import ChatBody, CompletionBody, DetokenizeBody, GenerateBody, TokenizeBody
from deployments.api.responses import CHAT, COMPLETIONS
from deployments.api.security import ApiKeys
from deployments.api.serving import Serving
from engine.request.detokenizer import TokenVocab
from engine.request.invalid_request import InvalidRequestError
from engine.model.loader import load_tokenizer

api = FastAPI(title="rayinfer", description="OpenAI-compatible completions for GPT-2-family models")
api.add_middleware(ErrorPolicy)  # inside the counter, which then counts the status it gave
api.add_middleware(RequestCounterMiddleware)


# The failure policy, deployments/api/errors.py: the handlers below and ErrorPolicy apply it.
@api.exception_handler(ApiError)
async def api_error(request: Request, exc: ApiError) -> JSONResponse:
    return exc.response()


@api.exception_handler(InvalidRequestError)  # an engine rule, checked in this process (e.g. SamplingParams)
async def invalid_request(request: Request, exc: InvalidRequestError) -> JSONResponse:
    return await api_error(request, as_api_error(exc))


@api.exception_handler(RequestValidationError)
async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    return invalid_body(exc.errors(), skip=1).response()  # loc starts with "body" (or "query")


@api.exception_handler(StarletteHTTPException)
async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    """404, 405 and the like in OpenAI's shape too."""
    return ApiError(exc.status_code, str(exc.detail)).response()


# The routes are functions of the replica's Serving, not methods: the same app serves in
# the Ingress deployment and in the HTTP engine (deployments/replicas/engine_server.py). Serve gives
# each replica its own copy of the app, and the replica's object holds its Serving.
async def replica_serving() -> Serving:
    return serve.get_replica_context().servable_object.serving


ServingDep = Annotated[Serving, Depends(replica_serving)]


@api.post("/v1/completions", openapi_extra=documented_body(CompletionBody))
async def completions(request: Request, serving: ServingDep) -> Any:
    return await serving.openai(request, CompletionBody, COMPLETIONS)


@api.post("/v1/chat/completions", openapi_extra=documented_body(ChatBody))
async def chat_completions(request: Request, serving: ServingDep) -> Any:
    return await serving.openai(request, ChatBody, CHAT)


@api.post("/generate", openapi_extra=documented_body(GenerateBody))
async def generate(request: Request, serving: ServingDep) -> Any:
    return await serving.generate(request)


@api.post("/tokenize", openapi_extra=documented_body(TokenizeBody))
async def tokenize(request: Request, serving: ServingDep) -> dict:
    return await serving.tokenize(request)


@api.post("/detokenize", openapi_extra=documented_body(DetokenizeBody))
async def detokenize(request: Request, serving: ServingDep) -> dict:
    return await serving.detokenize(request)


@api.get("/tokenizer_info")
async def tokenizer_info(request: Request, serving: ServingDep) -> dict:
    return await serving.tokenizer_info(request)


@api.get("/version")
async def version(request: Request, serving: ServingDep) -> dict:
    return serving.version(request)


@api.get("/metrics")
async def metrics(request: Request, serving: ServingDep) -> PlainTextResponse:
    return await serving.metrics(request)


@api.get("/v1/models")
async def models(request: Request, serving: ServingDep) -> dict:
    return serving.models(request)


@api.get("/health")
async def health(serving: ServingDep) -> JSONResponse:
    return await serving.health()


async def build_serving(tokenizer: DeploymentHandle, engine: EngineClient, model_name: str, model: str,
                        api_keys: list[str] | None, max_body_bytes: int, local_encode_max_chars: int,
                        tenant_by_user: bool = False) -> Serving:
    """A replica's Serving: the tokenizer of `model` (the engine's checkpoint), loaded here for
    local encodes and detokenizing while the engine starts: its model_info waits for the engine."""
    tokenizer = over_grpc(tokenizer)
    hf_tokenizer, info = await asyncio.gather(asyncio.to_thread(load_tokenizer, model), engine.model_info())
    if info.name != model:
        raise ValueError(f"the engine serves {info.name!r}, not {model!r}: the routes would tokenize for another model")
    encoding = PromptEncoding(tokenizer, Encoder(hf_tokenizer), local_encode_max_chars, TokenizerMetrics("ingress"))
    keys = ApiKeys.from_config(api_keys, tenant_by_user)
    return Serving(tokenizer, encoding, engine, model_name, keys, max_body_bytes, info,
                   TokenVocab.from_tokenizer(hf_tokenizer))
