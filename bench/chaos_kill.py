"""kill -9 each local component while `onlinerl simulate` drives the stack; measure recovery and audit the ledger.

What a user runs, nothing else: ``onlinerl up --state S`` (the supervisor restarts a dead child with backoff) and, per
component, one ``onlinerl simulate --duration D`` run. Once that run has made progress, the component's main process
gets SIGKILL (an OOM kill: no clean-up, its own children left behind). Per component it records:

- ``back_s``: kill -> a new process of that component answers its health check (vLLM: ``/v1/models``);
- the simulation's figures: requests, failed completions (and how many of them fell in the outage), uploads that
  needed retries, uploads never acknowledged, and whether the run reached its end;
- the ledger, after every run: each upload acknowledged with a 200 names its stream entry (``sample_id``,
  ``audit_id``, or for a ``duplicate`` the ``entry_id`` that counted); every such id must still be in the samples
  stream, in the audit stream, or in a kept checkpoint manifest's ``sample_ids`` (trained). ``lost`` counts the rest.

Usage: ``python bench/chaos_kill.py [--model tiny|smollm2] [--components vllm,gateway,...]``; figures go to
``bench/results/chaos_kill-<date>.json`` and a table on stdout (bench/RESULTS.md holds recorded runs).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import httpx
import redis
import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from onlinerl.dataplane import audit, samples  # noqa: E402
from onlinerl.keys import Keys  # noqa: E402
from onlinerl.procs import http_ok, wait_for  # noqa: E402

# component -> what its command line contains (vLLM's engine process execs vLLM, so match both spellings)
MARKERS: dict[str, tuple[str, ...]] = {
    "vllm": ("onlinerl_serving.engine", "vllm"),
    "gateway": ("onlinerl_serving.gateway",),
    "reloader": ("onlinerl_serving.reloader",),
    "feedback": ("onlinerl_feedback",),
    "trainer": ("onlinerl_trainer",),
    "rollout": ("onlinerl_rollout",),
    "valkey": ("valkey-server",),
}
ORDER = ["feedback", "gateway", "trainer", "reloader", "rollout", "vllm", "valkey"]
ONLINERL = [str(Path(sys.executable).parent / "onlinerl")]  # the console script, as a user runs it


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def children_of(pid: int) -> list[int]:
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            out += [int(p) for p in (task / "children").read_text().split()]
        except OSError:
            continue
    return out


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def running(pid: int) -> bool:
    """Alive and not a zombie waiting to be reaped."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def component_pid(up_pid: int, name: str) -> int | None:
    """The live main process of ``name`` among the supervisor's direct children (the first match wins, so the
    engine's own worker processes, which are grandchildren, are never picked)."""
    for pid in children_of(up_pid):
        line = cmdline(pid)
        if running(pid) and any(m in line for m in MARKERS[name]):
            if name == "vllm" and any(m in line for n, ms in MARKERS.items() if n != "vllm" for m in ms):
                continue  # e.g. a path containing "vllm" in another component's command line
            return pid
    return None


def health_urls(cfg: dict, local: dict[str, int]) -> dict[str, str]:
    engine = cfg["serving"]["engineUrl"].rstrip("/")
    return {
        "vllm": f"{engine}/v1/models",
        "gateway": f"http://127.0.0.1:{cfg['serving']['port']}/healthz",
        "reloader": f"http://127.0.0.1:{local['reloader']}/healthz",
        "feedback": f"http://127.0.0.1:{cfg['feedback']['port']}/healthz",
        "trainer": f"http://127.0.0.1:{cfg['trainer']['metricsPort']}/healthz",
        "rollout": f"http://127.0.0.1:{local['rollout']}/healthz",
    }


def healthy(name: str, urls: dict[str, str], state: Path) -> bool:
    """The component's own health check; valkey's is an authenticated PING with the CLI's (admin) URL."""
    if name != "valkey":
        return http_ok(urls[name], timeout=1.0)
    url = yaml.safe_load((state / "config.yaml").read_text())["redis"]["url"]
    r = redis.Redis.from_url(url, socket_connect_timeout=0.5, socket_timeout=1)
    try:
        return bool(r.ping())
    except redis.RedisError:
        return False
    finally:
        r.close()


DISCARD_SERIES = (
    "onlinerl_trainer_stale_samples_total",
    "onlinerl_trainer_invalid_samples_total",
    "onlinerl_trainer_dropped_samples_total",
)


def trainer_discards(metrics_url: str) -> dict[str, float]:
    """Samples the trainer acknowledged without training (stale, invalid, too long, already trained), non-zero only."""
    try:
        text = httpx.get(metrics_url, timeout=5).text
    except httpx.HTTPError as exc:
        return {"error": str(exc)}
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith(DISCARD_SERIES) and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            if float(value):
                out[name] = float(value)
    return out


# ---- the ledger: every acknowledged upload's entry is kept somewhere ----------------------------------------------


def acknowledged_ids(timelines: Iterable[Path]) -> list[str]:
    """Stream entry ids named by uploads answered 200 (from `onlinerl simulate`'s timeline)."""
    ids: list[str] = []
    for path in timelines:
        if not path.is_file():
            continue
        for line in path.read_text().splitlines():
            entry = json.loads(line)
            if entry.get("feedback_status") == 200:
                ids += entry.get("feedback_ids") or ["<200 without an entry id>"]
    return ids


def kept_ids(redis_url: str, job: str, checkpoint_dir: Path) -> dict[str, set[str]]:
    """Where an acknowledged entry may be now: still in a stream, or trained into a kept checkpoint."""
    r = redis.Redis.from_url(redis_url, socket_timeout=10, decode_responses=True)
    try:
        keys = Keys(job)
        streams = {
            "samples": {eid for eid, _ in samples.read_all(r, keys, count=10**7)},
            "audit": {eid for eid, _ in audit.read(r, keys, count=10**7)},
        }
    finally:
        r.close()
    trained: set[str] = set()
    for manifest in (checkpoint_dir / job).glob("v*/manifest.json"):
        trained |= set(json.loads(manifest.read_text()).get("sample_ids") or [])
    return {**streams, "trained": trained}


def ledger(ids: list[str], kept: dict[str, set[str]]) -> dict[str, int | list[str]]:
    everywhere = set().union(*kept.values())
    lost = sorted({i for i in ids if i not in everywhere})
    return {
        "acknowledged": len(ids),
        "in_samples": sum(i in kept["samples"] for i in ids),
        "in_audit": sum(i in kept["audit"] for i in ids),
        "trained": sum(i in kept["trained"] and i not in kept["samples"] for i in ids),
        "lost": len(lost),
        "lost_ids": lost[:20],
    }


# ---- one phase ---------------------------------------------------------------------------------------------------


@dataclass
class Phase:
    component: str
    old_pid: int = 0
    new_pid: int = 0
    back_s: float | None = None
    duration_s: float = 0.0
    requests: int = 0
    failed: int = 0
    failed_in_outage: int = 0
    ok_after_back: int = 0  # requests served after the component was back: the run did not just limp to its end
    uploads_ok: int = 0
    uploads_retried: int = 0
    uploads_not_acknowledged: int = 0
    ran_to_end: bool = False
    simulate_rc: int | None = None
    summary: str = ""  # simulate's own last lines
    trainer_discards: dict = field(default_factory=dict)  # the trainer's own counters (reset when it restarts)
    ledger: dict = field(default_factory=dict)
    note: str = ""


def timeline_lines(path: Path) -> int:
    try:
        with path.open("rb") as f:
            return sum(1 for _ in f)
    except OSError:
        return 0


def run_phase(args, state: Path, up: subprocess.Popen, urls: dict[str, str], name: str, seed: int) -> Phase:
    ph = Phase(name)
    timeline = state / f"timeline-{name}.jsonl"
    duration = args.vllm_duration if name == "vllm" else args.duration
    ph.duration_s = duration
    sim = subprocess.Popen(
        [
            *ONLINERL,
            "simulate",
            *("--state", str(state), "--requests", "1000000", "--duration", str(duration)),
            *("--concurrency", str(args.concurrency), "--seed", str(seed), "--timeline", str(timeline)),
            *("--reject-window", str(args.reject_window), "--max-tokens", str(args.max_tokens)),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=ROOT,
    )
    try:
        warm = max(90.0, duration * 0.6)  # the CLI's own start-up and the first requests, on a busy box
        wait_for(lambda: timeline_lines(timeline) >= args.warmup_lines, warm, 0.2, f"{name}: simulate warm-up")
    except TimeoutError as exc:
        sim.kill()
        ph.note = f"not killed: {exc} ({sim.communicate()[0][-300:]})"
        return ph
    pid = component_pid(up.pid, name)
    if pid is None:
        sim.kill()
        sim.communicate()
        ph.note = f"not killed: no running {name} under `onlinerl up` (pid {up.pid})"
        return ph
    ph.old_pid = pid
    killed_at = time.time()
    t0 = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    print(f"[chaos] kill -9 {name} (pid {pid})", flush=True)

    def back() -> bool:
        new = component_pid(up.pid, name)
        return new is not None and new != pid and healthy(name, urls, state)

    try:
        wait_for(back, args.back_timeout, 0.1, f"{name} to come back")
        ph.back_s = round(time.monotonic() - t0, 2)
        ph.new_pid = component_pid(up.pid, name) or 0
        print(f"[chaos] {name} back after {ph.back_s:.1f}s (pid {ph.new_pid})", flush=True)
    except TimeoutError as exc:
        ph.note = str(exc)
        print(f"[chaos] {name} NOT back: {exc}", flush=True)
    back_at = killed_at + (ph.back_s if ph.back_s is not None else args.back_timeout)
    try:
        out, _ = sim.communicate(timeout=duration + args.reject_window + 180)
    except subprocess.TimeoutExpired:
        sim.kill()
        out, _ = sim.communicate()
        ph.note += " simulate did not finish in time"
    ph.simulate_rc = sim.returncode
    m = re.search(r"^(\d+) requests, (\d+) failed", out or "", re.M)
    ph.ran_to_end = m is not None
    ph.summary = " | ".join((out or "").strip().splitlines()[-2:])
    entries = [json.loads(line) for line in timeline.read_text().splitlines()] if timeline.is_file() else []
    ph.requests = sum(1 for e in entries if "latency_ms" in e)
    ph.failed = sum(1 for e in entries if e.get("error") or (e.get("status") not in (200, None)))
    # a failed request is in the outage when it started (its end time minus its latency) before the component was back
    ph.failed_in_outage = sum(
        1
        for e in entries
        if (e.get("error") or e.get("status") not in (200, None))
        and killed_at - 1 <= e["t"] - e.get("latency_ms", 0) / 1000 <= back_at + 1
    )
    ph.ok_after_back = sum(
        1
        for e in entries
        if e.get("status") == 200 and not e.get("error") and e["t"] - e.get("latency_ms", 0) / 1000 > back_at
    )
    uploads = [e for e in entries if "feedback_status" in e]
    ph.uploads_ok = sum(e["feedback_status"] == 200 for e in uploads)
    ph.uploads_retried = sum((e.get("feedback_attempts") or 1) > 1 for e in uploads)
    ph.uploads_not_acknowledged = sum(e["feedback_status"] != 200 for e in uploads)
    if not ph.ran_to_end:
        ph.note += f" simulate output: {(out or '')[-500:]}"
    return ph


def write_config(path: Path, model: str, canary: bool) -> dict:
    from onlinerl.model import bootstrap_smollm2, default_cache_dir, make_tiny_model

    smol = bootstrap_smollm2()
    if model == "tiny":
        model_cfg = {
            "path": str(make_tiny_model(default_cache_dir() / "models" / "tiny-llama-2l", smol)),
            "fimTemplate": "plain",
            "maxModelLen": 1024,
        }
    else:
        model_cfg = {"path": str(smol)}
    cfg = {
        "job": "chaos",
        "model": model_cfg,
        "serving": {"port": free_port(), "engineUrl": f"http://127.0.0.1:{free_port()}"},
        "feedback": {"port": free_port()},
        "rollout": {"strategy": "canary" if canary else "direct"},
        "trainer": {
            "metricsPort": free_port(),
            "batchSize": 4,
            "microBatchSize": 4,
            "batchTimeoutSeconds": 5,
            "engine": "torch",
            "torchThreads": 1,
            # keep every version: the ledger finds a trained sample in its version's manifest (LoRA: small files)
            "checkpoint": {"everySteps": 1, "keep": 1000},
            "lora": {"lastLayers": 2},  # keeps the trainer from starving vLLM on two cores
            # the canary holds every user on v0 for minutes while the trainer publishes v1, v2 ...: with the default
            # (4) those samples are dropped as stale, XDELed with only a counter, and no ledger can follow them
            "algorithm": {"staleness": {"maxVersions": 1000}},
        },
    }
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return cfg


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--model",
        choices=["tiny", "smollm2"],
        default="smollm2",
        help="smollm2 (default): real suggestions, so users accept, reject and upload; the tiny random model's "
        "near-greedy output is whitespace that Continue would never display, so it uploads nothing",
    )
    p.add_argument("--max-tokens", type=int, default=16, help="simulate --max-tokens")
    p.add_argument("--components", default=",".join(ORDER), help=f"comma-separated, in order (from {ORDER})")
    p.add_argument("--state", type=Path, default=None, help="state directory (default: a fresh /tmp/orl-chaos-*)")
    p.add_argument("--duration", type=float, default=75.0, help="seconds of each simulate run")
    p.add_argument("--vllm-duration", type=float, default=240.0, help="seconds of the simulate run that kills vLLM")
    p.add_argument("--concurrency", type=int, default=2)
    p.add_argument("--reject-window", type=float, default=10.0)
    p.add_argument("--warmup-lines", type=int, default=3, help="timeline lines before the kill")
    p.add_argument("--back-timeout", type=float, default=300.0)
    p.add_argument("--direct", action="store_true", help="rollout.strategy direct (no rollout controller)")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    names = [n for n in args.components.split(",") if n]
    unknown = [n for n in names if n not in MARKERS]
    if unknown:
        p.error(f"--components: unknown: {unknown} (choose from {ORDER})")
    state = args.state or Path(tempfile.mkdtemp(prefix="orl-chaos-", dir="/tmp"))
    state.mkdir(parents=True, exist_ok=True)
    cfg_path = state.parent / f"{state.name}-config.yaml"
    cfg = write_config(cfg_path, args.model, canary=not args.direct)
    if args.direct and "rollout" in names:
        names.remove("rollout")
    local = {"redis": free_port(), "reloader": free_port(), "rollout": free_port()}  # another stack may hold 16379
    urls = health_urls(cfg, local)
    started = datetime.now(UTC)
    up_log = (state.parent / f"{state.name}-up.log").open("w")
    up = subprocess.Popen(
        [*ONLINERL, "--config", str(cfg_path), "up", "--state", str(state)]
        + [f"--{name}-port={port}" for name, port in local.items()],
        stdout=up_log,
        stderr=subprocess.STDOUT,
        cwd=ROOT,
        start_new_session=True,
    )
    phases: list[Phase] = []
    try:
        t0 = time.monotonic()
        wait_for(
            lambda: "onlinerl is up" in Path(up_log.name).read_text() or up.poll() is not None,
            900,
            0.5,
            "onlinerl up",
        )
        if up.poll() is not None:
            print(Path(up_log.name).read_text()[-3000:], file=sys.stderr)
            return 1
        up_s = time.monotonic() - t0
        print(f"[chaos] stack up in {up_s:.0f}s (state {state})", flush=True)
        eff = yaml.safe_load((state / "config.yaml").read_text())
        for i, name in enumerate(names):
            ph = run_phase(args, state, up, urls, name, seed=i)
            try:
                kept = kept_ids(eff["redis"]["url"], eff["job"], Path(eff["storage"]["checkpointDir"]))
                ph.ledger = ledger(acknowledged_ids(state.glob("timeline-*.jsonl")), kept)
            except redis.RedisError as exc:
                ph.note += f" ledger not read: {exc}"
            ph.trainer_discards = trainer_discards(urls["trainer"].rsplit("/", 1)[0] + "/metrics")
            phases.append(ph)
            print(f"[chaos] {json.dumps(asdict(ph))}", flush=True)
            if up.poll() is not None:
                print(f"[chaos] `onlinerl up` exited with {up.returncode}", flush=True)
                break
        restarts = [ln for ln in Path(up_log.name).read_text().splitlines() if "restart" in ln or "healthy again" in ln]
    finally:
        if up.poll() is None:
            up.send_signal(signal.SIGTERM)
            try:
                up.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(up.pid, signal.SIGKILL)
        up_log.close()
    result = {
        "date": started.isoformat(timespec="seconds"),
        "machine": f"{os.cpu_count()} CPU cores, load average at start {os.getloadavg()[0]:.1f}",
        "command": " ".join(["python bench/chaos_kill.py", *sys.argv[1:]]),
        "model": args.model,
        "strategy": "direct" if args.direct else "canary",
        "state": str(state),
        "up_s": round(up_s, 1),
        "up_exit_code": up.returncode,
        "supervisor_lines": restarts[:40],
        "phases": [asdict(ph) for ph in phases],
    }
    out = args.out or ROOT / "bench" / "results" / f"chaos_kill-{started:%Y-%m-%d}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(table(phases))
    print(f"figures: {out}")
    ok = all(ph.back_s is not None and ph.ran_to_end and ph.ledger.get("lost") == 0 for ph in phases)
    return 0 if ok and len(phases) == len(names) else 1


def table(phases: list[Phase]) -> str:
    rows = [
        "| component | back after s | requests | failed (in outage) | ok after back | uploads ok | retried | "
        "not acked | ran to end | acked ids (cumulative) | lost |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for ph in phases:
        rows.append(
            f"| {ph.component} | {ph.back_s if ph.back_s is not None else 'NOT BACK'} | {ph.requests} | "
            f"{ph.failed} ({ph.failed_in_outage}) | {ph.ok_after_back} | {ph.uploads_ok} | {ph.uploads_retried} | "
            f"{ph.uploads_not_acknowledged} | {'yes' if ph.ran_to_end else 'NO'} | {ph.ledger.get('acknowledged')} | "
            f"{ph.ledger.get('lost')} |"
        )
    return "\n".join(rows)


if __name__ == "__main__":
    sys.exit(main())
