"""The eval gate's evaluator: ``onlinerl eval``'s path (gateway, pinned version, Continue's request) as a callable.

Plugged into the rollout controller with ``--evaluator onlinerl_rollout.gate_eval:evaluate``. It reads the job config
(``$ONLINERL_CONFIG``), the held-out split (``$ONLINERL_EVAL_DATA``), the gateway (``$ONLINERL_GATEWAY_URL``,
default the local one) and uses the first eval (or admin) key of the keys file.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

from onlinerl.auth import key_with_role
from onlinerl.config import load_config
from onlinerl.data.builder import read_jsonl
from onlinerl.loop.continue_client import ContinueClient
from onlinerl.loop.evaluate import run_version
from onlinerl.loop.template import template_for
from onlinerl.loop.user_model import decide
from onlinerl_rollout.controller import EvalRequest
from onlinerl_rollout.gate import GateInput

DEFAULT_EVAL_DATA = ".onlinerl/data/test.jsonl"


def evaluate(req: EvalRequest) -> GateInput:
    cfg = load_config()
    samples = read_jsonl(Path(os.environ.get("ONLINERL_EVAL_DATA", DEFAULT_EVAL_DATA)))[: req.samples]
    key, tenant = key_with_role(cfg.auth.api_keys_file)  # pinning needs an eval (or admin) key
    template = template_for(cfg, None)
    gateway = os.environ.get("ONLINERL_GATEWAY_URL") or f"http://127.0.0.1:{cfg.serving.port}"
    api_base = f"{gateway.rstrip('/')}/v1"

    def factory(uid: int) -> ContinueClient:
        return ContinueClient(
            api_base, "", key, tenant, cfg.model.served_name, template, max_tokens=48, unique_id=f"gate-{uid}"
        )

    records = []
    for version in (req.candidate, req.stable):
        run = asyncio.run(run_version(samples, factory, version, concurrency=2))
        by_id = {s.id: s for s in samples}
        records += [
            {"version": version, "shown_text": r.shown, "accepted": decide(r.shown, by_id[r.sample_id].middle)}
            for r in run.records
            if not r.failed
        ]
    return GateInput.from_records(req.candidate, req.stable, records)
