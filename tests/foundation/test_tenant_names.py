"""One rule for tenant names, wherever a tenant is defined: the keys file, the config, the operator's spec.

The attack: a tenant named ``acme:x`` (or with braces, spaces, ...) writes keys such as ``rollouts:acme:x:<digest>``,
which another tenant's key family could address. Refused with a message naming the tenant and the rule.
"""

from __future__ import annotations

import pytest

from onlinerl.auth import AuthConfigError, KeyRing, write_keys_file
from onlinerl.config import ConfigError, from_mapping
from onlinerl.keys import TENANT_RULE, Keys, tenant_problem
from onlinerl_operator.spec import SpecError, parse_spec

BAD = ["acme:x", "a}b", "{acme}", "ac me", "", "-acme", "x" * 64, "acme\n", "ä"]
GOOD = ["acme", "demo", "anonymous", "team-7", "Acme.Corp_2", "x" * 63]


@pytest.mark.parametrize("name", GOOD)
def test_good_names_pass_every_definer(name, tmp_path):
    assert tenant_problem(name) is None
    ring = KeyRing.from_file(write_keys_file(tmp_path / "k.yaml", {name: ["sk-1"]}))
    assert ring.tenant_for("sk-1") == name
    assert from_mapping({"feedback": {"silence": {"tenants": {name: True}}}}).feedback.silence.tracked(name)


@pytest.mark.parametrize("name", BAD)
def test_keys_file_refuses_a_bad_tenant_naming_it_and_the_rule(name, tmp_path):
    with pytest.raises(AuthConfigError) as err:
        KeyRing.from_file(write_keys_file(tmp_path / "k.yaml", {name: ["sk-1"]}))
    assert repr(name) in str(err.value) and TENANT_RULE in str(err.value)


@pytest.mark.parametrize("name", BAD)
def test_config_and_operator_refuse_a_bad_tenant(name):
    spec = {"feedback": {"silence": {"tenants": {name: True}}}}
    with pytest.raises(ConfigError) as err:
        from_mapping(spec)
    assert "feedback.silence.tenants" in str(err.value) and repr(name) in str(err.value)
    with pytest.raises(SpecError) as err:
        parse_spec("job", {**spec, "auth": {"allowAnonymous": True}})
    assert TENANT_RULE in str(err.value)


def test_a_numeric_yaml_key_is_told_to_quote_it():
    with pytest.raises(AuthConfigError, match="quote it"):
        KeyRing.from_mapping({"tenants": {123: {"keys": ["sk-1"]}}})


def test_why_the_colon_is_refused():
    """With a ``:`` in a name, two different (tenant, digest) pairs name the same Redis key."""
    keys = Keys("job")
    digest = "0" * 32
    assert keys.rollouts_by_digest("a:b", digest) == keys.rollouts_by_digest("a", f"b:{digest}")
    assert tenant_problem("a:b") is not None
