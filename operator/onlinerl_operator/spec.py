"""From an OnlineRLJob spec to a validated OnlineRLConfig, plus the cross-field rules a schema cannot express.

Both failure kinds raise :class:`SpecError` with a message that names the field and what to change; the handlers
turn it into an ``InvalidSpec`` condition instead of retrying forever (a crash loop helps nobody).
"""

from __future__ import annotations

from typing import Any

from onlinerl.config import ConfigError, OnlineRLConfig, from_mapping
from onlinerl.fim import get_template


class SpecError(ValueError):
    """The spec cannot be deployed as written; the message says which field to fix."""


def semantic_problems(cfg: OnlineRLConfig) -> list[str]:
    """Rules across fields: each entry names the fields and the fix."""
    problems = []
    t, s = cfg.trainer, cfg.serving
    if t.micro_batch_size > t.batch_size:
        problems.append(
            f"trainer.microBatchSize ({t.micro_batch_size}) must not exceed trainer.batchSize ({t.batch_size})"
        )
    if t.weights != s.weights_mode:
        problems.append(
            f"trainer.weights ({t.weights}) and serving.weightsMode ({s.weights_mode}) must match: "
            "the reloader can only load what the trainer publishes"
        )
    if t.weights == "lora" and t.lora.r > s.lora.max_rank:
        problems.append(
            f"trainer.lora.r ({t.lora.r}) exceeds serving.lora.maxRank ({s.lora.max_rank}): "
            "vLLM would refuse the adapter"
        )
    if t.engine == "torch" and t.gpus > 1:
        problems.append(f"trainer.engine=torch runs one process; trainer.gpus={t.gpus} needs engine deepspeed or auto")
    if t.nodes > 1 and (t.engine == "torch" or (t.engine == "auto" and t.gpus == 0)):
        problems.append(
            f"trainer.nodes={t.nodes} runs several ranks: set trainer.engine: deepspeed (auto picks plain torch "
            "on CPU nodes, which runs one process)"
        )
    if cfg.model.fim_template != "auto":
        try:
            get_template(cfg.model.fim_template)
        except KeyError as exc:
            problems.append(f"model.fimTemplate: {exc.args[0]}")
    if not cfg.job[:1].isalpha():
        problems.append(f"metadata.name {cfg.job!r} must start with a letter (it prefixes Service names)")
    if cfg.model.claim and cfg.model.image:
        problems.append("model.claim and model.image are alternatives: set one")
    if (cfg.model.claim or cfg.model.image) and not cfg.model.path:
        problems.append("model.path must name the model folder inside model.claim / model.image")
    if cfg.model.claim and cfg.model.path and not cfg.model.path.startswith("/models/"):
        problems.append(f"model.path ({cfg.model.path}) must lie under /models/, where model.claim is mounted")
    if cfg.storage.existing_claim == "" and not cfg.storage.size:
        problems.append("storage.size is required when storage.existingClaim is empty")
    if cfg.ingress.tls_secret and not cfg.ingress.host:
        problems.append("ingress.tlsSecret needs ingress.host (the certificate's name)")
    if not cfg.auth.api_keys_secret and not cfg.auth.allow_anonymous:
        problems.append("auth.apiKeysSecret must name a Secret with key keys.yaml (or set auth.allowAnonymous: true)")
    return problems


def parse_spec(name: str, spec: dict[str, Any] | None) -> OnlineRLConfig:
    """Validate ``spec`` (camelCase) as the config of job ``name``; raise SpecError naming every bad field."""
    data = dict(spec or {})
    if "job" in data:
        raise SpecError("spec.job is not a field: the job name is metadata.name")
    data["job"] = name
    try:
        cfg = from_mapping(data)
    except ConfigError as exc:
        raise SpecError(str(exc)) from None
    problems = semantic_problems(cfg)
    if problems:
        raise SpecError("; ".join(problems))
    return cfg
