"""Serving per policy line (issue 39) without an engine: which line and adapter a key is routed to, what the reloader
accepts on a project's line, and the vLLM flags that let one engine hold many adapters.

Routing is the gateway's own ``Gateway.pick`` over its cached state (as its background refresh builds it from a model
list and policy tables); the header rules go through the gateway's ASGI entry; the checkpoint rules are the
reloader's own ``confine``/``validate`` on real folders. Through real vLLM, the reloader and the gateway processes:
tests/projects/test_project_serving.py.
"""

from __future__ import annotations

import asyncio
import hashlib
from pathlib import Path

import httpx
import pytest
import redis.asyncio as aioredis

from onlinerl.auth import KeyRing
from onlinerl.config import from_mapping
from onlinerl.dataplane import audit
from onlinerl.dataplane.lines import register
from onlinerl.keys import Keys
from onlinerl.lines import checkpoint_root
from onlinerl.schemas import CheckpointManifest, PolicyTable
from onlinerl.valkey import free_port
from onlinerl_serving.checkpoints import Announcement, CheckpointError, confine, validate
from onlinerl_serving.engine import vllm_argv
from onlinerl_serving.gateway import Gateway
from onlinerl_serving.reloader import Reloader, ReloaderOptions
from onlinerl_serving.routing import user_hash
from onlinerl_serving.state import parse_models, routable
from onlinerl_serving.upstream import EnginePool

JOB = "j"
BASE = "onlinerl-base"
KEYS = {"acme": ["sk-acme-0123456789", {"key": "sk-acme-eval-0123456789", "role": "eval"}], "beta": ["sk-beta-0123"]}


def _cfg(adapters: str = "listed", listed: tuple[str, ...] = ("acme", "beta")) -> object:
    return from_mapping({"job": JOB, "projects": {"adapters": adapters, "listed": list(listed)}})


# --- the model list and the routable lines ----------------------------------------------------------------------
def test_the_model_list_parses_into_the_shared_line_and_each_project_line() -> None:
    ids = [BASE, "j-v1", "j-v3", "j@acme-v2", "j@acme-v5", "j@beta-v1", "other-v1", "other@acme-v9", "j@bad:x-v1"]
    shared, lines = parse_models(JOB, BASE, ids)
    assert shared == {0, 1, 3}
    assert lines == {"acme": {2, 5}, "beta": {1}}  # another job's adapters and names that are no tenant: ignored


def test_a_line_is_routable_only_with_a_stable_above_0_loaded_at_or_below_it() -> None:
    projects = _cfg().projects
    loaded = {"acme": frozenset({1, 2}), "beta": frozenset({3}), "gamma": frozenset({1})}
    tables = {
        "acme": PolicyTable(stable=2, candidate=3, canary_share=0.5),
        "beta": PolicyTable(stable=2),  # v2 promoted but still loading here, only v3 loaded: not at or below stable
        "gamma": PolicyTable(stable=1),  # not listed: no line of its own whatever is loaded
    }
    lines = routable(projects, tables, loaded)
    assert set(lines) == {"acme"} and lines["acme"].loaded == {0, 1, 2}
    tables["beta"] = PolicyTable(stable=4)  # v4 loading: beta keeps v3 instead of flapping to the shared policy
    assert set(routable(projects, tables, loaded)) == {"acme", "beta"}
    tables["acme"] = PolicyTable(stable=0, hold=0)  # rolled back to 0: the shared policy again
    assert set(routable(projects, tables, loaded)) == {"beta"}
    tables["acme"] = PolicyTable(stable=0, candidate=3, canary_share=0.5)  # a first canary of a version not here
    assert set(routable(projects, tables, loaded)) == {"beta"}
    tables["acme"] = PolicyTable(stable=0, candidate=2, canary_share=0.5)  # ...of one loaded here: routed
    assert set(routable(projects, tables, loaded)) == {"acme", "beta"}
    assert routable(_cfg("off").projects, tables, loaded) == {}


# --- the gateway's routing ---------------------------------------------------------------------------------------
@pytest.fixture
def gateway(empty_valkey) -> Gateway:
    cfg = _cfg()
    gw = Gateway(
        cfg,
        KeyRing.from_mapping({"tenants": {t: {"keys": k} for t, k in KEYS.items()}}),
        aioredis.from_url(empty_valkey.url),
        EnginePool.from_url("http://127.0.0.1:9", connect_timeout=1.0, read_timeout=1.0),
    )
    st = gw.state
    st.policy = PolicyTable(stable=1)
    st.loaded, st.line_loaded = parse_models(JOB, BASE, [BASE, "j-v1", "j@acme-v1", "j@acme-v2", "j@beta-v1"])
    st.line_tables = {"acme": PolicyTable(stable=1, candidate=2, canary_share=0.5), "beta": PolicyTable(stable=1)}
    st.lines = routable(cfg.projects, st.line_tables, st.line_loaded)
    return gw


def test_each_key_is_routed_on_its_own_projects_line_and_never_on_another(gateway: Gateway) -> None:
    seen: dict[str, set[str]] = {"acme": set(), "beta": set(), "gamma": set()}
    for i in range(200):
        uhash = user_hash(f"sk-user-{i}")
        for tenant in seen:
            r, model, line, table = gateway.pick(uhash, tenant=tenant)
            assert line == ("" if tenant == "gamma" else tenant)
            seen[tenant].add(model)
            if tenant == "acme":  # the line's own canary: the candidate arm serves acme's v2, its table is acme's
                assert (r.arm, model) in (("stable", "j@acme-v1"), ("candidate", "j@acme-v2")) and table.candidate == 2
    assert seen == {"acme": {"j@acme-v1", "j@acme-v2"}, "beta": {"j@beta-v1"}, "gamma": {"j-v1"}}


def test_a_lines_first_canary_serves_its_stable_arm_the_shared_stable_counted_on_the_line(gateway: Gateway) -> None:
    """acme promoted nothing yet (stable 0) and runs v2's canary on half its users: the candidate arm gets acme's v2,
    the stable arm what acme was served until now (the shared stable v1), recorded as acme's v0 so that the line's
    canary compares the two on acme's own counters; beta's routing does not change."""
    st = gateway.state
    st.line_tables["acme"] = PolicyTable(stable=0, candidate=2, canary_share=0.5)
    st.lines = routable(gateway.cfg.projects, st.line_tables, st.line_loaded)
    got = set()
    for i in range(200):
        r, model, line, table = gateway.pick(user_hash(f"sk-user-{i}"), tenant="acme")
        got.add((r.arm, r.version, model, line, table.candidate))
        assert gateway.pick(user_hash(f"sk-user-{i}"), tenant="beta")[1] == "j@beta-v1"
    assert got == {("stable", 0, "j-v1", "acme", 2), ("candidate", 2, "j@acme-v2", "acme", 2)}


def test_an_evaluation_pins_a_version_of_its_own_line_or_the_shared_one(gateway: Gateway) -> None:
    r, model, line, _ = gateway.pick("00", forced=2, tenant="acme", forced_line="acme")
    assert (r.arm, r.version, model, line) == ("eval", 2, "j@acme-v2", "acme")
    assert gateway.pick("00", forced=1, tenant="acme")[1:3] == ("j-v1", "")  # no line header: the shared line
    assert gateway.pick("00", forced=0, tenant="acme", forced_line="acme")[1] == BASE
    with pytest.raises(Exception, match="policy version 2 is not loaded"):  # shared v2 does not exist
        gateway.pick("00", forced=2, tenant="acme")


def test_a_key_naming_another_project_in_a_header_is_refused_and_its_own_passes(gateway: Gateway) -> None:
    """X-Project-ID (Continue's, as feedback checks it) and X-OnlineRL-Line must name the key's own project."""

    async def post(headers: dict[str, str]) -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=gateway), base_url="http://gw") as c:
            return await c.post("/v1/completions", json={"prompt": "x", "max_tokens": 1}, headers=headers)

    beta = {"Authorization": "Bearer sk-beta-0123"}
    for header in ("X-Project-ID", "X-OnlineRL-Line"):
        resp = asyncio.run(post({**beta, header: "acme"}))
        assert resp.status_code == 403, resp.text
        err = resp.json()["error"]
        assert (err["code"], err["param"]) == ("wrong_project", header) and "'beta'" in err["message"]
    long = asyncio.run(post({**beta, "X-Project-ID": "a" * 4000}))  # oversized: refused, and not echoed whole
    assert long.status_code == 403 and len(long.text) < 600
    # its own project passes the check (then 503: this gateway's Redis view was never refreshed)
    assert asyncio.run(post({**beta, "X-Project-ID": " beta "})).status_code == 503
    assert asyncio.run(post({**beta, "X-Project-ID": ""})).status_code == 503  # empty: names no project
    assert asyncio.run(post({"X-Project-ID": "acme"})).status_code == 401  # no key: unauthorized first


# --- the reloader's checkpoint rules per line --------------------------------------------------------------------
def _folder(root: Path, version: int, line: str, manifest_line: str | None = None) -> Announcement:
    d = root / f"v{version}"
    d.mkdir(parents=True)
    (d / "adapter_model.safetensors").write_bytes(b"weights")
    files = {"adapter_model.safetensors": hashlib.sha256(b"weights").hexdigest()}
    m = CheckpointManifest(
        job=JOB,
        version=version,
        parent_version=0,
        kind="lora",
        base_model="b",
        files=files,
        line=line if manifest_line is None else manifest_line,
    )
    (d / "manifest.json").write_bytes(m.to_json())
    return Announcement("1-0", version, str(d), "lora", hashlib.sha256(m.to_json()).hexdigest())


def test_a_projects_checkpoint_loads_only_on_its_own_line(tmp_path: Path) -> None:
    acme = _folder(checkpoint_root(tmp_path, JOB, "acme"), 1, "acme")
    assert validate(acme, tmp_path, JOB, "acme").line == "acme"
    for line in ("", "beta"):  # announced on the shared stream or on beta's: outside that line's folder
        with pytest.raises(CheckpointError, match="is not inside") as exc:
            confine(acme, tmp_path, JOB, line)
        assert exc.value.reason == "outside_checkpoint_dir"
    shared = _folder(checkpoint_root(tmp_path, JOB), 1, "")
    with pytest.raises(CheckpointError, match="is not inside"):
        confine(shared, tmp_path, JOB, "acme")
    # beta's manifest copied into acme's folder: the place is right, the manifest names another line
    forged = _folder(checkpoint_root(tmp_path, JOB, "acme"), 2, "acme", manifest_line="beta")
    with pytest.raises(CheckpointError, match="says job=j line=beta v2 lora; announced job=j line=acme v2") as exc:
        validate(forged, tmp_path, JOB, "acme")
    assert exc.value.reason == "manifest_mismatch"


def test_a_symlinked_project_folder_that_leads_to_another_line_is_refused(tmp_path: Path) -> None:
    beta = _folder(checkpoint_root(tmp_path, JOB, "beta"), 1, "beta")
    checkpoint_root(tmp_path, JOB, "acme").parent.mkdir(parents=True, exist_ok=True)
    checkpoint_root(tmp_path, JOB, "acme").symlink_to(Path(beta.path).parent)
    via_acme = Announcement("1-0", 1, str(checkpoint_root(tmp_path, JOB, "acme") / "v1"), "lora", beta.manifest_sha256)
    with pytest.raises(CheckpointError) as exc:
        confine(via_acme, tmp_path, JOB, "acme")
    assert exc.value.reason == "symlink_escape"


def test_the_reloader_follows_each_registered_line_and_takes_only_that_lines_checkpoints(
    tmp_path: Path, empty_valkey, redis_client
) -> None:
    """``adapters: all``: the reloader finds acme's line in the job's registry and reads its stream with the shared
    one; acme's own checkpoint registers on acme's line, beta's folder announced on acme's stream and acme's announced
    on the shared stream are refused and audited. The engine answers nothing here: what is under test is what the
    reloader takes, not the load (tests/projects/test_project_serving.py)."""
    r = redis_client
    k = Keys(JOB)
    acme = _folder(checkpoint_root(tmp_path, JOB, "acme"), 1, "acme")
    beta = _folder(checkpoint_root(tmp_path, JOB, "beta"), 1, "beta")
    for stream, ann in ((k.for_project("acme").checkpoints, beta), (k.checkpoints, acme)):  # each on the wrong line
        r.xadd(stream, {"version": "1", "path": ann.path, "kind": "lora", "manifest_sha256": ann.manifest_sha256})
    r.xadd(
        k.for_project("acme").checkpoints,
        {"version": "1", "path": acme.path, "kind": "lora", "manifest_sha256": acme.manifest_sha256},
    )
    cfg = from_mapping(
        {
            "job": JOB,
            "storage": {"checkpointDir": str(tmp_path)},
            "serving": {"engineUrl": f"http://127.0.0.1:{free_port()}"},
            "projects": {"adapters": "all"},
        }
    )

    async def go() -> None:
        client = aioredis.from_url(empty_valkey.url)
        async with httpx.AsyncClient(base_url=cfg.serving.engine_url, timeout=1) as engine:
            rl = Reloader(cfg, client, engine, engine, options=ReloaderOptions(poll_seconds=0.1))
            assert rl.projects is not None and rl.projects.lines == {}  # nothing listed, nothing registered yet
            register(r, k, "acme")  # the trainer, before the line's first announcement
            await rl.projects.discover()
            await rl.read_stream(block_ms=None)
            line = rl.projects.lines["acme"]
            assert line.keys == k.for_project("acme") and line.model_name(1) == "j@acme-v1"
            assert {v: s.ann.path for v, s in line.versions.items()} == {1: acme.path} and rl.versions == {}
            await asyncio.to_thread(line.validate, 1)  # and its contents pass on its own line
            await client.aclose()

    asyncio.run(go())
    refusals = [e for _, e in audit.read(r, k)]
    assert len(refusals) == 2 and all(b"outside_checkpoint_dir" in e for e in refusals), refusals
    assert sum(b'"tenant":"acme"' in e.replace(b" ", b"") for e in refusals) == 1  # the refusal on acme's line


def test_under_direct_a_project_lines_loaded_version_becomes_that_lines_stable_only(
    tmp_path: Path, empty_valkey, redis_client
) -> None:
    """``rollout.strategy: direct``: once acme's v1 is loaded on every live replica, the reloader raises acme's stable
    to 1, on acme's table only, and reads nothing more for it on the next ticks."""
    r, k = redis_client, Keys(JOB)
    acme = _folder(checkpoint_root(tmp_path, JOB, "acme"), 1, "acme")
    r.xadd(
        k.for_project("acme").checkpoints,
        {"version": "1", "path": acme.path, "kind": "lora", "manifest_sha256": acme.manifest_sha256},
    )
    cfg = from_mapping(
        {
            "job": JOB,
            "storage": {"checkpointDir": str(tmp_path)},
            "serving": {"engineUrl": f"http://127.0.0.1:{free_port()}"},
            "rollout": {"strategy": "direct"},
            "projects": {"adapters": "listed", "listed": ["acme"]},
        }
    )
    r.hset(k.policy, mapping={"stable": "0"})
    shared_before = r.hgetall(k.policy)

    async def go() -> None:
        client = aioredis.from_url(empty_valkey.url)
        async with httpx.AsyncClient(base_url=cfg.serving.engine_url, timeout=1) as engine:
            rl = Reloader(cfg, client, engine, engine, replica="r-1")
            await rl.read_stream(block_ms=None)
            line = rl.projects.lines["acme"]
            line.versions[1].state = "loaded"  # as a load leaves it (the load itself: test_project_serving.py)
            await line._save_state(1)
            rl.engine_seen_up = True
            await rl.beat()
            await rl.projects.tick({"j@acme-v1"})
            assert line.raise_tried == {1} and not line._untried_loaded()
            await client.aclose()

    asyncio.run(go())
    assert r.hget(k.for_project("acme").policy, "stable") == b"1"
    assert r.hgetall(k.policy) == shared_before  # the shared table: untouched
    assert r.pttl(k.for_project("acme").replica_versions("r-1")) > 3_000_000  # the replica's deadline + an hour


# --- one engine, many adapters ------------------------------------------------------------------------------------
def test_max_cpu_loras_reaches_vllm_in_the_local_stack_and_on_kubernetes() -> None:
    from onlinerl_operator.render import RenderContext, vllm_args

    cfg = from_mapping({"serving": {"lora": {"maxLoras": 4, "maxCpuLoras": 200}}})
    local = " ".join(vllm_argv(cfg, "/m", cpu=True))
    pod = " ".join(vllm_args(RenderContext(name="demo", namespace="ns", uid="u", cfg=cfg)))
    for argv in (local, pod):
        assert "--max-loras 4 --max-cpu-loras 200" in argv
    assert "--max-cpu-loras" not in " ".join(vllm_argv(from_mapping({}), "/m", cpu=True))  # unset: vLLM's default
    with pytest.raises(ValueError, match=r"maxCpuLoras \(3\) must be at least maxLoras \(4\)"):
        from_mapping({"serving": {"lora": {"maxLoras": 4, "maxCpuLoras": 3}}})
