"""The schema of a pod-template fragment: what a job may add to every pod it creates (``spec.podTemplate``) or to one
component's pods (``spec.<serving|feedback|trainer|redis|rollout>.podTemplate``).

It is a subset of Kubernetes' PodTemplateSpec: scheduling (nodeSelector, tolerations, affinity, priorityClassName,
runtimeClassName, topologySpreadConstraints), identity (serviceAccountName, imagePullSecrets), the pod's
securityContext, and extra labels and annotations. Containers, probes, volumes and the operator's own labels are not
part of it: the operator owns them (onlinerl_operator.render_pod_template merges a fragment over what it renders).

Nested Kubernetes objects whose full schema is large and versioned (affinity terms, the pod security context, label
selectors) are carried as they are (``x-kubernetes-preserve-unknown-fields``): the API server validates them when the
operator applies the pod's workload. Kept here, in the shared library, because the config model is the CRD's spec.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic.alias_generators import to_camel

# Pod spec fields the operator renders itself: a fragment naming one is refused with a message saying so.
OPERATOR_OWNED = frozenset(
    {
        "containers",
        "initContainers",
        "ephemeralContainers",
        "volumes",
        "restartPolicy",
        "terminationGracePeriodSeconds",
        "subdomain",
        "hostname",
        "hostNetwork",
        "hostPID",
        "hostIPC",
        "shareProcessNamespace",
    }
)
# Kubernetes objects passed through as they are (the API server validates them on apply).
PRESERVE = {"x-kubernetes-preserve-unknown-fields": True}


class _Fragment(BaseModel):
    """camelCase like the rest of the spec; unknown keys rejected (``containers`` in a fragment is a mistake)."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid")


class PodTemplateMetadata(_Fragment):
    labels: dict[str, str] = Field(
        default_factory=dict, description="Extra pod labels (the operator's own labels cannot be changed)."
    )
    annotations: dict[str, str] = Field(default_factory=dict, description="Extra pod annotations.")


class Toleration(_Fragment):
    key: str | None = None
    operator: Literal["Exists", "Equal"] | None = None
    value: str | None = None
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None
    toleration_seconds: int | None = None


class LocalObjectReference(_Fragment):
    name: str = Field(min_length=1, max_length=253)


class Affinity(_Fragment):
    """core/v1 Affinity; each kind of affinity is passed to Kubernetes as written."""

    node_affinity: dict[str, Any] | None = Field(None, json_schema_extra=PRESERVE)
    pod_affinity: dict[str, Any] | None = Field(None, json_schema_extra=PRESERVE)
    pod_anti_affinity: dict[str, Any] | None = Field(None, json_schema_extra=PRESERVE)


class TopologySpreadConstraint(_Fragment):
    max_skew: int = Field(ge=1)
    topology_key: str = Field(min_length=1)
    when_unsatisfiable: Literal["DoNotSchedule", "ScheduleAnyway"]
    label_selector: dict[str, Any] | None = Field(None, json_schema_extra=PRESERVE)
    min_domains: int | None = Field(None, ge=1)
    match_label_keys: list[str] | None = None
    node_affinity_policy: Literal["Honor", "Ignore"] | None = None
    node_taints_policy: Literal["Honor", "Ignore"] | None = None


class PodTemplateSpecFragment(_Fragment):
    """The pod spec fields a fragment may set; the others are the operator's (:func:`_refuse_owned`)."""

    node_selector: dict[str, str] = Field(default_factory=dict)
    tolerations: list[Toleration] = Field(default_factory=list)
    affinity: Affinity | None = None
    priority_class_name: str | None = Field(None, max_length=253)
    runtime_class_name: str | None = Field(None, max_length=253)
    image_pull_secrets: list[LocalObjectReference] = Field(default_factory=list)
    service_account_name: str | None = Field(None, max_length=253)
    security_context: dict[str, Any] | None = Field(
        None, description="core/v1 PodSecurityContext, as written.", json_schema_extra=PRESERVE
    )
    topology_spread_constraints: list[TopologySpreadConstraint] = Field(default_factory=list)

    @model_validator(mode="before")
    @classmethod
    def _refuse_owned(cls, data: Any) -> Any:
        """A pod field the operator renders (containers, volumes, ...) gets a message that says so, not just
        "extra input"."""
        if isinstance(data, dict):
            owned = sorted(k for k in data if k in OPERATOR_OWNED)
            if owned:
                allowed = ", ".join(f.alias or n for n, f in cls.model_fields.items())
                raise ValueError(f"{', '.join(owned)}: the operator renders these (a pod template sets only {allowed})")
        return data


class PodTemplateFragment(_Fragment):
    """Merged over the pods the operator renders: the component's fragment over the job's, lists appended."""

    metadata: PodTemplateMetadata = Field(default_factory=PodTemplateMetadata)
    spec: PodTemplateSpecFragment = Field(default_factory=PodTemplateSpecFragment)

    def as_kubernetes(self) -> dict[str, Any]:
        """The fragment as Kubernetes spells it: camelCase, unset and empty fields left out."""
        data = self.model_dump(by_alias=True, mode="json", exclude_none=True)
        # Only the fragment's own empty fields go: inside Kubernetes objects an empty {} can mean something
        # (a labelSelector {} selects every pod).
        return {part: {k: v for k, v in data[part].items() if v not in ({}, [])} for part in ("metadata", "spec")}


def pod_template_field() -> Any:
    """The ``podTemplate`` field every component section and the spec itself carry."""
    return Field(
        default_factory=PodTemplateFragment,
        description="k8s: a PodTemplateSpec fragment (metadata.labels/annotations; spec.nodeSelector, tolerations, "
        "affinity, priorityClassName, runtimeClassName, imagePullSecrets, serviceAccountName, securityContext, "
        "topologySpreadConstraints) merged over the pods the operator renders. A component's value wins over the "
        "job-wide spec.podTemplate; lists are appended; the operator's own labels and fields win over both.",
    )
