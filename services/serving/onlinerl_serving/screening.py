"""The gateway's secret screening (``privacy.secretScreening``, issue 38): before a rollout is recorded.

``audit`` (default): every request is served as usual; a rollout whose prompt or completion holds a credential
(onlinerl/secret_scan.py) is recorded *redacted*: no prompt, completion, token ids or log-probs, only each finding's
field, kind and character span (``RolloutRecord.secrets``). Its record still lives under the prompt's digest, so the
feedback for it finds it, rates it once and audits it ``secret_detected``; nothing of it can be trained (no tokens).
``block``: as audit, and a prompt holding a credential is refused with 400 ``secret_in_prompt`` before it reaches the
model (nothing recorded). A completion is screened after the model wrote it: under ``block`` it is still delivered
(the stream's text is already out by then) and recorded redacted, as under audit. ``off``: no screening.

Findings are counted by kind and field (``onlinerl_serving_secret_findings_total``); no log line and no reply names
the matched text, only kinds and positions.
"""

from __future__ import annotations

import asyncio

from prometheus_client import CollectorRegistry, Counter

from onlinerl.schemas import RolloutRecord, SecretFindingRecord
from onlinerl.secret_scan import FieldFinding, Mode, describe, scan_fields
from onlinerl_serving.errors import ApiError

SECRET_IN_PROMPT = "secret_in_prompt"


def redacted(record: RolloutRecord, findings: list[FieldFinding]) -> RolloutRecord:
    """Pure: ``record`` without its text and tokens, carrying where each finding was. Without findings: unchanged."""
    if not findings:
        return record
    return record.model_copy(
        update={
            "prompt": "",
            "prompt_token_ids": [],
            "completion": "",
            "completion_token_ids": [],
            "behaviour_logprobs": [],
            "token_offsets": [],
            "secrets": [SecretFindingRecord(field=f.field, kind=f.kind, start=f.start, end=f.end) for f in findings],
        }
    )


class SecretScreen:
    """One gateway's screening: the mode and the findings counter."""

    def __init__(self, mode: Mode, registry: CollectorRegistry | None = None) -> None:
        self.mode = mode
        self.findings = Counter(
            "onlinerl_serving_secret_findings_total",
            "Credentials found in prompts and completions (privacy.secretScreening), by rule and field.",
            ["kind", "field"],
            registry=registry,
        )

    def _count(self, findings: list[FieldFinding]) -> None:
        for f in findings:
            self.findings.labels(f.kind, f.field).inc()

    def check_prompt(self, prompt: str) -> None:
        """``block`` only: refuse a prompt holding a credential (400, naming each finding's kind and position)."""
        if self.mode != "block":
            return
        findings = scan_fields([("prompt", prompt)])
        if findings:
            self._count(findings)
            raise ApiError(
                400,
                f"the prompt holds what looks like a credential ({describe(findings)}); remove it from the file or "
                "context sent for completion (privacy.secretScreening: block refuses such prompts; nothing was "
                "recorded)",
                code=SECRET_IN_PROMPT,
                param="prompt",
            )

    def prescan(self, prompt: str) -> asyncio.Future[list[FieldFinding]] | None:
        """``audit``: the prompt's findings, computed while the engine generates rather than after it.

        The prompt scan grows with the prompt (Continue sends up to a few thousand characters) and was paid after
        the completion, on the user's path. As a task that first yields once, it runs after the request has gone to
        vLLM, during the generation; :meth:`screen` then scans only the completion. ``block`` needs none: a prompt
        with a finding was refused (:meth:`check_prompt`); ``off`` scans nothing."""
        if self.mode != "audit":
            return None
        return asyncio.ensure_future(_scan_prompt_soon(prompt))

    def screen(self, record: RolloutRecord, prompt_findings: list[FieldFinding] | None = None) -> RolloutRecord:
        """The record to store: redacted when its prompt or completion holds a credential (audit, block).
        ``prompt_findings``: the prompt's, from :meth:`prescan` (else scanned here)."""
        if self.mode == "off":
            return record
        if prompt_findings is None:
            prompt_findings = [] if self.mode == "block" else scan_fields([("prompt", record.prompt)])
        findings = prompt_findings + scan_fields([("completion", record.completion)])
        self._count(findings)
        return redacted(record, findings)


async def _scan_prompt_soon(prompt: str) -> list[FieldFinding]:
    await asyncio.sleep(0)  # the caller's request to the engine goes out first
    return scan_fields([("prompt", prompt)])
