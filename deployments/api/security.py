"""Optional API keys for the ingress: `Authorization: Bearer <key>` on every API route.

Keys come from the app arg `api_keys` and from the environment variable RAYINFER_API_KEYS
(comma-separated), read in the ingress replica; with neither, the API is open. Prefer the
environment: app args are part of the Serve config, which the Ray dashboard displays.

Each check compares SHA-256 digests of the given key against every configured key with
hmac.compare_digest, with no early exit, so the time taken says nothing about which key,
or how much of one, matched. Keys never appear in logs or error messages.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Iterable

from deployments.api.errors import ApiError

API_KEYS_ENV = "RAYINFER_API_KEYS"


class ApiKeys:
    def __init__(self, keys: Iterable[str]) -> None:
        self._digests = [_digest(key) for key in keys if key]

    @classmethod
    def from_config(cls, keys: Iterable[str] | None) -> ApiKeys:
        from_env = os.environ.get(API_KEYS_ENV, "").split(",")
        return cls([*(keys or ()), *(key.strip() for key in from_env)])

    def check(self, authorization: str | None) -> None:
        """Raise a 401 ApiError unless keys are off or the header carries one of them."""
        if not self._digests:
            return
        scheme, _, token = (authorization or "").partition(" ")
        given = _digest(token.strip())
        matched = False
        for digest in self._digests:
            matched |= hmac.compare_digest(given, digest)
        if not (matched and scheme.lower() == "bearer"):
            raise ApiError(401, "missing or incorrect API key: send `Authorization: Bearer <key>`",
                           code="invalid_api_key")


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()
