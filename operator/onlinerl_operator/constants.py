"""Names shared by the CRD generator, the renderer and the handlers: one place for the API identity."""

from __future__ import annotations

from onlinerl import ports

GROUP = "onlinerl.dev"
VERSION = "v1alpha1"
KIND = "OnlineRLJob"
PLURAL = "onlinerljobs"
SINGULAR = "onlinerljob"
SHORT_NAMES = ("orl",)
API_VERSION = f"{GROUP}/{VERSION}"

# Labels every child carries: selectors and the cleanup on deletion use them.
LABEL_JOB = "onlinerl.dev/job"
LABEL_COMPONENT = "onlinerl.dev/component"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
MANAGER = "onlinerl-operator"

# Annotations: a hash of what the pod runs (so config changes roll pods / recreate the trainer Job).
ANNO_CONFIG_HASH = "onlinerl.dev/config-hash"
ANNO_SPEC_HASH = "onlinerl.dev/spec-hash"
# kopf keeps its progress and diff-base in annotations under this prefix, never in status.
KOPF_PREFIX = "kopf.onlinerl.dev"

# Paths inside the pods (docs/architecture.md: ports; config via $ONLINERL_CONFIG).
CONFIG_DIR = "/etc/onlinerl"
CONFIG_FILE = "onlinerl.yaml"
KEYS_DIR = "/etc/onlinerl/keys"
KEYS_FILE = "keys.yaml"
CHECKPOINT_DIR = "/checkpoints"
MODELS_DIR = "/models"
MODEL_COPY_DIR = "/model"

# re-exported from onlinerl.ports (defined once for operator, config, local stack and services)
GATEWAY_PORT = ports.GATEWAY
ENGINE_PORT = ports.ENGINE
FEEDBACK_PORT = ports.FEEDBACK
TRAINER_METRICS_PORT = ports.TRAINER_METRICS
RELOADER_PORT = ports.RELOADER
ROLLOUT_PORT = ports.ROLLOUT
EVAL_DATA_DIR = "/eval-data"
GATE_EVALUATOR = "onlinerl_rollout.gate_eval:evaluate"
OPERATOR_PORT = 8080
REDIS_PORT = 6379
