"""Optional API keys for the ingress: `Authorization: Bearer <key>` on every API route, and
the tenant each key stands for.

Keys come from the app arg `api_keys` and from the environment variable RAYINFER_API_KEYS
(comma-separated), read in the ingress replica; with neither, the API is open. Prefer the
environment: app args are part of the Serve config, which the Ray dashboard displays.

An entry is a key, optionally followed by the tenant's name and weight, separated by
spaces (a bearer token holds none): `sk-1 name=team-a weight=2`. A tenant is labelled by
its name, or else by a short hash of its key (`key-1a2b3c4d`); the label is what the
scheduler and the metrics see. Without keys every request is one tenant, or, where the
operator opts in (`tenant_by_user`), the request's `user` field names it.

Each check compares SHA-256 digests of the given key against every configured key with
hmac.compare_digest, with no early exit, so the time taken says nothing about which key,
or how much of one, matched. Keys never appear in logs, error messages or labels.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Iterable
from dataclasses import dataclass

from deployments.api.errors import ApiError
from engine.request.scheduling import DEFAULT_TENANT

API_KEYS_ENV = "RAYINFER_API_KEYS"
_LABEL_HASH_CHARS = 8


@dataclass(frozen=True)
class Tenant:
    label: str  # a name, or a short hash: never the key
    weight: float = 1.0


DEFAULT = Tenant(DEFAULT_TENANT)


@dataclass(frozen=True)
class _Key:
    digest: bytes
    tenant: Tenant


class ApiKeys:
    def __init__(self, entries: Iterable[str], tenant_by_user: bool = False) -> None:
        self._keys = [_parse(entry) for entry in entries if entry.strip()]
        self.tenant_by_user = tenant_by_user

    @classmethod
    def from_config(cls, keys: Iterable[str] | None, tenant_by_user: bool = False) -> ApiKeys:
        from_env = os.environ.get(API_KEYS_ENV, "").split(",")
        return cls([*(keys or ()), *from_env], tenant_by_user)

    def check(self, authorization: str | None) -> Tenant:
        """The key's tenant; a 401 ApiError unless keys are off or the header carries one."""
        if not self._keys:
            return DEFAULT
        scheme, _, token = (authorization or "").partition(" ")
        given = _digest(token.strip())
        matched: Tenant | None = None
        for key in self._keys:
            if hmac.compare_digest(given, key.digest):
                matched = key.tenant
        if matched is None or scheme.lower() != "bearer":
            raise ApiError(401, "missing or incorrect API key: send `Authorization: Bearer <key>`",
                           code="invalid_api_key")
        return matched

    def tenant(self, key_tenant: Tenant, user: str | None) -> Tenant:
        """The request's tenant: its key's where keys are set, else its `user` where the
        operator opted in, else the one tenant."""
        if self._keys or not self.tenant_by_user or not user:
            return key_tenant
        return Tenant(f"user-{_short_hash(user)}")


def _parse(entry: str) -> _Key:
    key, *fields = entry.split()
    options = dict(field.partition("=")[::2] for field in fields)
    unknown = set(options) - {"name", "weight"}
    if unknown:  # names the fields, never the key
        raise ValueError(f"api_keys: an entry has unknown fields {sorted(unknown)}; want `KEY name=N weight=W`")
    weight = float(options.get("weight", 1.0))
    if not weight > 0:
        raise ValueError(f"api_keys: weight must be > 0, got {weight}")
    return _Key(_digest(key), Tenant(options.get("name") or f"key-{_short_hash(key)}", weight))


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def _short_hash(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:_LABEL_HASH_CHARS]
