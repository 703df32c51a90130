"""Several worker processes on one port (feedback.workers): every event lands once, and /metrics on any worker
reports the whole pod (Prometheus multiprocess mode), not the share of whichever worker answered the scrape."""

from __future__ import annotations

from pathlib import Path

import httpx
import redis

from onlinerl.fim import get_template
from onlinerl.procs import wait_for

from .conftest import event, headers, start_feedback, stream_entries
from .rollouts import make_rollout, record_rollout

PROMPT = get_template("qwen").render("def add(a, b):\n", "\n\nprint(add(1, 2))\n")
COMPLETION = "    return a + b"
EVENTS = 40


def _children(pid: int) -> list[int]:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out


def _sample(text: str, prefix: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(prefix))


def test_two_workers_share_the_port_and_report_pod_wide_metrics(empty_valkey, tmp_path, keys, tokenizer):
    metrics_dir = tmp_path / "prom"
    metrics_dir.mkdir()
    (metrics_dir / "counter_999999.db").write_bytes(b"stale")  # a previous run's file: must not be summed in
    r = redis.Redis.from_url(empty_valkey.url)
    for _ in range(EVENTS):  # one served rollout per event: a rollout is trained at most once
        record_rollout(r, keys, make_rollout(tokenizer, tenant="acme", prompt=PROMPT, completion=COMPLETION))
    srv = start_feedback(tmp_path, empty_valkey.url, env={"PROMETHEUS_MULTIPROC_DIR": str(metrics_dir)}, workers=2)
    try:
        assert len(_children(srv.child.pid)) >= 2  # uvicorn's supervisor and its workers
        bodies = [event(PROMPT, COMPLETION, accepted=i % 2 == 0) for i in range(EVENTS)]
        for body in bodies:  # a fresh connection each: the kernel spreads them over the workers' accept()
            with httpx.Client(timeout=10) as http:
                resp = http.post(srv.url + "/api/training/submit", json=body, headers=headers())
            assert resp.status_code == 200 and resp.json()["status"] == "accepted_for_training", resp.text
        assert sorted(e["event_id"] for e in stream_entries(r, keys.samples)) == sorted(
            b["completionId"] for b in bodies
        )
        assert not (metrics_dir / "counter_999999.db").exists()
        for _ in range(6):  # whichever worker answers, the figures are the pod's
            with httpx.Client(timeout=10) as http:
                text = http.get(srv.url + "/metrics").text
            assert _sample(text, 'onlinerl_feedback_events_total{outcome="accepted_for_training",tenant="acme"}') == 40
            assert _sample(text, 'onlinerl_feedback_responses_total{code="200"}') == EVENTS
            assert _sample(text, "onlinerl_feedback_request_duration_seconds_count") == EVENTS
            accepted = 'onlinerl_feedback_accepted_total{arm="stable",line="shared",version="0"}'
            assert _sample(text, accepted) == EVENTS / 2

        def backlog() -> float:  # each worker refreshes it every 0.25 s; the pod shows the latest value written
            with httpx.Client(timeout=10) as http:
                return _sample(http.get(srv.url + "/metrics").text, "onlinerl_feedback_backlog ")

        wait_for(lambda: backlog() == EVENTS, timeout=10, what="the backlog gauge to reach the stream length")
    finally:
        srv.stop()
        r.close()
