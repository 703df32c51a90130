"""An evaluator plugged into ``python -m onlinerl_rollout --evaluator tests.rollout.evaluators:plain_code``."""

from __future__ import annotations

from onlinerl_rollout.controller import EvalRequest
from onlinerl_rollout.gate import EvalRecord, GateInput


def plain_code(req: EvalRequest) -> GateInput:
    recs = [EvalRecord(f"return items[{i}]", i % 3 == 0) for i in range(req.samples)]
    return GateInput(req.candidate, req.stable, recs, recs)


def scripted_user(req: EvalRequest) -> GateInput:
    """The gate's evaluator in tests/rollout/test_e2e_real.py: the scripted user's own judgement, through the real
    gateway. ``req.samples`` Continue requests pinned to each version (``X-OnlineRL-Version``, an eval-role key), each
    accepted with the version's probability in ``$ONLINERL_TEST_ACCEPT`` (JSON ``{"version": p}``), seeded. Stable
    first, then ``req.enter_candidate()`` (full weights: the candidate's preview), then the candidate."""
    import asyncio
    import json
    import os
    import random

    import httpx

    from onlinerl.fim import get_template
    from onlinerl.loop.continue_client import ContinueClient

    accept = {int(v): float(p) for v, p in json.loads(os.environ["ONLINERL_TEST_ACCEPT"]).items()}
    template = get_template("qwen")
    client = ContinueClient(
        f"{os.environ['ONLINERL_TEST_GATEWAY_URL']}/v1", "", os.environ["ONLINERL_TEST_EVAL_KEY"], "", "m", template,
        max_tokens=8,
    )  # fmt: skip
    rng = random.Random(req.candidate)

    async def run() -> list[dict]:
        out = []
        async with httpx.AsyncClient(timeout=60) as http:
            for version in (req.stable, req.candidate):
                if version == req.candidate:
                    await asyncio.to_thread(req.enter_candidate)
                for i in range(req.samples):
                    res = await client.complete(http, template.render(f"x{i} = compute(", ")\n"), pin_version=version)
                    if res.failed:
                        raise RuntimeError(f"eval request to v{version} failed: {res.status} {res.error}")
                    shown = res.text.rstrip()
                    ok = bool(shown.strip()) and rng.random() < accept[version]
                    out.append({"version": version, "shown_text": shown, "accepted": ok})
        return out

    return GateInput.from_records(req.candidate, req.stable, asyncio.run(run()))
