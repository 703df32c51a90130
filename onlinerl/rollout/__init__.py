"""The rollout's shared contract: what the controller service (``onlinerl_rollout``), the CLI and the operator all
read or write.

``records`` holds the records (decisions, per-version verdicts, arm counters); ``store`` is the only module that
talks to Redis for them; ``manual`` holds the human controls (pin, rollback, pause) used by the CLI and the operator.
The controller process itself (gate, canary decision, loop) is the service in ``services/rollout/onlinerl_rollout/``.
"""
