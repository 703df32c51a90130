"""Key roles in the keys file: the old format stays a user key; eval/admin may pin; malformed entries name the field."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from onlinerl.auth import ANONYMOUS_TENANT, AuthConfigError, KeyRing, key_with_role, write_keys_file
from onlinerl.loop.stack import SIMULATED_USERS, StackPaths, demo_user_keys, ensure_demo_key


def ring(tenants: dict) -> KeyRing:
    return KeyRing.from_mapping({"tenants": tenants})


def test_plain_keys_are_users_and_roles_are_read() -> None:
    r = ring({"acme": {"keys": ["sk-u", {"key": "sk-e", "role": "eval"}, {"key": "sk-a", "role": "admin"}]}})
    u, e, a = (r.identity_for(k) for k in ("sk-u", "sk-e", "sk-a"))
    assert (u.tenant, u.role, u.may_pin) == ("acme", "user", False)
    assert (e.role, e.may_pin) == ("eval", True) and (a.role, a.may_pin) == ("admin", True)
    assert {u.key_id, e.key_id, a.key_id} == {u.key_id, e.key_id, a.key_id} and len({u.key_id, e.key_id}) == 2
    assert "sk-u" not in u.key_id and r.tenant_for("sk-e") == "acme"


def test_unknown_forged_and_missing_keys() -> None:
    r = ring({"acme": {"keys": ["sk-u"]}})
    assert r.identity_for("sk-U") is None and r.identity_for("") is None and r.identity_for(None) is None
    anon = KeyRing.from_mapping({"tenants": {"acme": {"keys": ["sk-u"]}}}, allow_anonymous=True)
    who = anon.identity_for("nope")
    assert (who.tenant, who.role, who.may_pin) == (ANONYMOUS_TENANT, "user", False)  # anonymous never pins


@pytest.mark.parametrize(
    ("keys", "names"),
    [
        ([{"key": "sk", "role": "root"}], "tenants.acme.keys[0].role"),
        ([{"key": "", "role": "eval"}], "tenants.acme.keys[0]"),
        ([{"key": "sk", "role": "eval", "scope": "all"}], "unknown field(s) ['scope']"),
        (["sk-1", 7], "tenants.acme.keys[1]"),
        ([], "tenants.acme.keys must be a non-empty list"),
        (["sk-1", {"key": "sk-1", "role": "admin"}], "listed twice"),
    ],
)
def test_malformed_entries_name_the_field(keys: list, names: str) -> None:
    with pytest.raises(AuthConfigError) as exc:
        ring({"acme": {"keys": keys}})
    assert names in str(exc.value)


def test_the_same_key_in_two_tenants_is_refused() -> None:
    with pytest.raises(AuthConfigError, match="listed twice"):
        ring({"acme": {"keys": ["sk-x"]}, "beta": {"keys": ["sk-x"]}})


def test_key_with_role_finds_an_eval_key_or_says_how_to_add_one(tmp_path: Path) -> None:
    f = write_keys_file(tmp_path / "k.yaml", {"a": ["sk-u"], "b": ["sk-v", {"key": "sk-e", "role": "eval"}]})
    assert key_with_role(f) == ("sk-e", "b")
    g = write_keys_file(tmp_path / "g.yaml", {"a": ["sk-u"]})
    with pytest.raises(AuthConfigError, match="role: eval"):
        key_with_role(g)


def test_demo_keys_hold_one_user_and_one_eval_key_and_upgrade_an_old_file(tmp_path: Path) -> None:
    paths = StackPaths(tmp_path)
    write_keys_file(paths.keys, {"demo": ["orl-old-user-key"]})  # written before roles existed
    assert ensure_demo_key(paths) == "orl-old-user-key"
    eval_key = ensure_demo_key(paths, "eval")
    assert eval_key != "orl-old-user-key" and ensure_demo_key(paths, "eval") == eval_key  # created once
    r = KeyRing.from_file(paths.keys)
    assert r.identity_for("orl-old-user-key").role == "user" and r.identity_for(eval_key).role == "eval"
    keys = yaml.safe_load(paths.keys.read_text())["tenants"]["demo"]["keys"]
    assert len(keys) == 2 + SIMULATED_USERS  # Continue's key, the eval key, one per simulated user
    users = demo_user_keys(paths)
    assert users[0] == "orl-old-user-key" and len(users) == 1 + SIMULATED_USERS and len(set(users)) == len(users)
    assert eval_key not in users
    assert oct(paths.keys.stat().st_mode & 0o777) == "0o600"
