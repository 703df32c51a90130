"""The rollout controller service: the offline eval gate, the canary A/B decision, and the loop that applies them.

``decision`` and ``gate`` are pure (figures in, verdict out); ``controller`` is the loop; ``gate_eval`` is the default
evaluator (``onlinerl eval``'s path through the gateway); ``__main__`` runs it as a process with ``/metrics``.
What the CLI and the operator also read or write (decision records, the Redis store, the manual controls) lives in
the shared library, ``onlinerl.rollout``, so no other component imports this service.
"""
