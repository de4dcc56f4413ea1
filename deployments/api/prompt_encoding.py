"""Where a request's prompts are encoded: in the ingress itself when they are short, else by
the tokenizer deployment.

Encoding a short prompt costs the ingress less than the hop to the tokenizer replica, which
also adds to a stream's time to first token. Long prompts still go to the tokenizer deployment, which scales out on its own, so that no request holds
the ingress's event loop for long: the bound counts all of a request's prompts together.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from ray.serve.handle import DeploymentHandle

from deployments.api.encoding import EncodeError, EncodeRequest, Encoded, Encoder
from deployments.api.errors import as_api_error, bad_request
from deployments.observability.metrics import TokenizerMetrics


DEFAULT_LOCAL_MAX_CHARS = 2048  # short enough that encoding it holds the ingress's loop less than a hop costs


@dataclass(frozen=True)
class PromptEncoding:
    tokenizer: DeploymentHandle
    local: Encoder
    # A request whose prompts hold at most this many characters (text, or the chat template's)
    # or token ids in all is encoded here; 0: every prompt by the tokenizer deployment.
    local_max_chars: int
    metrics: TokenizerMetrics  # local encodes, beside the deployment's batches

    def is_local(self, requests: list[EncodeRequest]) -> bool:
        return sum(map(_size, requests)) <= self.local_max_chars

    async def __call__(self, requests: list[EncodeRequest]) -> list[Encoded]:
        """Each prompt's checked ids; a prompt that can never run is a 400 naming its field."""
        if self.is_local(requests):
            results = self._encode_here(requests)
        else:  # concurrently: the deployment batches them
            results = await asyncio.gather(*(self._encode_there(r) for r in requests))
        for result in results:
            if isinstance(result, EncodeError):
                raise bad_request(result)
        return results

    def _encode_here(self, requests: list[EncodeRequest]) -> list[Encoded | EncodeError]:
        started = time.perf_counter()
        results = self.local.encode(requests)
        self.metrics.record_batch(len(requests), time.perf_counter() - started)
        return results

    async def _encode_there(self, request: EncodeRequest) -> Encoded | EncodeError:
        try:
            return await self.tokenizer.encode.remote(request)
        except Exception as exc:
            raise as_api_error(exc) from exc


def _size(request: EncodeRequest) -> int:
    text = request.text
    return len(text) if text is not None else len(request.prompt or ())
