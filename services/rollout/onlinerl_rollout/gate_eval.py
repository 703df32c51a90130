"""The eval gate's evaluator: ``onlinerl eval``'s path (gateway, pinned version, Continue's request) as a callable.

Plugged into the rollout controller with ``--evaluator onlinerl_rollout.gate_eval:evaluate``. It reads the job config
(``$ONLINERL_CONFIG``), the held-out split (``$ONLINERL_EVAL_DATA``), the gateway (``$ONLINERL_GATEWAY_URL``,
default the local one) and uses the first eval (or admin) key of the keys file.

A project's own policy line (issue 39: ``req.line``) is gated on that project's held-out samples where it has them
(``projects/<project>/<split file>`` next to the shared split, e.g. ``.onlinerl/data/projects/acme/test.jsonl``,
written by ``onlinerl data build --out .onlinerl/data/projects/acme`` from the project's code), else on the shared
split, and through an eval key of that project: the gateway routes a key to its project's line, so a pinned version
is that line's. The shared line is gated through an eval key of a tenant without a line of its own.

Stable first, while it serves users (once per version: a promoted candidate's own gate records serve as stable's, and
a stable's records serve every candidate gated against it); then
``req.enter_candidate()`` (full weights: the candidate's preview, user
requests wait at the gateway) and the candidate, with more concurrency since vLLM serves nothing else meanwhile.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable
from pathlib import Path

from onlinerl.auth import key_with_role
from onlinerl.config import load_config
from onlinerl.data.builder import read_jsonl
from onlinerl.lines import PROJECTS_DIR
from onlinerl.loop.continue_client import ContinueClient
from onlinerl.loop.evaluate import run_version
from onlinerl.loop.template import template_for
from onlinerl.loop.user_model import decide
from onlinerl_rollout.controller import EvalRequest
from onlinerl_rollout.gate import EvalRecord, GateInput

log = logging.getLogger("onlinerl_rollout")
DEFAULT_EVAL_DATA = ".onlinerl/data/test.jsonl"
PREVIEW_CONCURRENCY = 4  # the candidate's run: in full-weight mode users are held, so vLLM's batch is the eval's

# Gate records per (job, line, gateway, version, eval data, sample ids), from a run with no failed request. The gate's
# requests use Continue's near-greedy temperature, so a version answers the same samples the same way whether it is
# gated as the candidate or compared as stable: a stable is evaluated at most once, and not at all when it was
# promoted from a candidate this process gated. On 2 CPU cores next to user traffic each half of a gate took ~5
# minutes (run 12: every gate after a promotion re-asked the new stable what its own gate had just asked it). Only
# the entries of the current stable and candidate are kept. A candidate gated again (after an error) is asked
# again: full weights must preview it.
_runs: dict[tuple[str, str, str, int, str, tuple[str, ...]], list[EvalRecord]] = {}


def held_out(data: Path, line: str) -> tuple[Path, bool]:
    """The held-out split a line is gated on, and whether it is the project's own: ``projects/<line>/<name>`` next
    to the shared split ``data`` when that file exists, else ``data`` itself (pure, but for the existence check)."""
    if line:
        own = data.parent / PROJECTS_DIR / line / data.name
        if own.is_file():
            return own, True
    return data, False


def eval_key(keys_file: str, line: str, has_own_line: Callable[[str], bool]) -> tuple[str, str]:
    """``(key, tenant)`` to pin versions of ``line`` with: an eval (or admin) key of that project, or for the shared
    line one of a tenant served the shared policy (a key of a project with its own line reaches that line)."""
    if line:
        return key_with_role(keys_file, tenant_ok=lambda t: t == line, wanted=f"project {line!r}")
    return key_with_role(
        keys_file, tenant_ok=lambda t: not has_own_line(t), wanted="a tenant without an adapter line of its own"
    )


def evaluate(req: EvalRequest) -> GateInput:
    cfg = load_config()
    data, own = held_out(Path(os.environ.get("ONLINERL_EVAL_DATA", DEFAULT_EVAL_DATA)), req.line)
    samples = read_jsonl(data)[: req.samples]
    key, tenant = eval_key(cfg.auth.api_keys_file, req.line, cfg.projects.has_own_line)  # pinning: eval or admin
    if req.line:
        log.info(
            "gate of project %s's v%d vs %sv%d on %s held-out samples (%s), as tenant %s",
            req.line,
            req.candidate,
            "" if req.baseline_line else "the shared policy's ",
            req.stable,
            "its own" if own else "the shared",
            data,
            tenant,
        )
    template = template_for(cfg, None)
    gateway = os.environ.get("ONLINERL_GATEWAY_URL") or f"http://127.0.0.1:{cfg.serving.port}"
    api_base = f"{gateway.rstrip('/')}/v1"

    def factory(line: str) -> Callable[[int], ContinueClient]:
        def make(uid: int) -> ContinueClient:
            return ContinueClient(
                api_base,
                "",
                key,
                tenant,
                cfg.model.served_name,
                template,
                max_tokens=48,
                unique_id=f"gate-{uid}",
                pin_line=line,  # a project line's versions: pinned on that line (X-OnlineRL-Line)
            )

        return make

    ids = tuple(s.id for s in samples)
    by_id = {s.id: s for s in samples}
    sides: dict[bool, list[EvalRecord]] = {}
    for candidate, version, line in ((False, req.stable, req.baseline_line), (True, req.candidate, req.line)):
        run_key = (req.job, line, gateway, version, str(data), ids)
        if not candidate and run_key in _runs:
            sides[candidate] = _runs[run_key]
            continue
        if candidate:
            req.enter_candidate()
        concurrency = PREVIEW_CONCURRENCY if candidate else 2
        run = asyncio.run(run_version(samples, factory(line), version, concurrency=concurrency))
        if run.records and all(r.failed for r in run.records):
            raise RuntimeError(_nothing_served(version, len(run.records), cfg.serving.weights_mode))
        got = [EvalRecord(r.shown, decide(r.shown, by_id[r.sample_id].middle)) for r in run.records if not r.failed]
        if len(got) == len(samples) and (req.stable, req.baseline_line) != (req.candidate, req.line):
            _runs[run_key] = got
        sides[candidate] = got
    keep = {(req.baseline_line, req.stable), (req.line, req.candidate)}
    for old in [k for k in _runs if (k[1], k[3]) not in keep and (k[1] in (req.line, req.baseline_line))]:
        del _runs[old]  # only each line's current stable's and candidate's runs can be asked for again
    # by side, not by version number: a project line's v3 may be gated against the shared line's v3
    return GateInput(req.candidate, req.stable, tuple(sides[True]), tuple(sides[False]))


def _nothing_served(version: int, n: int, weights_mode: str) -> str:
    """Why a gate could not run, in words a person can act on (it becomes the gate_fail reason after retries)."""
    why = f"none of {n} eval requests pinned to v{version} was served"
    if weights_mode == "full":
        return (
            f"{why}: under serving.weightsMode full the gateway serves only the version vLLM holds (the candidate "
            "during the gate's preview); see `onlinerl status` (versions: vN:previewing) and the reloader's log"
        )
    return f"{why} (is it loaded? see `onlinerl status` and the reloader's last error)"
