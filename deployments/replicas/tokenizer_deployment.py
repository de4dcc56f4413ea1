"""Tokenizer deployment: prompts and chat messages in, validated token ids out.

Concurrent calls are batched (`@serve.batch`): one batched encode serves every request
that queued up while the previous batch ran (batch_wait_timeout_s 0: no added latency at
light load, big batches under heavy load). Each request gets its own result, `Encoded` or
`EncodeError` (deployments/api/encoding.py), so one bad prompt never fails its batch-mates.
The ingress encodes short prompts itself and sends this deployment the long ones.
"""

from __future__ import annotations

import time
from typing import Any

from ray import serve

from deployments.api.encoding import EncodeError, EncodeRequest, Encoded, Encoder
from deployments.observability.logs import route_logs_to_serve
from deployments.observability.metrics import TokenizerMetrics
from engine.model.loader import load_tokenizer


_PATHS = {"vocab_file", "merges_file", "tokenizer_file", "name_or_path"}


def _jsonable(value: Any) -> Any:
    if hasattr(value, "content"):  # an AddedToken
        return value.content
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value if isinstance(value, (str, int, float, bool, type(None))) else str(value)


@serve.deployment(
    ray_actor_options={"num_cpus": 0.1},
    max_ongoing_requests=128,
    max_queued_requests=512,  # past it the ingress's handle raises BackPressureError: a 429
    autoscaling_config={"min_replicas": 1, "initial_replicas": 1, "max_replicas": 2, "target_ongoing_requests": 32},
    logging_config={"enable_access_log": False},
)
class TokenizerDeployment:
    def __init__(self, model: str, max_batch_size: int = 32, batch_wait_timeout_s: float = 0.0) -> None:
        route_logs_to_serve("engine")
        self._tokenizer = load_tokenizer(model)
        self._encoder = Encoder(self._tokenizer)
        self._metrics = TokenizerMetrics("deployment")
        self.encode.set_max_batch_size(max_batch_size)
        self.encode.set_batch_wait_timeout_s(batch_wait_timeout_s)

    @serve.batch(max_batch_size=32, batch_wait_timeout_s=0.0)
    async def encode(self, requests: list[EncodeRequest]) -> list[Encoded | EncodeError]:
        started = time.perf_counter()
        results = self._encoder.encode(requests)
        self._metrics.record_batch(len(requests), time.perf_counter() - started)
        return results

    def tokenize(self, text: str, return_token_strs: bool = False) -> tuple[list[int], list[str] | None]:
        """POST /tokenize: the ids (as encode makes them, no special tokens added) and, on
        request, their token strings."""
        ids = self._tokenizer(text, add_special_tokens=False)["input_ids"]
        return ids, self._tokenizer.convert_ids_to_tokens(ids) if return_token_strs else None

    def detokenize(self, token_ids: list[int]) -> str:
        """POST /detokenize: ids the ingress has checked against the vocabulary."""
        return self._tokenizer.decode(token_ids)

    def info(self) -> dict:
        """GET /tokenizer_info, as vLLM: the tokenizer's init arguments, no file paths."""
        config = {k: _jsonable(v) for k, v in self._tokenizer.init_kwargs.items() if k not in _PATHS}
        config.update(tokenizer_class=type(self._tokenizer).__name__, eos_token=self._tokenizer.eos_token,
                      bos_token=self._tokenizer.bos_token)
        return config
