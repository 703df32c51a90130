"""`onlinerl up` as a newcomer runs it: safe by default. One real stack (the CLI, its own vLLM on CPU), four promises.

- Nothing listens beyond loopback: every listening socket of the stack's process tree (the CLI, valkey, vLLM and its
  engine process, gateway, reloader, feedback, trainer, rollout controller) is on 127.0.0.1 / ::1. Before, the
  gateway, feedback, trainer metrics, reloader and rollout ports were on 0.0.0.0. ``--host 0.0.0.0`` opens them
  (tests/loop/test_up_ports.py checks its warning).
- A second `onlinerl up` beside it (same folder, same ports) exits 2 within seconds with one line naming the first
  stack and no traceback, writes nothing, and the first stack keeps serving.
- A completion body without ``max_tokens`` is answered 200 within seconds on CPU (16 tokens, OpenAI's default).
- Stock Continue against it, as a user copies the config `onlinerl up` PRINTS (issue 36's must-show): Continue's
  parser loads it; completions stream through Continue's request code to its apiBase and key; accepts and rejects
  posted as Continue's DataLogger posts them to its data: destination are trained, each once; a repeat, a ``0.1.0``
  repeat, a ``noCode`` event, a ``tokensGenerated`` event and an unknown schema are answered 2xx and not trained;
  a fresh ``0.1.0`` event and the direct upload train. "Trained" is read from the stack's own samples stream.

The stack runs under umask 0, so its secret files must be 0600 by construction (onlinerl/secretfile.py).
"""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import orjson
import psutil
import pytest
import redis
import yaml

from onlinerl.config import load_config
from onlinerl.continue_config import DATA_PATH
from onlinerl.data.builder import FimSample, write_jsonl
from onlinerl.keys import Keys
from onlinerl.loop.stack import StackPaths, ensure_demo_key
from onlinerl.loop.template import template_for
from onlinerl.procs import wait_for
from onlinerl.valkey import free_port
from tests.feedback.test_stock_continue import continue_client, outcome

pytestmark = pytest.mark.vllm

ONLINERL = str(Path(sys.executable).parent / "onlinerl")
LOOPBACK = {"127.0.0.1", "::1"}
SNIPPETS = [("def add(a, b):\n    return ", "a + b", "\n"), ("for i in range(", "10", "):\n    print(i)\n")]


@dataclass
class Up:
    proc: subprocess.Popen
    argv: list[str]
    state: Path
    ports: dict[str, int]
    log: Path

    @property
    def gateway(self) -> str:
        return f"http://127.0.0.1:{self.ports['gateway']}"

    def key(self) -> str:
        return ensure_demo_key(StackPaths(self.state))

    def tree(self) -> list[psutil.Process]:
        root = psutil.Process(self.proc.pid)
        return [root, *root.children(recursive=True)]


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory, tiny_model_path: Path) -> Iterator[Up]:
    home = tmp_path_factory.mktemp("up")
    state = home / ".onlinerl"
    rows = [FimSample(f"s{i}", "line", "s.py", 1, 2, p, m, s) for i, (p, m, s) in enumerate(SNIPPETS)]
    write_jsonl(rows, state / "data" / "train.jsonl")  # skip the data build (the stack's own step, not tested here)
    write_jsonl(rows, state / "data" / "test.jsonl")
    p = {n: free_port() for n in ("gateway", "engine", "feedback", "metrics", "redis", "reloader", "rollout")}
    config = home / "config.yaml"
    config.write_text(
        yaml.safe_dump(
            {  # only ports and the model: every other field is the product's default (host, profile, strategy...)
                "model": {"path": str(tiny_model_path)},
                "serving": {"port": p["gateway"], "engineUrl": f"http://127.0.0.1:{p['engine']}"},
                "feedback": {"port": p["feedback"]},
                "trainer": {"metricsPort": p["metrics"]},
            }
        )
    )
    argv = [ONLINERL, "--config", str(config), "up", "--state", str(state), "--redis-port", str(p["redis"])]
    argv += ["--reloader-port", str(p["reloader"]), "--rollout-port", str(p["rollout"])]
    log = home / "up.log"
    with log.open("w") as out:
        proc = subprocess.Popen(
            argv, cwd=home, stdout=out, stderr=subprocess.STDOUT, preexec_fn=lambda: os.umask(0), start_new_session=True
        )
    running = Up(proc, argv, state, p, log)
    try:
        wait_for(lambda: "onlinerl is up" in log.read_text() or proc.poll() is not None, 900, 1.0, "onlinerl up")
        assert proc.poll() is None, log.read_text()[-4000:]
        yield running
    finally:
        pids = [c.pid for c in running.tree()] if proc.poll() is None else []
        proc.send_signal(signal.SIGINT)  # Ctrl-C: the stack stops every child in reverse order
        try:
            proc.wait(120)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
        left = [pid for pid in pids if psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE]
        assert not left, f"processes left behind: {left}"


def test_nothing_listens_beyond_loopback(up: Up) -> None:
    listening: dict[tuple[str, int], str] = {}
    for proc in up.tree():
        try:
            conns = proc.net_connections(kind="inet")
            name = proc.name()
        except psutil.NoSuchProcess:
            continue
        for c in conns:
            if c.status == psutil.CONN_LISTEN:
                listening[(c.laddr.ip, c.laddr.port)] = f"{name} (pid {proc.pid})"
    print("\n".join(f"{ip}:{port}  {who}" for (ip, port), who in sorted(listening.items())))
    open_ = {addr: who for addr, who in listening.items() if addr[0] not in LOOPBACK}
    assert not open_, f"listening beyond loopback: {open_}"
    ours = {port for _, port in listening}
    assert set(up.ports.values()) <= ours, f"not all the stack's ports were seen: {set(up.ports.values()) - ours}"


def test_a_second_up_exits_2_in_one_line_and_the_first_keeps_serving(up: Up) -> None:
    config = up.state / "config.yaml"
    written = config.stat().st_mtime_ns
    t0 = time.monotonic()
    second = subprocess.run(up.argv, cwd=up.state.parent, capture_output=True, text=True, timeout=120)
    took = time.monotonic() - t0
    print(f"second `onlinerl up`: exit {second.returncode} after {took:.1f} s: {second.stderr.strip()}")
    assert second.returncode == 2
    assert took < 20, took
    assert second.stdout == "" and "Traceback" not in second.stderr
    lines = second.stderr.strip().splitlines()
    assert len(lines) == 1, second.stderr
    assert f"another `onlinerl up` (state {up.state.resolve()}) holds ports" in lines[0]
    for what in ("valkey", "vLLM", "gateway", "reloader", "feedback", "trainer metrics", "rollout controller"):
        port = up.ports[{"valkey": "redis", "vLLM": "engine", "trainer metrics": "metrics"}.get(what, what.split()[0])]
        assert f"{port} ({what}; its " in lines[0], (what, lines[0])  # every port, each as the first stack's
    assert config.stat().st_mtime_ns == written  # nothing written into the first stack's state
    assert up.proc.poll() is None
    body = {"prompt": "def add(a, b):\n    return ", "max_tokens": 4}
    resp = httpx.post(
        f"{up.gateway}/v1/completions", json=body, headers={"Authorization": f"Bearer {up.key()}"}, timeout=60
    )
    assert resp.status_code == 200, resp.text


def test_a_body_without_max_tokens_is_answered_within_seconds(up: Up) -> None:
    body = {"prompt": "def add(a, b):\n    return ", "temperature": 0.0}
    t0 = time.monotonic()
    resp = httpx.post(
        f"{up.gateway}/v1/completions", json=body, headers={"Authorization": f"Bearer {up.key()}"}, timeout=120
    )
    took = time.monotonic() - t0
    print(f"no max_tokens: {resp.status_code} in {took:.2f} s, usage {resp.json().get('usage')}")
    assert resp.status_code == 200, resp.text
    assert took < 10, took
    usage = resp.json().get("usage") or {}
    assert usage.get("completion_tokens", 0) <= 16, usage


def test_the_stacks_secret_files_are_private_under_umask_0(up: Up) -> None:
    paths = StackPaths(up.state)
    for f in (paths.config, paths.keys, paths.redis_users, paths.valkey / "users.acl"):
        assert stat.S_IMODE(f.stat().st_mode) == 0o600, f
    assert stat.S_IMODE(paths.valkey.stat().st_mode) == 0o700


def printed_config(log: str) -> str:
    """The Continue config as a user copies it from `onlinerl up`'s output: from its first comment line to the fork's
    last one."""
    lines = log.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("# onlinerl for stock Continue"))
    end = next(i for i in range(start, len(lines)) if lines[i].startswith("#   completionTrackingHeaders"))
    return "\n".join(lines[start : end + 1]) + "\n"


def test_stock_continue_closes_the_loop_with_the_config_up_prints(up: Up) -> None:
    printed = printed_config(up.log.read_text())
    answer = continue_client({"config": printed})
    assert answer["error"] is None, answer["error"]  # Continue's own parser (@continuedev/config-yaml) loads it
    (model,) = answer["config"]["models"]
    (dest,) = answer["config"]["data"]
    key = up.key()
    assert (model["apiBase"], model["apiKey"]) == (f"{up.gateway}/v1", key)
    assert (dest["destination"], dest["apiKey"]) == (f"http://127.0.0.1:{up.ports['feedback']}{DATA_PATH}", key)

    cfg = load_config(StackPaths(up.state).config)  # the effective config `up` wrote: its job, Redis and template
    template = template_for(cfg, None)
    prompts = [template.render(f"def stock_{i}(a, b):\n    ", "\n") for i in range(10)]
    t0 = time.monotonic()
    done = continue_client({"config": printed, "completions": [{"prompt": p, "via": "continue"} for p in prompts]})
    took = time.monotonic() - t0
    got = done["completions"]
    assert [(c["status"], c.get("error")) for c in got] == [(200, None)] * len(prompts), got
    assert got[0]["sent"]["url"] == f"{up.gateway}/v1/completions"
    assert got[0]["sent"]["headers"]["Authorization"] == f"Bearer {key}"
    shown = [(p, c["text"]) for p, c in zip(prompts, got, strict=True) if c["text"].strip()]
    print(f"{len(prompts)} completions through Continue's request code in {took:.1f} s; {len(shown)} non-empty")
    assert any(len(c["chunks"]) > 1 for c in got), "no completion was streamed in more than one chunk"
    assert len(shown) >= 4, f"only {len(shown)} non-empty completions: {[c['text'] for c in got]}"

    accept, reject = outcome(*shown[0], True), outcome(*shown[1], False)
    fresh_0_1_0, direct = outcome(*shown[2], True), outcome(*shown[3], True)
    autocomplete = [{"name": "autocomplete", "data": d} for d in (accept, reject, accept)]
    first, second, again = continue_client({"config": printed, "events": autocomplete})["posts"]
    (old_schema, old_repeat) = continue_client(
        {
            "config": printed,
            "events": [{"name": "autocomplete", "data": d} for d in (fresh_0_1_0, accept)],
            "destination": {"schema": "0.1.0"},
        }
    )["posts"]
    (no_code,) = continue_client({"config": printed, "events": autocomplete[:1], "destination": {"level": "noCode"}})[
        "posts"
    ]
    tokens = {"model": model["model"], "provider": "openai", "promptTokens": 310, "generatedTokens": 12}
    (generated,) = continue_client(
        {"config": printed, "events": [{"name": "tokensGenerated", "data": tokens}], "destination": {"events": None}}
    )["posts"]
    (unknown,) = continue_client(
        {
            "config": printed,
            "events": [{"name": "autocomplete", "data": outcome(*shown[0], True), "rawSchema": "9.9.9"}],
        }
    )["posts"]
    submitted = httpx.post(
        f"http://127.0.0.1:{up.ports['feedback']}/api/training/submit",
        json=direct,
        headers={"Authorization": f"Bearer {key}"},
        timeout=30,
    )

    posts = {"accept": first, "reject": second, "repeat": again, "0.1.0": old_schema, "0.1.0 repeat": old_repeat}
    posts |= {"noCode": no_code, "tokensGenerated": generated, "schema 9.9.9": unknown}
    replies = {what: (p["status"], p["body"].get("status"), p["body"].get("reason")) for what, p in posts.items()}
    replies["direct upload"] = (submitted.status_code, submitted.json().get("status"), submitted.json().get("reason"))
    print("\n".join(f"{what:16} {reply}" for what, reply in replies.items()))
    assert replies == {
        "accept": (200, "accepted_for_training", None),
        "reject": (200, "accepted_for_training", None),
        "repeat": (200, "duplicate", "completion_id_seen"),
        "0.1.0": (200, "accepted_for_training", None),
        "0.1.0 repeat": (200, "duplicate", "completion_id_seen"),
        "noCode": (200, "rejected", "no_code"),
        "tokensGenerated": (200, "ignored", None),
        "schema 9.9.9": (200, "rejected", "unknown_schema"),
        "direct upload": (200, "accepted_for_training", None),
    }
    # Trained once: the samples stream was appended to exactly once per accepted outcome (entries-added counts what
    # the trainer has since acknowledged and deleted too); what is still in it is those samples, nothing else.
    written = {p["body"]["sample_id"]: d["completionId"] for p, d in ((first, accept), (second, reject))}
    written |= {old_schema["body"]["sample_id"]: fresh_0_1_0["completionId"]}
    written |= {submitted.json()["sample_id"]: direct["completionId"]}
    assert again["body"]["entry_id"] == old_repeat["body"]["entry_id"] == first["body"]["sample_id"]
    admin = redis.Redis.from_url(cfg.redis.url)
    try:
        stream = Keys(cfg.job).samples
        added = admin.xinfo_stream(stream)["entries-added"]
        left = {eid.decode(): orjson.loads(fields[b"data"]) for eid, fields in admin.xrange(stream)}
    finally:
        admin.close()
    print(f"samples written {added}, still unacknowledged {len(left)}")
    assert added == len(written) == 4, (added, written)
    assert {eid: s["event_id"] for eid, s in left.items()} == {eid: written[eid] for eid in left}
    assert all(s["tenant"] == "demo" for s in left.values())  # the key alone named the project
