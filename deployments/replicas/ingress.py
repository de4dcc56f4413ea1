"""The Ingress deployment: the HTTP routes (deployments/api/routes.py) in a deployment of
their own, calling the tokenizer and engine deployments by handle (`ingress: deployment`,
the default and the shipped layout)."""

from ray import serve
from ray.serve.handle import DeploymentHandle

from deployments.api.http_body import DEFAULT_MAX_BODY_BYTES
from deployments.api.prompt_encoding import DEFAULT_LOCAL_MAX_CHARS
from deployments.api.routes import api, build_serving
from deployments.observability.logs import route_logs_to_serve
from deployments.api.engine_client import RemoteEngine

# The routes, and the routers of the handles they call, run on the replica's own event
# loop rather than on a loop in a thread each: two thread hops less for every chunk
# relayed from the engine to the proxy (BENCHMARKS.md, "Designs shipped": event loops and handles).
# The routes never block the loop (long prompts are tokenized in the tokenizer deployment,
# the model steps in the engine).
# A config file's ray_actor_options for Ingress replace this whole dict, so
# the configs repeat these variables.
ON_REPLICA_LOOP = {"RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0", "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "0"}
# Past max_ongoing_requests + max_queued_requests the proxy answers 429 + Retry-After itself
# (plain text). Serve counts requests still being assigned as queued: keep this well above a burst.
HTTP_LIMITS = dict(max_ongoing_requests=512, max_queued_requests=256,
                   backpressure_config={"status_code": 429, "retry_after_s": 1})

# The deployment comes last: @serve.ingress pickles the app (and the globals its routes
# use) when it decorates the class.


@serve.deployment(
    ray_actor_options={"num_cpus": 0.25, "runtime_env": {"env_vars": ON_REPLICA_LOOP}},
    graceful_shutdown_timeout_s=30,
    **HTTP_LIMITS,
)
@serve.ingress(api)
class Ingress:
    """The routes in a deployment of their own, calling the engine deployment by handle."""

    async def __init__(self, tokenizer: DeploymentHandle, engine: DeploymentHandle, model_name: str, model: str,
                       api_keys: list[str] | None = None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
                       local_encode_max_chars: int = DEFAULT_LOCAL_MAX_CHARS, tenant_by_user: bool = False) -> None:
        route_logs_to_serve("engine")
        self.serving = await build_serving(tokenizer, RemoteEngine(engine), model_name, model, api_keys,
                                           max_body_bytes, local_encode_max_chars, tenant_by_user)
