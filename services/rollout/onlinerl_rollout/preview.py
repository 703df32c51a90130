"""The eval gate's preview in full-weight mode: vLLM holds ONE version, so the gate evaluates the candidate by having
every reloader swap it in for eval requests only (the gateway holds user requests meanwhile), then lets the verdict
decide what vLLM holds next.

The controller drives it through the policy table (``preview`` vN, ``preview_until``: ``policy.start_preview``); the
reloaders perform it and record vN ``previewing`` in the versions table once the gateway lets eval requests through.
The verdict ends it inside the same script that records it (``decisions.apply``): pass -> vN becomes the candidate
with all traffic (the weights stay, no second swap); fail -> stable again (the reloader swaps back). Errors and
timeouts end it with ``policy.end_preview``. The deadline is in the table, so a reloader restores stable by itself
even if the controller dies mid-preview: users are held for at most ``rollout.gate.previewTimeoutSeconds``.

``step`` is the decision, pure; ``Preview`` is the loop around it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import redis

from onlinerl.dataplane import policy
from onlinerl.keys import Keys

Step = Literal["wait", "ready", "failed", "timeout"]


class PreviewError(RuntimeError):
    """The preview did not (or no longer) hold the candidate for the eval: the gate retries later."""


def step(version_state: str | None, now: float, until: float) -> Step:
    """What the controller does while it waits for the reloaders (pure): ``version_state`` is the candidate's
    job-wide state in the versions table, ``now``/``until`` wall-clock seconds."""
    if version_state == "previewing":
        return "ready" if now < until else "timeout"
    if version_state == "failed":
        return "failed"  # vLLM cannot load it: waiting longer would only hold users
    return "wait" if now < until else "timeout"


@dataclass
class Preview:
    """One preview of ``version``; ``enter`` is handed to the evaluator (``EvalRequest.enter_candidate``)."""

    r: redis.Redis
    keys: Keys
    version: int
    timeout: float
    read_state: Callable[[], str | None]
    clock: Callable[[], float] = time.time  # wall clock: the reloaders compare preview_until with theirs
    poll_seconds: float = 0.2
    until: float = 0.0
    started: bool = False

    def enter(self) -> None:
        """Ask for the preview and return once vLLM holds the candidate for eval requests; PreviewError if not in
        place before the deadline (or vLLM cannot load it)."""
        self.until = self.clock() + self.timeout
        policy.start_preview(self.r, self.keys, self.version, self.until)
        self.started = True
        while (s := step(self.read_state(), self.clock(), self.until)) != "ready":
            if s == "failed":
                raise PreviewError(f"v{self.version} could not be loaded for the gate's preview (see the reloader)")
            if s == "timeout":
                raise PreviewError(
                    f"v{self.version} was not in place for the gate's preview within {self.timeout:.0f}s "
                    "(rollout.gate.previewTimeoutSeconds)"
                )
            time.sleep(self.poll_seconds)

    def check(self) -> None:
        """After the eval: PreviewError if the deadline passed meanwhile (the reloaders may have swapped stable back
        under it, so its figures are not the candidate's alone)."""
        if self.started and self.clock() >= self.until:
            raise PreviewError(
                f"the gate's preview of v{self.version} reached its deadline ({self.timeout:.0f}s, "
                "rollout.gate.previewTimeoutSeconds) before its eval finished"
            )

    def end(self) -> None:
        """Give vLLM back to stable (errors, timeouts, a verdict that could not be recorded)."""
        if self.started:
            policy.end_preview(self.r, self.keys)
            self.started = False
