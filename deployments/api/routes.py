"""The FastAPI app and its error handlers; its routes are the Ingress deployment's methods
(deployments/replicas/ingress.py), a line each handing the request to deployments/api/serving.py.
"""

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from deployments.api.errors import ApiError, ErrorPolicy, as_api_error, invalid_body
from deployments.observability.metrics import RequestCounterMiddleware
from engine.request.invalid_request import InvalidRequestError

api = FastAPI(title="rayinfer", description="OpenAI-compatible completions for GPT-2-family models")
api.add_middleware(ErrorPolicy)  # inside the counter, which then counts the status it gave
api.add_middleware(RequestCounterMiddleware)


@api.exception_handler(ApiError)
async def api_error(request: Request, exc: ApiError) -> JSONResponse:
    return exc.response()


@api.exception_handler(InvalidRequestError)  # an engine rule, checked in this process (e.g. SamplingParams)
async def invalid_request(request: Request, exc: InvalidRequestError) -> JSONResponse:
    return await api_error(request, as_api_error(exc))


@api.exception_handler(RequestValidationError)
async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    error = invalid_body(exc.errors(), skip=1)  # loc starts with "body" (or "query")
    return JSONResponse(error.body, status_code=error.status)


@api.exception_handler(StarletteHTTPException)
async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    """404, 405 and the like in OpenAI's shape too."""
    return ApiError(exc.status_code, str(exc.detail)).response()
