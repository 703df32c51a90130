"""Two local serving replicas behind one port, started by the stack code `onlinerl up --serving-replicas 2` runs:
8 streaming clients through a policy switch and a rollback, then one replica killed mid-switch (issue 19).

Real processes throughout: valkey with the per-component ACL users, two vLLM-CPU engines (tiny random model, LoRA),
each with its gateway inside its own process (``serving.gatewayMode: inProcess``, issue 40: the gateway's every
promise, records before ``[DONE]`` and 0 failed across a switch, through that mode; the sidecar gateway's are in
tests/serving/test_serving_vllm.py), two reloaders (``ONLINERL_REPLICA=local-0/1``), the balancer; versions are
published as the trainer publishes them (tests/serving/lora_helpers.py) under ``rollout.strategy: direct``, so each
reloader loads them and stable rises only when every live replica has loaded the version. One stack for the whole
module (CI budget).
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import orjson
import pytest
import redis

from onlinerl.cli import main as cli_main
from onlinerl.config import from_mapping
from onlinerl.dataplane import policy, versions
from onlinerl.keys import Keys
from onlinerl.loop.stack import LocalPorts, Stack, start_stack
from onlinerl.procs import wait_for
from onlinerl.schemas import PolicyTable, RolloutRecord
from onlinerl.valkey import free_port
from onlinerl_serving.requests import Limits, parse_completion_request, upstream_body
from tests.serving.abandon import assert_a_leaving_client_aborts_the_generation, series_sum
from tests.serving.lora_helpers import announce, write_lora_checkpoint

pytestmark = pytest.mark.vllm
JOB = "rep"
TENANT = "demo"
PROMPTS = [f"def f{i}(a, b):\n    return " for i in range(8)]
REPLICAS = ("local-0", "local-1")


@dataclass
class Served:
    """One client request through the balancer, as the client saw it."""

    started: float
    ended: float = 0.0
    status: int = 0
    error: str = ""
    replica: str = ""
    rollout_id: str = ""
    version: int = -1
    prompt: str = ""

    @property
    def ok(self) -> bool:
        return self.status == 200 and not self.error


@dataclass
class Clients:
    """``n`` threads, each streaming completions through the balancer back to back until :meth:`stop`."""

    url: str
    api_key: str
    n: int = 8
    served: list[Served] = field(default_factory=list)
    stopping: threading.Event = field(default_factory=threading.Event)
    threads: list[threading.Thread] = field(default_factory=list)

    def start(self) -> Clients:
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(self.n)]
        for t in self.threads:
            t.start()
        return self

    def _run(self, i: int) -> None:
        with httpx.Client(base_url=self.url, timeout=300) as client:
            while not self.stopping.is_set():
                self.served.append(self.one(i, client))

    def one(self, i: int, client: httpx.Client | None = None) -> Served:
        """One streaming request of client ``i`` (its own prompt)."""
        if client is None:
            with httpx.Client(base_url=self.url, timeout=300) as own:
                return self.one(i, own)
        prompt, headers = PROMPTS[i], {"Authorization": f"Bearer {self.api_key}"}
        body = {"model": "onlinerl", "prompt": prompt, "max_tokens": 6, "temperature": 0.5, "stream": True}
        s = Served(started=time.time(), prompt=prompt)
        try:
            with client.stream("POST", "/v1/completions", json=body, headers=headers) as resp:
                s.status, s.replica = resp.status_code, resp.headers.get("x-onlinerl-replica", "")
                s.rollout_id = resp.headers.get("x-onlinerl-rollout-id", "")
                s.version = int(resp.headers.get("x-onlinerl-policy-version", "-1"))
                raw = resp.read()
            events = [e[6:] for e in raw.split(b"\n\n") if e.startswith(b"data: ")]
            if resp.status_code != 200:
                s.error = raw.decode(errors="replace")[:300]
            elif not events or events[-1] != b"[DONE]" or any("error" in orjson.loads(e) for e in events[:-1]):
                s.error = f"bad stream: {raw[:300]!r}"
        except httpx.HTTPError as exc:
            s.error = repr(exc)
        s.ended = time.time()
        return s

    def stop(self) -> list[Served]:
        self.stopping.set()
        for t in self.threads:
            t.join(150)
        return list(self.served)


@dataclass
class Watch:
    """Polls the policy table and each replica's own state (versions.read_replica) every 50 ms while a switch runs.

    Each poll reads the table FIRST, then the replicas: a poll that sees stable = N and a replica without N loaded is
    a switch ahead of that replica (the replica's state can only have moved forward since the table was read)."""

    r: redis.Redis
    keys: Keys
    polls: list[tuple[float, PolicyTable, dict[str, dict[int, str]], list[str]]] = field(default_factory=list)
    stopping: threading.Event = field(default_factory=threading.Event)
    thread: threading.Thread | None = None

    def start(self) -> Watch:
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        return self

    def _run(self) -> None:
        while not self.stopping.is_set():
            self.poll()
            time.sleep(0.05)

    def poll(self) -> None:
        table = policy.read(self.r, self.keys)
        states = {
            rid: {v: s.state for v, s in versions.read_replica(self.r, self.keys, rid).items()} for rid in REPLICAS
        }
        self.polls.append((time.time(), table, states, versions.live_replicas(self.r, self.keys)))

    def stop(self) -> Watch:
        self.stopping.set()
        if self.thread is not None:
            self.thread.join(10)
        return self

    def loaded_by(self, replica: str) -> set[int]:
        """Every version ``replica`` was seen holding as loaded (retired later or not)."""
        return {v for _, _, st, _ in self.polls for v, s in st[replica].items() if s == "loaded"}


@dataclass
class Env:
    stack: Stack
    r: redis.Redis
    keys: Keys
    paths: dict[int, Path]
    watches: list[Watch] = field(default_factory=list)  # every poll of the module: what each replica had loaded

    def loaded_by(self, replica: str) -> set[int]:
        return set().union(*(w.loaded_by(replica) for w in self.watches))

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.stack.cfg.serving.port}"

    def table(self) -> PolicyTable:
        return policy.read(self.r, self.keys)

    def record(self, s: Served) -> RolloutRecord:
        raw = self.r.hget(self.keys.rollouts(TENANT, s.prompt), s.rollout_id)
        assert raw is not None, f"no rollout record for {s}"
        return RolloutRecord.from_json(raw)

    def balancer(self) -> dict[str, dict]:
        return {r["name"]: r for r in httpx.get(f"{self.url}/balancer/status", timeout=5).json()["replicas"]}

    def policy_cli(self, *args: str) -> int:
        return cli_main(["policy", "--redis-url", self.stack.valkey.url, "--job", JOB, *args])


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory, tiny_model_path: Path) -> Iterator[Env]:
    state = tmp_path_factory.mktemp("replicas")
    ckpt = state / "ckpt"
    # Versions are written (torch + peft in this process) before the engines start, so that work does not compete
    # with two vLLMs for the 2 cores; each is announced later, when the test switches to it.
    paths = {v: write_lora_checkpoint(JOB, tiny_model_path, ckpt, v) for v in (1, 2, 3)}
    cfg = from_mapping(
        {
            "job": JOB,
            "model": {"path": str(tiny_model_path), "maxModelLen": 1024},
            # requestTimeoutSeconds: a fresh vLLM-CPU compiles for the first concurrent LoRA batch (each replica's
            # own torch.compile cache); under 2 vLLMs on 2 cores that has taken over 60 s, the default.
            # routingHeaders all: the clients tell which version served them by the response header (issue 35 hides
            # it from user keys by default)
            "serving": {
                "host": "127.0.0.1",
                "port": free_port(),
                "replicas": 2,
                "requestTimeoutSeconds": 240,
                "routingHeaders": "all",
                "gatewayMode": "inProcess",
            },
            "rollout": {"strategy": "direct"},
            "storage": {"checkpointDir": str(ckpt)},
        }
    )
    ports = LocalPorts(redis=free_port(), reloader=free_port(), rollout=free_port(), replica_base=0)
    stack = start_stack(cfg, state, build_data=False, ports=ports, serving_only=True)
    r = redis.Redis.from_url(stack.valkey.url)  # admin's URL: the test reads every family
    try:
        env = Env(stack, r, Keys(JOB), paths)
        switch_to(env, 1)  # the starting point: both replicas serve v1 (watched: test 1 checks this switch too)
        warm = Clients(env.url, stack.api_key)
        with ThreadPoolExecutor(warm.n) as pool:  # one concurrent batch per replica: its compile happens here
            served = list(pool.map(warm.one, range(warm.n)))
        assert all(s.ok for s in served), served
        # The table names v1 once both reloaders loaded it; each gateway routes it once it has seen it in vLLM's models
        # (at once since the gateway asks vLLM when the table names a version it lacks, but a request may have been
        # routed just before). The tests start from "every request is v1".
        wait_for(lambda: all(s.ok and s.version == 1 for s in (warm.one(i) for i in range(4))), 30, what="v1 routed")
        yield env
    finally:
        r.close()
        stack.stop()


def switch_to(env: Env, version: int, timeout: float = 120) -> Watch:
    """Announce ``version`` and watch until the table's stable is it."""
    watch = Watch(env.r, env.keys).start()
    env.watches.append(watch)
    announce(env.r, JOB, version, env.paths[version])
    try:
        wait_for(lambda: env.table().stable == version, timeout, what=f"stable = v{version}")
        watch.poll()
    finally:
        watch.stop()
    return watch


def test_two_replicas_switch_and_rollback_under_8_streaming_clients(env: Env) -> None:
    assert [r.replica_id for r in env.stack.replicas] == list(REPLICAS)
    assert {c.name for c in env.stack.children} >= {"vllm-0", "vllm-1", "balancer"}
    assert not {c.name for c in env.stack.children} & {"gateway-0", "gateway-1"}  # each gateway is in its vLLM
    for i in (0, 1):  # and logs there, as the sidecar logged to its own file
        log = (env.stack.paths.logs / f"vllm-{i}.log").read_text()
        assert "onlinerl gateway in vLLM's process on" in log
        # the sampled tokens' strings table is in vLLM's API server, filled with the whole vocabulary (issue 40)
        assert int(re.search(r"from a table per token id: (\d+) decoded at start", log)[1]) == 49152
    clients = Clients(env.url, env.stack.api_key).start()
    try:
        wait_for(lambda: sum(s.ok for s in clients.served) >= 16, 60, what="16 requests served before the switch")
        watch = switch_to(env, 2)
        wait_for(lambda: any(s.version == 2 for s in clients.served if s.ok), 60, what="a request served by v2")
        assert env.policy_cli("rollback") == 0
        assert (env.table().stable, env.table().hold) == (1, 1)
        rolled_back_at = time.time()
        wait_for(
            lambda: sum(s.ok and s.started > rolled_back_at + 1.5 for s in clients.served) >= 16,
            60,
            what="16 requests after the rollback",
        )
    finally:
        served = clients.stop()

    failed = [s for s in served if not s.ok]
    t0 = min(s.started for s in served)
    print(f"failed (started, ended) s after the clients started: {[(s.started - t0, s.ended - t0) for s in failed]}")
    print(f"switch+rollback: {len(served)} requests, {len(failed)} failed, {len(watch.polls)} polls")
    assert not failed, f"{len(failed)} of {len(served)} failed: {failed[:3]}"
    # The table reached v2 only after both replicas had loaded it: every poll that saw stable = 2 (table read first)
    # saw v2 loaded on both; and the switch was watched from before it (some poll saw stable 1 and v2 not yet loaded
    # everywhere).
    switched = [(st, live) for _, table, st, live in watch.polls if table.stable == 2]
    assert switched, "no poll saw stable = 2"
    for st, live in switched:
        assert sorted(live) == list(REPLICAS)
        assert all(st[rid].get(2) == "loaded" for rid in REPLICAS), st
    assert any(t.stable == 1 and not all(st[r].get(2) == "loaded" for r in REPLICAS) for _, t, st, _ in watch.polls)
    # Both replicas served, through the one port, and both versions were served.
    by_replica = {rid: [s for s in served if s.replica == rid] for rid in REPLICAS}
    assert all(len(v) >= 8 for v in by_replica.values()), {k: len(v) for k, v in by_replica.items()}
    odd = [(s.replica, round(s.started - t0, 2), s.version) for s in served if s.version not in (1, 2)]
    marks = {"switch_polls": [(round(t - t0, 2), tb.stable, st) for t, tb, st, _ in watch.polls[:3] + watch.polls[-3:]]}
    assert {s.version for s in served} == {1, 2}, (odd, marks, round(rolled_back_at - t0, 2))
    # After the rollback (plus the gateways' 0.5 s policy cache), every request is v1 again.
    assert {s.version for s in served if s.started > rolled_back_at + 1.5} == {1}
    # Every recorded version is one its replica had loaded, and the record agrees with the response header.
    loaded = {rid: env.loaded_by(rid) for rid in REPLICAS}
    for s in served:
        rec = env.record(s)
        assert rec.policy_version == s.version
        assert rec.policy_version in loaded[s.replica], (s, loaded)
    status = env.balancer()
    assert all(status[rid]["failed"] == 0 and status[rid]["refused"] == 0 for rid in REPLICAS)


def test_a_non_stream_client_that_leaves_aborts_the_generation_in_process(env: Env) -> None:
    """In vLLM's process the gateway hands its client's own ASGI receive to vLLM's handler, which aborts when the
    client leaves (no watcher tasks in the gateway): a client that gives up leaves no 2,000-token generation behind,
    and the gateway counts a 499."""
    rep = env.stack.replicas[0]
    body = {"model": "onlinerl", "prompt": PROMPTS[0], "max_tokens": 2000, "temperature": 0.0, "stop": []}
    with httpx.Client(base_url=rep.gateway_url, timeout=30) as c:
        direct = series_sum(c.get("/metrics").text, "onlinerl_serving_engine_calls_total", 'via="direct"')
        assert_a_leaving_client_aborts_the_generation(c, body, {"Authorization": f"Bearer {env.stack.api_key}"})
        # ...through vLLM's completion handler called as a function (vllm_completions.py), not its HTTP route
        assert series_sum(c.get("/metrics").text, "onlinerl_serving_engine_calls_total", 'via="direct"') == direct + 1


def test_a_non_stream_completion_in_process_is_what_vllms_own_route_answers(env: Env) -> None:
    """Non-streaming, the in-process gateway calls vLLM's completion handler as a function, without its HTTP route
    and without JSON written to be parsed again (issue 40): the client gets what vLLM's own route answers for the
    gateway's upstream body (seeded sampling: the same text, token ids, log-probs and offsets), and the rollout record
    holds those ids and log-probs."""
    rep = env.stack.replicas[0]
    client_body = {
        "model": "onlinerl",
        "prompt": PROMPTS[1],
        "max_tokens": 12,
        "temperature": 0.9,  # above the exploration floor: sent upstream as it is
        "seed": 1234,
        "logprobs": 1,
        "return_token_ids": True,
        "stop": ["\n\n"],
    }
    headers = {"Authorization": f"Bearer {env.stack.api_key}"}
    with httpx.Client(base_url=rep.gateway_url, timeout=60) as c:
        direct = series_sum(c.get("/metrics").text, "onlinerl_serving_engine_calls_total", 'via="direct"')
        resp = c.post("/v1/completions", json=client_body, headers=headers)
        assert resp.status_code == 200, resp.text
        assert series_sum(c.get("/metrics").text, "onlinerl_serving_engine_calls_total", 'via="direct"') == direct + 1
    got = resp.json()
    limits = Limits(max_prompt_chars=10_000, max_tokens_cap=64)
    upstream = upstream_body(parse_completion_request(orjson.dumps(client_body), limits), got["model"])
    route = httpx.post(
        f"http://127.0.0.1:{rep.engine}/v1/completions",
        content=upstream,
        headers={"content-type": "application/json"},
        timeout=60,
    )
    assert route.status_code == 200, route.text
    want = route.json()
    (mine,), (theirs,) = got["choices"], want["choices"]
    assert len(mine["token_ids"]) >= 1 and mine["logprobs"]["top_logprobs"][0]  # log-probs were asked for and came
    for name in ("text", "token_ids", "logprobs", "finish_reason"):
        assert mine[name] == theirs[name], name
    assert got["usage"] == {k: want["usage"][k] for k in got["usage"]}
    record = env.record(Served(0.0, prompt=PROMPTS[1], rollout_id=resp.headers["x-onlinerl-rollout-id"]))
    assert record.completion_token_ids == theirs["token_ids"]
    assert record.behaviour_logprobs == theirs["logprobs"]["token_logprobs"]


def test_kill_one_replica_mid_switch(env: Env) -> None:
    """local-1 dies (SIGKILL, its whole replica: vLLM, gateway, reloader) just before v3 is announced: the balancer
    routes around it, the switch waits for it while its heartbeat lasts, completes for the live set once it lapses,
    and local-1's versions stop counting for pruning."""
    assert env.policy_cli("resume") == 0  # release the rollback's hold: direct may raise stable again
    clients = Clients(env.url, env.stack.api_key).start()
    # gateway first, as a dying pod drops off its Service: from then on the balancer's connections are refused
    dead = sorted(env.stack.replica_children("local-1"), key=lambda c: not c.name.startswith("gateway"))
    try:
        wait_for(lambda: sum(s.ok for s in clients.served) >= 16, 60, what="16 requests before the kill")
        kill_started = time.time()
        for child in dead:
            child.kill()
        killed_at = time.time()
        # v3 is announced once local-1 is dead, not before: a reloader loads an adapter in about 50 ms, so an
        # announcement ahead of the kill let local-1 load v3 and the switch complete on both replicas, legitimately
        announce(env.r, JOB, 3, env.paths[3])
        watch = Watch(env.r, env.keys).start()
        env.watches.append(watch)
        live_set_before = versions.live_replicas(env.r, env.keys)
        wait_for(
            lambda: "local-1" not in versions.live_replicas(env.r, env.keys),
            versions.HEARTBEAT_TTL_SECONDS + 10,
            what="local-1's heartbeat to lapse",
        )
        lapsed_at = time.time()
        wait_for(lambda: env.table().stable == 3, 60, what="stable = v3 on the live set")
        switched_at = time.time()
        watch.stop()
        wait_for(
            lambda: sum(s.ok and s.started > switched_at + 1.0 and s.version == 3 for s in clients.served) >= 8,
            60,
            what="8 requests served by v3 after the switch",
        )
    finally:
        served = clients.stop()

    assert "local-1" in live_set_before  # the kill did not drop it at once: the heartbeat TTL did
    # Requests in flight on local-1 when it died may fail (never replayed: they may have reached it); every request
    # that started after the kill succeeded, all on local-0.
    after = [s for s in served if s.started > killed_at + 0.5]
    assert after and all(s.ok for s in after), [s for s in after if not s.ok][:3]
    assert {s.replica for s in after} == {"local-0"}
    failed = [s for s in served if not s.ok]
    print(
        f"kill mid-switch: {len(served)} requests, {len(after)} after the kill (0 failed), {len(failed)} in flight on"
        f" local-1 broke; lapse {lapsed_at - killed_at:.1f}s after the kill, switch {switched_at - lapsed_at:.1f}s on"
    )
    assert len(failed) <= clients.n, failed  # each client has one request in flight at a time
    assert all(s.replica == "local-1" and s.started <= killed_at and s.ended >= kill_started for s in failed), failed
    # While local-1's heartbeat lasted, the switch waited for it (it never loaded v3); it completed without it.
    assert all("local-1" not in live for _, t, _, live in watch.polls if t.stable == 3)
    assert any("local-1" in live and t.stable == 1 for _, t, _, live in watch.polls)
    assert switched_at >= lapsed_at - 0.5
    table = versions.read(env.r, env.keys)
    assert sorted(table.replicas) == ["local-0"] and table.states[3].state == "loaded"
    # local-1's versions no longer pin anything: what pruning keeps is exactly what local-0 holds.
    local0 = versions.read_replica(env.r, env.keys, "local-0")
    assert table.in_use() == {v for v, s in local0.items() if s.state in versions.IN_USE}
    status = env.balancer()
    assert status["local-1"]["ready"] is False and status["local-0"]["failed"] == 0
