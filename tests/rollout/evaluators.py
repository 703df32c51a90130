"""An evaluator plugged into ``python -m onlinerl.rollout --evaluator tests.rollout.evaluators:plain_code``."""

from __future__ import annotations

from onlinerl.rollout.controller import EvalRequest
from onlinerl.rollout.gate import EvalRecord, GateInput


def plain_code(req: EvalRequest) -> GateInput:
    recs = [EvalRecord(f"return items[{i}]", i % 3 == 0) for i in range(req.samples)]
    return GateInput(req.candidate, req.stable, recs, recs)
