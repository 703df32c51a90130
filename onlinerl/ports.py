"""Every fixed port of a job, defined once (docs/architecture.md: ports).

The config defaults, the operator's manifests, the local stack (``onlinerl up``) and the services' own ``--port``
defaults all read these, so a port moves in one place. Ports that a job's config can override (gateway, feedback,
trainer metrics) are only the defaults here; the config value wins.
"""

from __future__ import annotations

import os

GATEWAY = 8000  # serving.port: the OpenAI-compatible API, the only port that leaves the serving pod
ENGINE = 8001  # vLLM, bound to 127.0.0.1 inside the serving pod
FEEDBACK = 8002  # feedback.port: Continue's completion tracking
TRAINER_METRICS = 8003  # trainer.metricsPort: /metrics and /healthz of the trainer
RELOADER = 8004  # reloader's /metrics and /healthz (env ONLINERL_RELOADER_PORT overrides)
ROLLOUT = 8005  # rollout controller's /metrics and /healthz (env ONLINERL_ROLLOUT_PORT overrides)
REPLICA_BASE = 18100  # `onlinerl up`, N > 1 serving replicas: replica i on +10 i (gateway), +1 (vLLM), +2 (reloader)

LOOPBACK = "127.0.0.1"
ANY = "0.0.0.0"  # a pod's: its Service, the kubelet and Prometheus reach it on the pod's address
LISTEN_HOST_ENV = "ONLINERL_LISTEN_HOST"  # `onlinerl up` sets it for every child: loopback unless --host


def listen_host() -> str:
    """Where the processes whose address is not in the job config (trainer metrics, rollout controller) listen:
    ``$ONLINERL_LISTEN_HOST`` (the local stack: loopback by default), else every interface (a pod)."""
    return os.environ.get(LISTEN_HOST_ENV) or ANY
