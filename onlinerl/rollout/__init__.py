"""Safe rollout: the offline eval gate, the canary A/B decision, and the controller that applies decisions.

``decision`` and ``gate`` are pure (figures in, verdict out); ``store`` is the only module that talks to Redis;
``controller`` is the loop; ``manual`` holds the human controls (pin, rollback, pause) used by the CLI and the operator.
"""
