"""API keys as the operator configures them: plain keys as before, or keys naming their
tenant and weight; the tenant a request is served as, and its label, never the key."""

from __future__ import annotations

import pytest

from deployments.api.errors import ApiError
from deployments.api.security import API_KEYS_ENV, ApiKeys, Tenant


def bearer(key: str) -> str:
    return f"Bearer {key}"


def test_a_plain_key_is_a_tenant_labelled_by_a_short_hash_never_the_key():
    keys = ApiKeys(["sk-plain-secret"])
    tenant = keys.check(bearer("sk-plain-secret"))
    assert tenant.label.startswith("key-") and len(tenant.label) == 12 and "secret" not in tenant.label
    assert tenant.weight == 1.0
    with pytest.raises(ApiError) as refused:
        keys.check(bearer("sk-other"))
    assert refused.value.status == 401


def test_a_key_may_name_its_tenant_and_weight():
    keys = ApiKeys(["sk-a name=team-a weight=2", "sk-b name=team-b"])
    assert keys.check(bearer("sk-a")) == Tenant("team-a", 2.0)
    assert keys.check(bearer("sk-b")) == Tenant("team-b", 1.0)
    with pytest.raises(ApiError):
        keys.check(bearer("sk-a name=team-a weight=2"))  # the key is the first word alone


def test_the_environment_takes_the_same_entries(monkeypatch):
    monkeypatch.setenv(API_KEYS_ENV, "sk-env name=env-team weight=0.5, sk-two")
    keys = ApiKeys.from_config(None)
    assert keys.check(bearer("sk-env")) == Tenant("env-team", 0.5)
    assert keys.check(bearer("sk-two")).label.startswith("key-")


@pytest.mark.parametrize("entry", ["sk-a weight=0", "sk-a weight=-1", "sk-a colour=blue"])
def test_a_bad_entry_fails_at_start_without_quoting_the_key(entry):
    with pytest.raises(ValueError) as bad:
        ApiKeys([entry])
    assert "sk-a" not in str(bad.value)


def test_without_keys_one_tenant_unless_the_user_field_is_opted_in():
    assert ApiKeys([]).tenant(ApiKeys([]).check(None), "alice").label == "default"
    by_user = ApiKeys([], tenant_by_user=True)
    alice = by_user.tenant(by_user.check(None), "alice")
    assert alice.label.startswith("user-") and "alice" not in alice.label
    assert by_user.tenant(by_user.check(None), None).label == "default"
    with_keys = ApiKeys(["sk-a name=a"], tenant_by_user=True)
    assert with_keys.tenant(with_keys.check(bearer("sk-a")), "alice").label == "a"  # the key decides
