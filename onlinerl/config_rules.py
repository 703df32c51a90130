"""The limits between configuration fields, written once: the CRD's CEL rules, the operator and `onlinerl config check`.

A field's own bounds (types, enums, minimum/maximum) live in the pydantic models of :mod:`onlinerl.config`, from which
the CRD schema is generated. What a field-by-field schema cannot say (``microBatchSize <= batchSize``, the FIM
template names) lives here, one :class:`Rule` each: the CEL expression the API server evaluates (``tools/gen_crd.py``
writes it into the CRD as an ``x-kubernetes-validations`` entry at :attr:`Rule.at`), the same predicate in Python for
the operator (``onlinerl_operator.spec``) and the CLI (``onlinerl config check``), and the one message all three give.
Before this module the check passed what the CRD refused, and an unknown template failed only at run time.

Both sides see the same value: ``self`` is the object at :attr:`Rule.at` in the camelCase spec with every default
filled in (the API server defaults before it validates; :meth:`onlinerl.config.OnlineRLConfig.dump` does the same).
tests/foundation/test_config_rules.py evaluates the generated CRD's CEL with a real CEL implementation against
the Python predicates over a table of configurations.

Only standard CEL is used (no Kubernetes string extensions), so any CEL implementation evaluates the rules alike.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Literal

from onlinerl.fim import TEMPLATES

Scope = Literal["spec", "cluster"]


@dataclass(frozen=True)
class Rule:
    """One limit between fields.

    ``at``: dotted camelCase path of the object the rule is attached to ("" = the spec itself). ``cel``: the
    expression, with ``self`` that object. ``holds``: the same predicate in Python, on the same value. ``shows``: the
    fields (relative to ``at``) whose values a refusal prints after the message, so the user sees what to change.
    ``scope``: ``spec`` rules hold wherever the configuration runs; ``cluster`` rules only for an OnlineRLJob on
    Kubernetes (the CRD, the operator, and `onlinerl config check` of an OnlineRLJob manifest).
    """

    at: str
    cel: str
    message: str
    holds: Callable[[Any], bool]
    shows: tuple[str, ...] = ()
    scope: Scope = "spec"

    def value_at(self, spec: dict[str, Any]) -> Any:
        """The object the rule sees as ``self`` in a camelCase spec."""
        node: Any = spec
        for part in filter(None, self.at.split(".")):
            node = node[part]
        return node

    def refusal(self, spec: dict[str, Any]) -> str:
        """The message, then the values of the fields it names (``trainer.batchSize=4``)."""
        node = self.value_at(spec)
        got = []
        for name in self.shows:
            value: Any = node
            for part in name.split("."):
                value = value[part]
            got.append(f"{'.'.join(filter(None, (self.at, name)))}={value!r}")
        return f"{self.message} (got {', '.join(got)})" if got else self.message


def _cel_string_list(values: Iterable[str]) -> str:
    return "[" + ", ".join(f"'{v}'" for v in values) + "]"


# Upstream vLLM's OpenAI image (images.vllm's default, at any tag or digest): it has no onlinerl serving package, so
# vLLM there cannot load the in-process gateway (serving.gatewayMode: inProcess, onlinerl/vllm_flags.py).
UPSTREAM_VLLM_REPOSITORIES = ("vllm/vllm-openai", "docker.io/vllm/vllm-openai")
ENGINE_GPU_IMAGE = "ghcr.io/onlinerl/onlinerl-engine-gpu:0.1.0"  # what `make images-engine-gpu` tags by default


def is_upstream_vllm_image(image: str) -> bool:
    return any(image == r or image.startswith((f"{r}:", f"{r}@")) for r in UPSTREAM_VLLM_REPOSITORIES)


def _cel_is_upstream_vllm_image(field: str) -> str:
    return " || ".join(
        f"{field} == '{r}' || {field}.startsWith('{r}:') || {field}.startsWith('{r}@')"
        for r in UPSTREAM_VLLM_REPOSITORIES
    )


# `auto` detects the template from the tokenizer; any other value must name a template or an alias (onlinerl/fim.py).
FIM_TEMPLATE_NAMES: tuple[str, ...] = (
    "auto",
    *sorted({name for t in TEMPLATES.values() for name in (t.name, *t.aliases)}),
)

# An adapter per project (issue 39): what serving and the trainer can hold. Also the trainer's own check at its start
# (onlinerl_trainer.adapters.lines_problem through project_lines_refusals), so a config that reaches it without the
# CRD or `onlinerl config check` is refused with the same message.
PROJECT_LINE_RULES: tuple[Rule, ...] = (
    Rule(
        at="",
        cel="self.projects.adapters == 'off' || (self.trainer.weights == 'lora' && self.serving.weightsMode == 'lora')",
        message="projects.adapters needs trainer.weights: lora and serving.weightsMode: lora: each project's adapter "
        "is served beside the shared one on the same base model, while full-weight mode holds one model (or set "
        "projects.adapters: off)",
        holds=lambda s: (
            s["projects"]["adapters"] == "off"
            or (s["trainer"]["weights"] == "lora" and s["serving"]["weightsMode"] == "lora")
        ),
        shows=("projects.adapters", "trainer.weights", "serving.weightsMode"),
    ),
    Rule(
        at="",
        cel="self.projects.adapters == 'off' || (self.trainer.engine != 'deepspeed' && self.trainer.gpus <= 1 && "
        "self.trainer.nodes <= 1)",
        message="projects.adapters is not supported with trainer.engine: deepspeed, trainer.gpus above 1 or "
        "trainer.nodes above 1 (an adapter per project trains in one process on plain torch, one optimizer per "
        "adapter, not inside DeepSpeed's ZeRO partitions): set trainer.engine: torch or auto, trainer.gpus: 1 or 0 "
        "and trainer.nodes: 1, or projects.adapters: off",
        holds=lambda s: (
            s["projects"]["adapters"] == "off"
            or (s["trainer"]["engine"] != "deepspeed" and s["trainer"]["gpus"] <= 1 and s["trainer"]["nodes"] <= 1)
        ),
        shows=("projects.adapters", "trainer.engine", "trainer.gpus", "trainer.nodes"),
    ),
)

RULES: tuple[Rule, ...] = (
    Rule(
        at="trainer",
        cel="self.microBatchSize <= self.batchSize",
        message="trainer.microBatchSize must not exceed trainer.batchSize",
        holds=lambda t: t["microBatchSize"] <= t["batchSize"],
        shows=("microBatchSize", "batchSize"),
    ),
    Rule(
        at="trainer",
        cel="!(self.engine == 'torch' && self.gpus > 1)",
        message="trainer.engine torch runs one process: trainer.gpus above 1 needs trainer.engine deepspeed or auto",
        holds=lambda t: not (t["engine"] == "torch" and t["gpus"] > 1),
        shows=("engine", "gpus"),
    ),
    Rule(
        at="trainer",
        cel="self.nodes <= 1 || self.engine == 'deepspeed' || (self.engine == 'auto' && self.gpus > 0)",
        message="trainer.nodes above 1 runs several ranks: set trainer.engine: deepspeed (auto picks plain torch on "
        "CPU nodes, which runs one process)",
        holds=lambda t: t["nodes"] <= 1 or t["engine"] == "deepspeed" or (t["engine"] == "auto" and t["gpus"] > 0),
        shows=("nodes", "engine", "gpus"),
    ),
    Rule(
        at="",
        cel="self.trainer.weights == self.serving.weightsMode",
        message="trainer.weights and serving.weightsMode must match: the reloader can only load what the trainer "
        "publishes",
        holds=lambda s: s["trainer"]["weights"] == s["serving"]["weightsMode"],
        shows=("trainer.weights", "serving.weightsMode"),
    ),
    Rule(
        at="",
        cel="self.trainer.weights != 'lora' || self.trainer.lora.r <= self.serving.lora.maxRank",
        message="trainer.lora.r must not exceed serving.lora.maxRank: vLLM would refuse the adapter",
        holds=lambda s: (
            s["trainer"]["weights"] != "lora" or s["trainer"]["lora"]["r"] <= s["serving"]["lora"]["maxRank"]
        ),
        shows=("trainer.lora.r", "serving.lora.maxRank"),
    ),
    *PROJECT_LINE_RULES,
    Rule(
        at="model",
        cel=f"self.fimTemplate in {_cel_string_list(FIM_TEMPLATE_NAMES)}",
        message="model.fimTemplate must be auto (detect from the tokenizer) or a known FIM template: "
        + ", ".join(FIM_TEMPLATE_NAMES[1:]),
        holds=lambda m: m["fimTemplate"] in FIM_TEMPLATE_NAMES,
        shows=("fimTemplate",),
    ),
    Rule(
        at="model",
        cel="self.claim == '' || self.image == ''",
        message="model.claim and model.image are alternatives: set one",
        holds=lambda m: m["claim"] == "" or m["image"] == "",
        shows=("claim", "image"),
    ),
    Rule(
        at="model",
        cel="(self.claim == '' && self.image == '') || self.path != ''",
        message="model.path must name the model folder inside model.claim / model.image",
        holds=lambda m: (m["claim"] == "" and m["image"] == "") or m["path"] != "",
    ),
    Rule(
        at="model",
        cel="self.claim == '' || self.path == '' || self.path.startsWith('/models/')",
        message="model.path must lie under /models/, where model.claim is mounted",
        holds=lambda m: m["claim"] == "" or m["path"] == "" or m["path"].startswith("/models/"),
        shows=("path",),
    ),
    Rule(
        at="storage",
        cel="self.existingClaim != '' || self.size != ''",
        message="storage.size is required when storage.existingClaim is empty",
        holds=lambda st: st["existingClaim"] != "" or st["size"] != "",
    ),
    Rule(
        at="ingress",
        cel="self.tlsSecret == '' || self.host != ''",
        message="ingress.tlsSecret needs ingress.host (the certificate's name)",
        holds=lambda i: i["tlsSecret"] == "" or i["host"] != "",
        shows=("tlsSecret",),
    ),
    Rule(
        at="auth",
        cel="self.apiKeysSecret != '' || self.allowAnonymous",
        message="auth.apiKeysSecret must name a Secret with key keys.yaml (or set auth.allowAnonymous: true)",
        holds=lambda a: a["apiKeysSecret"] != "" or a["allowAnonymous"],
        scope="cluster",
    ),
    Rule(
        at="",
        cel="self.serving.gatewayMode != 'inProcess' || self.serving.gpus == 0 || "
        f"!({_cel_is_upstream_vllm_image('self.images.vllm')})",
        message="serving.gatewayMode: inProcess runs the gateway inside vLLM's process, and upstream vLLM's image "
        "(images.vllm, used when serving.gpus is above 0) has no onlinerl serving package: build "
        "services/serving/Dockerfile.engine-gpu (make images-engine-gpu) and set images.vllm to it, e.g. "
        f"{ENGINE_GPU_IMAGE}, or set serving.gatewayMode: sidecar",
        holds=lambda s: (
            s["serving"]["gatewayMode"] != "inProcess"
            or s["serving"]["gpus"] == 0
            or not is_upstream_vllm_image(s["images"]["vllm"])
        ),
        shows=("serving.gatewayMode", "serving.gpus", "images.vllm"),
        scope="cluster",
    ),
)


def rules_at(path: str) -> list[Rule]:
    """The rules attached to the object at ``path`` (crdgen writes them there, in this order)."""
    return [r for r in RULES if r.at == path]


def refusals(spec: dict[str, Any], *, cluster: bool = False) -> list[str]:
    """Every rule ``spec`` (camelCase, defaults filled: ``OnlineRLConfig.dump()``) breaks, as its message with the
    values it names. ``cluster``: also the rules of an OnlineRLJob on Kubernetes."""
    return [r.refusal(spec) for r in RULES if (cluster or r.scope == "spec") and not r.holds(r.value_at(spec))]


def project_lines_refusals(spec: dict[str, Any]) -> list[str]:
    """Why ``spec`` (camelCase, defaults filled) cannot keep an adapter per project ([] when it can, or projects are
    off): :data:`PROJECT_LINE_RULES`, for a component that checks only these at its start (the trainer)."""
    return [r.refusal(spec) for r in PROJECT_LINE_RULES if not r.holds(r.value_at(spec))]
