"""The rollout controller: turns loaded versions into gated candidates, and candidates into promotions or rollbacks.

One ``tick`` reads the live policy table and acts on it (strategies ``canary`` and ``bluegreen``; under ``direct``
the reloader makes each version stable itself):

* no candidate: the newest loaded version above stable that the rollout has not judged goes through the eval gate
  (an injected ``Evaluator``); pass -> it becomes the candidate with ``rollout.canaryShare`` of users; fail -> the
  version is recorded ``gate_failed`` and the trainer keeps going (the next version gets its own chance);
* a candidate: counters since it started are compared with ``decision.decide_canary``; promote / rollback / hold
  at each look, applied and recorded atomically (``store.RolloutStore.apply``); at the last look a within-noise
  candidate with no sign of regression is kept (``rollout.onInconclusive``). A decided version is final.

``bluegreen`` (full-weight serving: one version at a time) takes versions the reloader recorded ``ready``
(switchable) too. It gates only once stable's own arm has ``minSamples`` shown (the baseline the watch compares
with), and a pass switches everyone to the candidate (``canary_share`` 1: the reloader swaps vLLM's weights, the
gateway labels the traffic ``candidate``) with stable's counters snapshotted in the same script. The watch is
``decision.decide_watch`` against that snapshot; rollback switches everyone back. Which comparison applies is read
from the table, not the config: a candidate holding the whole traffic has no live stable arm to compare with.

Full-weight serving holds one version, so the gate cannot reach a ``ready`` candidate through the gateway as it is:
the evaluator evaluates stable first (while it serves), then calls ``EvalRequest.enter_candidate``, which starts the
*preview* (``preview.Preview``: every reloader swaps the candidate in for eval requests only, users wait at the
gateway) and returns once it is in place. The verdict's own script ends it: pass -> the candidate with all traffic on
the weights already loaded; fail -> stable swapped back. A preview that is not in place, or outlives
``rollout.gate.previewTimeoutSeconds``, counts as an evaluator error (retried, then ``gate_fail`` with the reason).

``pinned`` stops all verdicts (traffic is pinned, the canary learns nothing). ``paused`` stops promotion and new
candidates, but not rollbacks: pausing must never keep a worse policy in front of users. ``hold`` (a human's rollback or
pin, until ``onlinerl policy resume``) does what ``paused`` does: no version is gated, no canary or blue/green switch
starts, nothing is promoted (a canary the hold found running can still be rolled back). A human's rollback is never
undone by the next gate.

Every decision goes to the ``decisions`` stream, the Prometheus counter, and each ``on_decision`` callback (the
operator plugs Kubernetes Events and status conditions in here, or tails the stream with ``decisions_after``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace

import redis

from onlinerl.arms import CANDIDATE, STABLE
from onlinerl.config import RolloutConfig
from onlinerl.dataplane import holds
from onlinerl.dataplane.lines import LineView
from onlinerl.keys import Keys
from onlinerl.rollout.records import ArmStats, DecisionRecord, RolloutState
from onlinerl.rollout.store import RolloutStore
from onlinerl.schemas import PolicyTable
from onlinerl_rollout.decision import (
    DecisionRules,
    DriftGuard,
    Verdict,
    decide_canary,
    decide_watch,
    guardrail_breaches,
    look_index,
)
from onlinerl_rollout.few_users import FewUsers, users_in
from onlinerl_rollout.gate import GateInput, GateResult, GateThresholds, evaluate_gate
from onlinerl_rollout.metrics import RolloutMetrics
from onlinerl_rollout.per_user import robust_verdict
from onlinerl_rollout.preview import Preview

log = logging.getLogger("onlinerl_rollout")
GATE_HOLDER = "gate"  # the gate's own field in the holds hash (onlinerl/dataplane/holds.py)
GATE_HOLD_SECONDS = 1800.0  # expires by itself if the controller dies mid-eval


def _in_place() -> None:
    """The candidate is servable as it is (LoRA, or a version already loaded): nothing to do before its eval."""


@dataclass(frozen=True)
class EvalRequest:
    """What the gate asks the evaluator for: ``samples`` eval requests to each of the two versions.

    ``enter_candidate``: call it after stable's requests and before the candidate's. In full-weight mode it puts the
    candidate into preview and returns once vLLM holds it (users wait meanwhile: keep the candidate's run short); it
    raises ``preview.PreviewError`` if that does not happen in time.

    ``line``: the policy line the candidate belongs to ('' = the shared policy, else the project whose own adapter line
    it is: its held-out samples where it has them, through one of its eval keys; gate_eval.py). ``stable_line``: the
    line ``stable`` is a version of (None: ``line``). A project line that has promoted nothing yet (its stable is 0)
    is served the shared policy (the gateway routes such a project on the shared line), so its candidate is gated
    against the shared line's stable: what that project is served now."""

    job: str
    candidate: int
    stable: int
    samples: int
    enter_candidate: Callable[[], None] = field(default=_in_place, compare=False, repr=False)
    line: str = ""
    stable_line: str | None = None

    @property
    def baseline_line(self) -> str:
        """The line ``stable`` is a version of."""
        return self.line if self.stable_line is None else self.stable_line


Evaluator = Callable[[EvalRequest], GateInput]
DecisionHook = Callable[[DecisionRecord], None]


class RolloutController:
    """The rollout of one policy line: ``line`` '' is the shared policy, else a project's own adapter line (issue 39:
    the same machinery on that line's keys, ``Keys.for_project``; lines.py ticks every line)."""

    def __init__(
        self,
        r: redis.Redis,
        job: str,
        cfg: RolloutConfig,
        evaluator: Evaluator | None = None,
        *,
        clock: Callable[[], float] = time.time,
        on_decision: Iterable[DecisionHook] = (),
        metrics: RolloutMetrics | None = None,
        gate_attempts: int = 3,
        gate_retry_seconds: float = 2.0,
        line: str = "",
    ) -> None:
        if cfg.controlled and cfg.gate.enabled and evaluator is None:
            raise ValueError("rollout.gate.enabled needs an evaluator (or set rollout.gate.enabled: false)")
        self.r = r
        self.line = line
        self.keys = Keys(job).for_line(line)
        self.store = RolloutStore(r, self.keys)
        self.cfg = cfg
        self.rules = DecisionRules.from_config(cfg)
        self.evaluator = evaluator
        self.clock = clock
        self.on_decision = list(on_decision)
        self.metrics = metrics or RolloutMetrics()
        self.gate_attempts = gate_attempts
        self.gate_retry_seconds = gate_retry_seconds
        self._gate_errors: dict[int, int] = {}
        self._gate_retry_at: dict[int, float] = {}
        self._gate_error_text: dict[int, str] = {}
        self._paused_noted: set[tuple[int, int]] = set()
        self.last_tick_ok: float | None = None  # monotonic time of the last tick that reached Redis
        self.evaluating: int | None = None  # the version under eval (an eval can take minutes: still healthy)
        self.preview: Preview | None = None  # full weights: the preview the last gate started (ended by its verdict)
        self.doing: str = ""  # this tick's activity for `onlinerl status` (store.say), "" when idle
        self._said: str | None = None  # the activity last written: written again only on change
        self.gate_baseline = ""  # the last gate's baseline when it was not this line's stable (else "")

    @property
    def said(self) -> str | None:
        """The activity line this controller last wrote or found stored (None: it has not looked yet)."""
        return self._said

    # --- the loop ----------------------------------------------------------------------------------------------
    def run(self, stop: threading.Event, interval: float = 5.0) -> None:
        """Tick every ``interval`` s until ``stop`` is set (``run_ticks``)."""
        run_ticks(self.tick, stop, interval)

    def tick(self, view: LineView | None = None) -> list[DecisionRecord]:
        """One pass; returns the decisions recorded in it. ``view``: this line's policy table, verdicts and version
        states already read (``dataplane.lines.views``, one pipeline for every line): a line with nothing to do
        then costs no read of its own."""
        if not self.cfg.controlled:
            self.last_tick_ok = time.monotonic()
            return []
        if view is not None and self._said is None and view.activity is not None:
            self._said = view.activity  # what is stored: rewritten only when it changes, not once per line at start
        if view is not None and self.idle(view):
            self.metrics.no_canary()  # as _start_candidate would (in memory: a stale canary's gauges are cleared)
            self.last_tick_ok = time.monotonic()
            return []
        table = self.store.policy() if view is None else view.table
        self.doing = ""
        out = self._start_candidate(table, view) if table.candidate is None else self._judge_candidate(table)
        self._say(self.doing)
        self.last_tick_ok = time.monotonic()
        return out

    def _say(self, activity: str) -> None:
        """Publish what the controller is doing (a gate, a wait) when it changed; `onlinerl status` shows it."""
        if activity != self._said:
            self.store.say(activity, self.clock())
            self._said = activity

    def idle(self, view: LineView) -> bool:
        """Nothing to do on this line: no candidate, no version to gate or drop, and no activity line to clear."""
        if view.table.candidate is not None or self._said != "":
            return False
        stable = view.table.stable
        return not any(
            s.state in self._gateable and v > stable and v not in view.verdicts for v, s in view.versions.items()
        )

    # --- gate ----------------------------------------------------------------------------------------------------
    def _start_candidate(self, table: PolicyTable, view: LineView | None = None) -> list[DecisionRecord]:
        self.metrics.no_canary()
        judged = self.store.states() if view is None else view.verdicts
        known = self.store.versions() if view is None else view.versions
        unjudged = sorted(
            v for v, s in known.items() if s.state in self._gateable and v > table.stable and v not in judged
        )
        # trained on weights a manual rollback dropped (before the trainer rebased): never gated, hold or not
        out = [rec for v in unjudged if not known[v].follows(table) and (rec := self._drop_off_lineage(v, table))]
        fresh = [v for v in unjudged if known[v].follows(table)]
        if not fresh:
            return out
        if table.hold is not None:
            self.doing = f"{_hold_text(table)}: v{fresh[-1]} waits for `onlinerl policy resume` to be gated"
            return out
        if table.paused:
            self.doing = f"paused: v{fresh[-1]} waits for `onlinerl policy resume` to be gated"
            return out
        out += [rec for old in fresh[:-1] if (rec := self._supersede(old, fresh[-1], table.stable))]
        newest = fresh[-1]
        share = 1.0 if self.cfg.strategy == "bluegreen" else self.cfg.canary_share
        if share >= 1.0 and not self._baseline_ready(newest, table.stable):
            return out
        result = self._run_gate(newest, table.stable, needs_preview=known[newest].state == "ready")
        if result is None:  # evaluator error, will retry
            return out
        previewed = self.preview is not None and self.preview.started
        end_preview = {"preview": None, "preview_until": 0.0} if previewed else {}
        now = self.clock()
        if isinstance(result, str):
            passed, reason, figures = False, result, {}
        else:
            passed, reason, figures = result.passed, "; ".join(result.reasons) or "gate passed", result.figures()
            if self.gate_baseline:  # a project line's first version: compared with the shared policy's stable
                figures["baseline"] = self.gate_baseline
                reason = f"{reason} (vs {self.gate_baseline})"
        if passed:
            state = RolloutState(
                version=newest, state="canary", started_at=now, stable_version=table.stable, reason=reason
            )
            rec = DecisionRecord(
                decision="gate_pass",
                version=newest,
                stable=table.stable,
                reason=reason,
                figures={**figures, "canary_share": share},
                at=now,
            )
            ok = self.store.apply(
                rec,
                expect_stable=table.stable,
                expect_candidate=None,
                states=[state],
                # the previewed weights stay; each canary starts split by key (few_users.py)
                policy={"candidate": newest, "canary_share": share, "split": "key", **end_preview},
                snapshot_stable=table.stable,
            )
        else:
            state = RolloutState(
                version=newest, state="gate_failed", stable_version=table.stable, decided_at=now, reason=reason
            )
            rec = DecisionRecord(
                decision="gate_fail", version=newest, stable=table.stable, reason=reason, figures=figures, at=now
            )
            ok = self.store.apply(rec, states=[state], policy=end_preview or None)  # previewed: stable swapped back
        if previewed and self.preview is not None:
            if not ok:
                self.preview.end()  # the table changed meanwhile: nothing recorded, give vLLM back to stable
            self.preview.started = False
        if ok:
            self._emit(rec)
            out.append(rec)
        return out

    @property
    def _gateable(self) -> tuple[str, ...]:
        """Version states the gate takes: loaded (LoRA: servable now); under bluegreen also ready (full weights:
        verified, swapped into vLLM for the gate's preview and then by the switch)."""
        return ("loaded", "ready") if self.cfg.strategy == "bluegreen" else ("loaded",)

    def _baseline_ready(self, version: int, stable: int) -> bool:
        """Blue/green compares with stable's snapshot, so it switches only once stable's arm has ``minSamples``
        shown: with fewer the watch could never take a look (a freshly promoted stable starts from zero)."""
        shown = self.store.arm_stats(stable, STABLE).shown
        if shown >= self.rules.min_samples:
            return True
        why = f"v{version} waits for stable v{stable}'s baseline: {shown} of {self.rules.min_samples} shown"
        if why.split(":")[0] != (self._said or "").split(":")[0]:  # logged once per wait, not per tick
            log.info("%s", why)
        self.doing = why
        return False

    def _run_gate(self, version: int, stable: int, needs_preview: bool = False) -> GateResult | str | None:
        """The gate's result; a reason string when it failed without figures; None to retry on the next tick.
        ``needs_preview``: the candidate is not in vLLM (full weights, ``ready``): its eval runs in a preview."""
        self.gate_baseline = ""
        if not self.cfg.gate.enabled:
            return _passed_without_eval()
        if self.clock() < self._gate_retry_at.get(version, 0.0):
            self.doing = self._backoff_note(version)
            return None  # backing off after an evaluator error
        self.preview = self._new_preview(version) if needs_preview else None
        enter = self.preview.enter if self.preview is not None else _in_place
        base_keys, baseline = self._baseline(stable)
        req = EvalRequest(
            self.keys.job, version, baseline, self.cfg.gate.eval_samples, enter, self.line, base_keys.line
        )
        # Both versions stay loaded for the whole eval: on CPU it takes minutes while the trainer keeps publishing,
        # and without a hold the reloader retired the candidate under it (keepVersions), failing its requests.
        held = holds.hold(
            self.r,
            self.keys,
            [version, *([stable] if base_keys == self.keys else [])],
            GATE_HOLD_SECONDS,
            holder=GATE_HOLDER,
        )
        held_base = (
            []
            if base_keys == self.keys
            else holds.hold(self.r, base_keys, [baseline], GATE_HOLD_SECONDS, holder=GATE_HOLDER)
        )
        self.evaluating = version
        self.gate_baseline = "" if base_keys == self.keys else f"the shared policy's stable v{baseline}"
        against = self.gate_baseline or f"stable v{baseline}"
        self._say(f"eval gate running: v{version} vs {against} on {self.cfg.gate.eval_samples} held-out samples")
        try:
            inp = self.evaluator(req)  # type: ignore[misc]
            if self.preview is not None:
                self.preview.check()
        except Exception as exc:
            if self.preview is not None:
                self.preview.end()  # users are released at once, not at the deadline
            # Retries are spaced in time, not in ticks: a version is marked loaded before every gateway replica has
            # refreshed its model list (409 for a moment), and fast ticks must not spend all attempts in that moment.
            n = self._gate_errors[version] = self._gate_errors.get(version, 0) + 1
            self._gate_retry_at[version] = self.clock() + self.gate_retry_seconds * 2 ** (n - 1)
            log.warning("eval of v%d failed (attempt %d of %d): %s", version, n, self.gate_attempts, exc)
            self._gate_error_text[version] = str(exc)[:200]
            if n >= self.gate_attempts:
                return f"evaluator failed {n} times: {exc}"
            self.doing = self._backoff_note(version)
            return None
        finally:
            self.evaluating = None
            holds.release(self.r, self.keys, held, holder=GATE_HOLDER)
            if held_base:
                holds.release(self.r, base_keys, held_base, holder=GATE_HOLDER)
        result = evaluate_gate(inp, GateThresholds.from_config(self.cfg.gate))
        guardrails = sum(1 for reason in result.reasons if reason.startswith("guardrail:"))
        self.metrics.observe_gate(version, stable, result.figures(), guardrails)
        return result

    def _baseline(self, stable: int) -> tuple[Keys, int]:
        """The line and version the gate compares the candidate with: this line's stable, except on a project line
        that has promoted nothing yet (stable 0): its users are served the shared policy, whose stable it is then."""
        if self.line and stable == 0:
            shared = self.keys.shared
            return shared, RolloutStore(self.r, shared).policy().stable
        return self.keys, stable

    def _backoff_note(self, version: int) -> str:
        n, wait = self._gate_errors.get(version, 0), self._gate_retry_at.get(version, 0.0) - self.clock()
        last = self._gate_error_text.get(version, "")
        return f"eval gate of v{version} failed {n} of {self.gate_attempts} times ({last}); next attempt in {wait:.0f}s"

    def _new_preview(self, version: int) -> Preview:
        def state() -> str | None:
            s = self.store.versions().get(version)
            return s.state if s else None

        return Preview(self.r, self.keys, version, self.cfg.gate.preview_timeout_seconds, state)

    def _drop_off_lineage(self, version: int, table: PolicyTable) -> DecisionRecord | None:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(table.rollback_at))
        reason = (
            f"trained on weights the manual rollback to v{table.rollback_to} at {when} dropped: never gated "
            "(the trainer's next versions descend from the rollback's target)"
        )
        return self._supersede(version, None, table.stable, reason)

    def _supersede(self, version: int, by: int | None, stable: int, reason: str = "") -> DecisionRecord | None:
        now = self.clock()
        reason = reason or f"v{by} is newer: only the newest loaded version is gated"
        rec = DecisionRecord(decision="supersede", version=version, stable=stable, reason=reason, at=now)
        state = RolloutState(version=version, state="superseded", decided_at=now, stable_version=stable, reason=reason)
        if self.store.apply(rec, states=[state]):
            self._emit(rec)
            return rec
        return None

    # --- canary ---------------------------------------------------------------------------------------------------
    def _judge_candidate(self, table: PolicyTable) -> list[DecisionRecord]:
        cand, stable = table.candidate, table.stable
        state = self.store.state(cand)
        if state is None or state.state != "canary" or state.stable_version != stable:
            return self._restart_canary(table, state)
        cand_stats = self.store.arm_stats(cand, CANDIDATE)
        baseline = ArmStats.from_mapping(state.baseline)
        blue = table.canary_share >= 1.0  # everyone on the candidate: no live stable arm, compare with the snapshot
        stable_stats = baseline if blue else self.store.arm_stats(stable, STABLE).minus(baseline)
        now = self.clock()
        due = look_index(min(cand_stats.shown, stable_stats.shown), self.rules.min_samples) > state.last_look
        ledgers = [(cand, CANDIDATE)] if blue else [(cand, CANDIDATE), (stable, STABLE)]
        if due:  # a look: every user's counters, for the per-user cap and the leave-one-out check (per_user.py)
            cand_users = self.store.arm_users(cand, CANDIDATE, cand)
            stable_users = None if blue else self.store.arm_users(stable, STABLE, cand) or None
            users = users_in(cand_users, stable_users)
        else:  # between looks only "fewer users than a look needs?" is asked: count up to that, not every user
            cand_users, stable_users = {}, None
            users = self.store.users_at_most(ledgers, cand, self.cfg.few_users_below)
        few = FewUsers(
            users,
            self.cfg.few_users_below,
            self.cfg.few_users,
            table.split,
            cand_stats.served + (0 if blue else stable_stats.served),
            self.rules.min_samples,
        )
        if few.switch_to_request and not blue and table.pinned is None:
            return self._split_by_request(table, few, now)
        v = self._verdict(
            table, state, cand_stats, stable_stats, now - state.started_at, due, cand_users, stable_users, few
        )
        self.metrics.observe_canary(
            cand,
            stable,
            v.p_accept_rate,
            (cand_stats.summary(), stable_stats.summary()),
            len(guardrail_breaches(cand_stats, stable_stats, self.rules.guardrails)),
            blue,
        )
        if v.action == "hold":
            self.doing = canary_wait(cand, v.reason, cand_stats, stable_stats, blue, few)
        if table.pinned is not None:
            return []
        if not v.evaluated:
            return self._maybe_supersede_inconclusive(table, state)
        if v.action == "promote" and (table.paused or table.hold is not None):
            if (cand, v.look) in self._paused_noted:
                return []
            self._paused_noted.add((cand, v.look))
            why = "paused" if table.hold is None else _hold_text(table)
            rec = self._record(v, cand, stable, now, "hold", f"{why}: would promote ({v.reason})")
            if not self.store.apply(rec, expect_stable=stable, expect_candidate=cand):
                return []
            self._emit(rec)
            return [rec]
        rec = self._record(v, cand, stable, now, v.action, v.reason)
        if v.action == "hold":
            new_state = state.model_copy(update={"last_look": v.look, "guardrail_breach_looks": v.breach_looks})
            policy = None
        else:
            new_state = state.model_copy(
                update={
                    "state": "promoted" if v.action == "promote" else "rolled_back",
                    "last_look": v.look,
                    "guardrail_breach_looks": v.breach_looks,
                    "decided_at": now,
                    "reason": v.reason,
                    "previous_stable": stable if v.action == "promote" else None,
                    "kept": v.action == "promote" and v.kept,
                }
            )
            policy = {"candidate": None, "canary_share": 0.0, "split": "key"}
            if v.action == "promote":
                policy["stable"] = cand
        if not self.store.apply(rec, expect_stable=stable, expect_candidate=cand, policy=policy, states=[new_state]):
            log.info("policy table changed while deciding on v%d; re-reading next tick", cand)
            return []
        self._emit(rec)
        return [rec, *(self._maybe_supersede_inconclusive(table, new_state) if v.action == "hold" else [])]

    def _split_by_request(self, table: PolicyTable, few: FewUsers, now: float) -> list[DecisionRecord]:
        """A few-user canary under ``rollout.fewUsers: decide`` splits by request from now on (few_users.py)."""
        cand, stable = table.candidate, table.stable
        assert cand is not None
        rec = DecisionRecord(decision="hold", version=cand, stable=stable, reason=few.switch_reason(), at=now)
        if not self.store.apply(rec, expect_stable=stable, expect_candidate=cand, policy={"split": "request"}):
            return []
        self._emit(rec)
        return [rec]

    def _verdict(
        self,
        table: PolicyTable,
        state: RolloutState,
        cand_stats: ArmStats,
        stable_stats: ArmStats,
        dwell: float,
        due: bool,
        cand_users: dict[str, ArmStats],
        stable_users: dict[str, ArmStats] | None,
        few: FewUsers,
    ) -> Verdict:
        """This tick's verdict. When the arm counters reach a new look (``due``), it is taken on per-user-capped
        counters and must not rest on one user (per_user.py), from the canary's per-user ledgers (read whole only
        then); a kept promotion also passes the drift guard (decision.DriftGuard). A few-user canary under
        ``rollout.fewUsers: decide`` is judged on its pooled counters instead (few_users.py): the cap and the
        leave-one-out check need more users than it has."""
        stable = table.stable
        blue = table.canary_share >= 1.0
        rules, last, breaches = self.rules, state.last_look, state.guardrail_breach_looks
        drift = self._drift(stable) if due else None

        def decide_at(c: ArmStats, s: ArmStats, at: int | None) -> Verdict:
            if blue:
                return decide_watch(c, s, dwell, last, rules, breaches, drift, at)
            return decide_canary(c, s, dwell, last, rules, breaches, self.cfg.gate.enabled, drift, at)

        if not due or not cand_users:  # no look due, or no ledger (counters written before the ledgers existed)
            return decide_at(cand_stats, stable_stats, None)
        if few.pooled:
            v = decide_at(cand_stats, stable_stats, None)
            return replace(v, reason=f"{v.reason}; {few.verdict_note()}") if v.evaluated else v
        return robust_verdict(
            decide_at, cand_users, stable_users, stable_stats, rules.min_samples, rules.max_user_share
        )

    def _drift(self, stable: int) -> DriftGuard:
        """How many kept promotions lead to ``stable`` from the last proven stable (the anchor), and the anchor's
        own figures as stable (decision.DriftGuard)."""
        kept, version, seen = 0, stable, set()
        while version not in seen and kept <= self.rules.max_kept_in_a_row:
            seen.add(version)
            st = self.store.state(version)
            if st is None or st.state != "promoted" or not st.kept:
                break
            kept += 1
            if st.previous_stable is None:
                return DriftGuard(kept, None, None)
            version = st.previous_stable
        anchor = None if version == stable else self.store.arm_stats(version, STABLE)
        return DriftGuard(kept, version, anchor)

    def _maybe_supersede_inconclusive(self, table: PolicyTable, state: RolloutState) -> list[DecisionRecord]:
        """An inconclusive candidate (equal within noise after ``max_looks``) yields to a newer loaded version."""
        if table.paused or table.hold is not None or not self.rules.inconclusive(state.last_look):
            return []
        judged = self.store.states()
        newer = [
            v for v, s in self.store.versions().items() if s.state == "loaded" and v > state.version and v not in judged
        ]
        if not newer:
            return []
        now = self.clock()
        reason = (
            f"inconclusive after {state.last_look + 1} looks; v{max(newer)} is newer and gets the canary "
            "(no verdict on quality)"
        )
        rec = DecisionRecord(decision="supersede", version=state.version, stable=table.stable, reason=reason, at=now)
        done = state.model_copy(update={"state": "superseded", "decided_at": now, "reason": reason})
        if not self.store.apply(
            rec,
            expect_stable=table.stable,
            expect_candidate=state.version,
            policy={"candidate": None, "canary_share": 0.0, "split": "key"},
            states=[done],
        ):
            return []
        self._emit(rec)
        return [rec]

    def _restart_canary(self, table: PolicyTable, state: RolloutState | None) -> list[DecisionRecord]:
        """The candidate was set by hand, or stable changed under it: restart its canary with a fresh baseline."""
        cand, stable = table.candidate, table.stable
        now = self.clock()
        why = (
            "candidate set outside the controller"
            if state is None or state.state != "canary"
            else f"stable changed from v{state.stable_version} to v{stable}"
        )
        rec = DecisionRecord(decision="hold", version=cand, stable=stable, reason=f"canary restarted: {why}", at=now)
        new_state = RolloutState(version=cand, state="canary", started_at=now, stable_version=stable, reason=why)
        ok = self.store.apply(
            rec,
            expect_stable=stable,
            expect_candidate=cand,
            states=[new_state],
            snapshot_stable=stable,
            policy={"split": "key"},  # a restarted canary starts split by key, as every canary does (few_users.py)
        )
        if ok:
            self._emit(rec)
            return [rec]
        return []

    @staticmethod
    def _record(v: Verdict, cand: int, stable: int, now: float, action: str, reason: str) -> DecisionRecord:
        return DecisionRecord(decision=action, version=cand, stable=stable, reason=reason, figures=v.figures(), at=now)

    def _emit(self, rec: DecisionRecord) -> None:
        self.metrics.decisions.labels(rec.decision).inc()
        log.info("rollout decision %s v%s (stable v%s): %s", rec.decision, rec.version, rec.stable, rec.reason)
        for hook in self.on_decision:
            try:
                hook(rec)
            except Exception:
                log.exception("on_decision hook failed for %s", rec.decision)


def run_ticks(tick: Callable[[], object], stop: threading.Event, interval: float) -> None:
    """Call ``tick`` every ``interval`` s until ``stop`` is set; Redis outages are logged and retried, never fatal."""
    while not stop.is_set():
        try:
            tick()
        except redis.RedisError as exc:
            log.warning("rollout tick failed (will retry): %s", exc)
        stop.wait(interval)


def canary_wait(
    cand: int, reason: str, cand_stats: ArmStats, stable_stats: ArmStats, blue: bool, few: FewUsers | None = None
) -> str:
    """What a holding canary waits for, for `onlinerl status`: the decision's own reason; when one arm has served
    requests and the other none under the key split, why (with one key, or a few, in use every request may land in one
    arm, and the canary never sees the other: a lone developer's canary, issue 36); and what a few-user canary does
    about it (few_users.py: waits, will split by request, or is split by request and judged on pooled counters)."""
    text = f"canary v{cand} holds: {reason}"
    extra = few.waits_for() if few is not None else ""
    if not blue and (few is None or few.split == "key"):
        for arm, idle, busy in (("stable", stable_stats, cand_stats), ("candidate", cand_stats, stable_stats)):
            if idle.served == 0 and busy.served > 0:
                text = (
                    f"{text}; the {arm} arm has served no request since the canary started: arms are split by API "
                    "key, so with one key (or a few) in use the other arm may never be served"
                )
                if few is None or few.policy == "wait":
                    text += " and this canary never decides"
                break
    return f"{text}; {extra}" if extra else text


def _hold_text(table: PolicyTable) -> str:
    """``held at v5 by cli:ana``: the manual decision that holds the table (its time is in `onlinerl status`)."""
    by = f" by {table.hold_by}" if table.hold_by else ""
    return f"held at v{table.hold}{by}"


def _passed_without_eval() -> GateResult:
    from onlinerl_rollout.gate import EvalFigures

    empty = EvalFigures(0, 0, 0, 0.0, 0.0, 0.0, 0.0, 0.0)
    return GateResult(True, ("gate disabled (rollout.gate.enabled: false)",), empty, empty)
