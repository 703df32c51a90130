"""One typed configuration for every onlinerl component.

The shape is exactly the ``OnlineRLJob`` spec (camelCase keys), so the operator can hand a pod its slice of the
custom resource verbatim, and ``make run`` can use the same file locally. Values come from, in order of precedence:
environment variables ``ONLINERL__SECTION__FIELD=value`` (value parsed as YAML), a YAML file, then defaults.
An invalid value fails at start-up with the field path and the reason (:class:`ConfigError`).
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic.alias_generators import to_camel

from onlinerl import ports
from onlinerl.keys import tenant_problem
from onlinerl.pod_template import PodTemplateFragment, pod_template_field

ENV_PREFIX = "ONLINERL__"
CONFIG_ENV = "ONLINERL_CONFIG"


class ConfigError(ValueError):
    """A configuration that cannot start: each line names a field path and the reason."""


class _Section(BaseModel):
    """Base: camelCase in YAML/CRD, snake_case in Python, unknown keys rejected (typos fail loudly)."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid", frozen=False)


class ResourcesConfig(_Section):
    """Kubernetes container resources (quantities as strings: ``cpu: "2"``, ``memory: 8Gi``). Ignored outside k8s."""

    requests: dict[str, str] = Field(default_factory=dict)
    limits: dict[str, str] = Field(default_factory=dict)


class ImagesConfig(_Section):
    """Container images the operator deploys (k8s only). GPU serving runs upstream vLLM; CPU serving our CPU build."""

    serving: str = Field("ghcr.io/onlinerl/onlinerl-serving:0.1.0", max_length=512)
    feedback: str = Field("ghcr.io/onlinerl/onlinerl-feedback:0.1.0", max_length=512)
    trainer: str = Field("ghcr.io/onlinerl/onlinerl-trainer:0.1.0", max_length=512)
    vllm: str = Field("vllm/vllm-openai:v0.32.0", max_length=512)
    vllm_cpu: str = Field("ghcr.io/onlinerl/onlinerl-engine-cpu:0.1.0", max_length=512)
    redis: str = Field(
        "valkey/valkey:9.0",
        max_length=512,
        description="Needs valkey >= 9.0 (or Redis >= 7.4): rollout records expire per hash field (HEXPIRE).",
    )
    rollout: str = Field("ghcr.io/onlinerl/onlinerl-rollout:0.1.0", max_length=512)
    pull_policy: Literal["Always", "IfNotPresent", "Never"] = "IfNotPresent"


class ModelConfig(_Section):
    """Which weights to serve and train. ``path`` is any Hugging Face folder; empty means the bootstrapped SmolLM2.

    On Kubernetes the folder comes from ``claim`` (a PVC mounted read-only at ``/models``; ``path`` points inside it)
    or from ``image`` (an image holding the folder at ``path``, copied into the pod by an init container).
    """

    path: str = Field("", max_length=4096)
    served_name: str = Field("onlinerl-base", max_length=253)
    fim_template: str = Field("auto", max_length=64)
    claim: str = Field("", max_length=253, description="PVC holding the model folder, mounted read-only at /models.")
    image: str = Field("", max_length=512, description="Image holding the model folder at `path` (k8s).")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    max_model_len: int = Field(2048, ge=256, le=131072)


class RedisConfig(_Section):
    """Where the streams live. Empty ``url`` locally means: start the embedded valkey."""

    url: str = ""
    rollout_ttl_seconds: int = Field(
        1800, ge=900, description="Rollout records must outlive Continue's 10 s reject window by far."
    )
    connect_timeout_seconds: float = Field(2.0, gt=0)
    socket_timeout_seconds: float = Field(
        5.0,
        gt=0,
        description="Every Redis command's reply deadline (a half-open connection fails instead of hanging); "
        "blocking reads get their block time on top.",
    )
    url_secret: str = Field("", description="k8s: Secret whose key `urlSecretKey` holds the URL of an external Redis.")
    url_secret_key: str = "url"
    url_secret_per_user: bool = Field(
        False,
        description="k8s: urlSecret holds one URL per Redis user (keys gateway, reloader, feedback, trainer, rollout, "
        "operator; the chart's shared Redis writes <job>-redis-urls for each job of redis.jobs): each container "
        "connects as its own user, the operator as operator. urlSecretKey is then unused.",
    )
    password_secret: str = Field(
        "",
        description="k8s, in-cluster Redis: Secret with one key per ACL user (`gateway`, `reloader`, `feedback`, "
        "`trainer`, `rollout`, `operator`, `admin`), each that user's password (URL-safe characters). Empty: the "
        "operator creates `<job>-redis-users` with generated ones.",
    )
    storage_size: str = Field("8Gi", description="k8s: volume of the in-cluster Redis (used when no URL is given).")
    storage_class: str = Field(
        "",
        max_length=253,
        description="k8s: StorageClass of the in-cluster Redis's volume (empty: the cluster's default class). Its "
        "own, not storage.storageClass: Redis fsyncs every write, a shared-file class suits checkpoints, not this.",
    )
    access_mode: Literal["ReadWriteOnce", "ReadWriteOncePod", "ReadWriteMany"] = Field(
        "ReadWriteOnce", description="k8s: access mode of the in-cluster Redis's volume (one pod writes it)."
    )
    resources: ResourcesConfig = Field(default_factory=ResourcesConfig)
    pod_template: PodTemplateFragment = pod_template_field()


class AuthConfig(_Section):
    """Bearer keys shared by serving and feedback: a YAML file ``{tenants: {name: {keys: [...]}}}``."""

    api_keys_file: str = ""
    allow_anonymous: bool = False
    api_keys_secret: str = Field("", description="k8s: Secret with key `keys.yaml`, mounted as apiKeysFile.")


class ServingLoraConfig(_Section):
    max_rank: int = Field(16, ge=1, le=256)
    max_loras: int = Field(
        4, ge=1, le=64, description="Adapters one engine step may batch together (vLLM --max-loras): its LoRA slots."
    )
    max_cpu_loras: int | None = Field(
        None,
        ge=1,
        le=100_000,
        description="Adapters vLLM keeps in memory (vLLM --max-cpu-loras; unset: maxLoras). Every loaded version keeps "
        "its name; past this many the least recently used is dropped from memory and read from its folder again by "
        "its next request (slower, never failed). With per-project adapters (projects.adapters) set it to the "
        "projects that are active at once, times 1 to 2 versions each, plus the shared line's.",
    )

    @model_validator(mode="after")
    def _cpu_holds_the_slots(self) -> ServingLoraConfig:
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(
                f"serving.lora.maxCpuLoras ({self.max_cpu_loras}) must be at least maxLoras ({self.max_loras}): "
                "the adapters in a batch are held in memory"
            )
        return self


class ServingConfig(_Section):
    """Gateway in front of vLLM; only ``port`` is exposed outside the pod."""

    host: str = "0.0.0.0"
    port: int = Field(ports.GATEWAY, ge=1, le=65535)
    engine_url: str = f"http://127.0.0.1:{ports.ENGINE}"
    replicas: int = Field(1, ge=0, le=1000)
    max_prompt_chars: int = Field(32768, ge=1)
    max_tokens_cap: int = Field(4096, ge=1, le=131072)
    routing_headers: Literal["privileged", "all"] = Field(
        "privileged",
        description="Which keys learn the arm and policy version that served them (the X-OnlineRL-Arm and "
        "X-OnlineRL-Policy-Version response headers, and policy_version in a feedback reply): privileged = eval and "
        "admin keys only; all = every key, for test and debugging stacks only (a user who knows it is in the canary "
        "can steer it).",
    )
    default_max_tokens: int = Field(
        16,
        ge=1,
        le=131072,
        description="Tokens generated for a request that gives no max_tokens (or null): 16, as OpenAI's and vLLM's "
        "legacy completions API. At most maxTokensCap (unset, it yields to a smaller cap). Continue always sends "
        "its own (maxTokens).",
    )
    request_timeout_seconds: float = Field(
        60.0,
        gt=0,
        description="Longest wait for the engine's answer (or, streaming, for its next piece); a request that outlives "
        "it gets 504 with a message (a slow engine), while 503 + Retry-After means the engine is down.",
    )
    engine_connect_timeout_seconds: float = Field(2.0, gt=0)
    retry_after_seconds: int = Field(2, ge=1)
    exploration_temperature: float | None = Field(
        0.7,
        ge=0,
        le=2,
        description="Floor on the sampling temperature of routed traffic, so the policy sees alternatives to its "
        "greedy answer. Continue asks 0.01, where a sampled token has probability ~1 and carries no gradient "
        "(trainer loss.py): without the floor nothing is learned. Users then see samples, not the greedy answer "
        "(the base model's accept rate ~0.05 against ~0.11 greedy, docs/demo.md). Recorded per rollout; evaluation "
        "and pinned requests keep the client's value. null: serve the client's temperature (no online learning).",
    )
    stream_interval: int = Field(
        8,
        ge=1,
        le=256,
        description="vLLM streams the first token at once, then tokens in groups of this many (and the last ones "
        "when done): fewer SSE events to relay and serialize. Continue shows a completion only once it is complete, "
        "so neither time to first token nor total time changes. 1 = an event per token.",
    )
    max_records_per_tenant: int = Field(
        50_000,
        ge=1,
        le=10_000_000,
        description="Rollout records kept per tenant (each holds its prompt and token ids, a few KB). Over the cap "
        "the gateway evicts the tenant's oldest records (counted in onlinerl_serving_rollout_records_evicted_total, "
        "logged with the tenant) and the user's request still succeeds; an evicted rollout can no longer be rated. "
        "Each record also expires redis.rolloutTtlSeconds after it was written.",
    )
    gateway_mode: Literal["auto", "sidecar", "inProcess"] = Field(
        "auto",
        description="Where the gateway runs: sidecar = its own process beside vLLM, reaching it over loopback HTTP; "
        "inProcess = inside vLLM's API server process (loaded with vLLM's --middleware), calling vLLM's app "
        "directly: no second hop, about 1-2 ms less per completion (bench/RESULTS.md, issue 40). The gateway's port, "
        "routes and behaviour are the same; vLLM stays on loopback. inProcess needs the onlinerl serving package "
        "in the engine's image (the CPU engine image has it; for GPUs see services/serving/Dockerfile.engine-gpu). "
        "auto (the default) = inProcess wherever the engine's image has that package, sidecar on upstream vLLM's "
        "image (serving.gpus above 0 with images.vllm upstream's).",
    )
    weights_mode: Literal["lora", "full"] = "lora"
    lora: ServingLoraConfig = Field(default_factory=ServingLoraConfig)
    keep_versions: int = Field(3, ge=1, le=64)
    max_load_failures: int = Field(3, ge=1)
    drain_timeout_seconds: float = Field(120.0, ge=0)
    vllm_args: list[str] = Field(default_factory=list)
    gpus: int = Field(0, ge=0, le=64, description="k8s: GPUs per serving replica (0 = vLLM on CPU).")
    resources: ResourcesConfig = Field(default_factory=ResourcesConfig)
    pod_template: PodTemplateFragment = pod_template_field()

    @model_validator(mode="after")
    def _default_within_cap(self) -> ServingConfig:
        """A default set above the cap is a contradiction; the unset default (16) yields to a smaller cap."""
        if "default_max_tokens" not in self.model_fields_set:
            self.default_max_tokens = min(self.default_max_tokens, self.max_tokens_cap)
        elif self.default_max_tokens > self.max_tokens_cap:
            raise ValueError(
                f"serving.defaultMaxTokens ({self.default_max_tokens}) is above serving.maxTokensCap "
                f"({self.max_tokens_cap}): lower defaultMaxTokens or raise maxTokensCap"
            )
        return self

    @property
    def max_body_bytes(self) -> int:
        """Largest request body the gateway (and the local balancer in front of it) reads: the UTF-8 worst case of
        ``maxPromptChars`` plus the other fields."""
        return self.max_prompt_chars * 4 + 64 * 1024


class RewardConfig(_Section):
    """Reward per outcome: a named table (``preset``) and the fields you give, which always win over it.

    ``chars`` (default) is Cursor's table with the accept paid by what it saves the user: ``accepted`` plus
    ``acceptedPerChar`` for each shown character up to ``acceptedCharsCap`` (0.5 + 0.0125 x min(n, 40): 0.55 for
    four characters, Cursor's 0.75 at twenty, 1.0 for a full line of forty). Under a flat accept reward the policy
    learns to stop after the part it is surest of (docs/demo.md, run 16: suggestions halved, accepted characters
    flat on PyYAML); paying by the characters keeps "write more of the line" worth something. Rejects (-0.25) and
    silence (0) are Cursor's, so the policy still learns when to say nothing: show only when
    P(accept) x accept reward > (1 - P(accept)) x 0.25, a bar of 31% for four characters and 20% for a line.
    ``cursor`` is Cursor's flat +0.75 / -0.25 / 0; ``rlinf`` is the seed's 1/0; ``custom`` is the ``chars`` table.
    The preset fills only the fields left unset: ``{preset: cursor, rejected: -0.5}`` is Cursor's table with a
    reject at -0.5 (a field given is never overwritten; ``acceptedPerChar: 0`` makes the ``chars`` accept flat).
    """

    preset: Literal["chars", "cursor", "rlinf", "custom"] = "chars"
    accepted: float | None = Field(None, description="Reward of an accept (unset: the preset's).")
    accepted_per_char: float | None = Field(
        None,
        ge=0,
        description="Added to an accept's reward per shown character (trimmed), up to acceptedCharsCap (unset: the "
        "preset's).",
    )
    accepted_chars_cap: int | None = Field(
        None, ge=0, description="Characters beyond this earn no more, about one line (unset: the preset's)."
    )
    rejected: float | None = Field(None, description="Reward of a reject (unset: the preset's).")
    empty: float | None = Field(None, description="Reward of silence, a suggestion not shown (unset: the preset's).")

    @model_validator(mode="after")
    def _apply_preset(self) -> RewardConfig:
        """Fill each field left unset (or null) from the preset's table; a value the configuration gave stays."""
        table = {**REWARD_PRESETS["chars"], **REWARD_PRESETS.get(self.preset, {})}
        for name, value in table.items():
            if getattr(self, name) is None:
                setattr(self, name, value)
        return self


# Each named table, whole (``custom`` is ``chars``: the fields given over it).
REWARD_PRESETS: dict[str, dict[str, float]] = {
    "chars": {"accepted": 0.5, "accepted_per_char": 0.0125, "accepted_chars_cap": 40, "rejected": -0.25, "empty": 0.0},
    "cursor": {"accepted": 0.75, "accepted_per_char": 0.0, "rejected": -0.25, "empty": 0.0},
    "rlinf": {"accepted": 1.0, "accepted_per_char": 0.0, "rejected": 0.0, "empty": 0.0},
}


class FeedbackLimitsConfig(_Section):
    """How much one user (one API key) may contribute to training and to the canary statistics, and when one user's
    accept rate is so far above or below its tenant's that its feedback is quarantined (services/feedback/README)."""

    max_samples_per_user_per_hour: int = Field(
        1000,
        ge=0,
        description="Counted events (trained or counted in stats) per API key per clock hour; 0 = no limit. Events "
        "over it are audited (reason contribution_limit), never trained or counted.",
    )
    anomaly_k: float = Field(
        4.0,
        ge=0,
        description="Quarantine a user whose accept rate is more than k binomial sigmas above or below the rest of "
        "its tenant's; 0 = off.",
    )
    anomaly_min_shown: int = Field(50, ge=1, description="Rated suggestions a user needs before the anomaly test runs.")
    anomaly_window_seconds: int = Field(
        7 * 24 * 3600,
        ge=60,
        description="Per-user and per-tenant accept counters expire this long after their last event.",
    )


class SilenceConfig(_Section):
    """Silence is learnable: Continue uploads an outcome only for suggestions it displayed, so for a served rollout
    that gets no outcome within ``windowSeconds`` of its end the feedback service itself produces the ``empty``
    reward ("not shown"), once, for tenants whose clients track completions (see the feedback sweeper).
    Off for every tenant not listed: a client that never uploads would otherwise teach only silence. The trainer
    never makes a completion nobody saw likelier: a silence sample's advantage is capped at 0 (inert while the
    tenant's baseline is below ``empty``, as under the default reward; a push down when it is above)."""

    window_seconds: float = Field(
        15.0,
        gt=0,
        le=600,
        description="Seconds after a rollout finished with no outcome before it counts as not shown. Keep it above "
        "Continue's 10 s reject window plus upload time: a real outcome arriving later is a `duplicate`.",
    )
    tenants: dict[str, bool] = Field(
        default_factory=dict,
        description="Tenant -> silence on/off. Only tenants set to true (their clients upload outcomes) get "
        "silence samples; the gateway records their rollouts as due.",
    )
    sweep_interval_seconds: float = Field(1.0, gt=0, le=60, description="How often due rollouts are swept.")
    sweep_batch: int = Field(256, ge=1, le=10_000, description="Due rollouts taken per tenant per sweep.")

    @field_validator("tenants")
    @classmethod
    def _tenant_names(cls, tenants: dict[str, bool]) -> dict[str, bool]:
        problems = [p for p in map(tenant_problem, tenants) if p is not None]
        if problems:
            raise ValueError("; ".join(problems))
        return tenants

    def tracked(self, tenant: str) -> bool:
        """Whether ``tenant``'s unreported rollouts turn into silence samples."""
        return self.tenants.get(tenant, False)


class FeedbackConfig(_Section):
    host: str = "0.0.0.0"
    port: int = Field(ports.FEEDBACK, ge=1, le=65535)
    replicas: int = Field(1, ge=0, le=1000)
    workers: int = Field(
        1,
        ge=1,
        le=64,
        description="Server processes per pod sharing one port; give the pod about one CPU per worker. "
        "Above 1, metrics use Prometheus multiprocess mode.",
    )
    max_body_bytes: int = Field(256 * 1024, ge=1024)
    reward: RewardConfig = Field(default_factory=RewardConfig)
    train_unmatched: bool = Field(
        False, description="Poisoning guard: events matching no served completion are audited only."
    )
    max_backlog: int = Field(200_000, ge=1, description="Unconsumed samples above this answer 429.")
    dedupe_ttl_seconds: int = Field(7 * 24 * 3600, ge=60)
    retry_after_seconds: int = Field(2, ge=1)
    silence: SilenceConfig = Field(default_factory=SilenceConfig)
    limits: FeedbackLimitsConfig = Field(default_factory=FeedbackLimitsConfig)
    rate_scope: Literal["user", "tenant"] = Field(
        "user",
        description="Whose rollouts a key may rate. user: only those served to that key (the gateway's user_hash); "
        "an event whose text joins only another key's rollout is audited (rejected, reason not_own_rollout) and "
        "leaves that rollout for its user. tenant: any key of the tenant may rate any rollout of the tenant (one "
        "shared key, or a client that uploads for a whole team); the event still counts against the rating key.",
    )
    resources: ResourcesConfig = Field(default_factory=ResourcesConfig)
    pod_template: PodTemplateFragment = pod_template_field()


class StalenessConfig(_Section):
    """How far behind a sample's version may be. Counted against the oldest version serving still gives users (the
    policy table's stable, or an older pinned or candidate version; at most the trainer's own): under a canary the
    trainer writes versions faster than they are promoted, and stable's samples must not age out while stable is
    what users are served."""

    max_versions: int = Field(4, ge=0)
    mode: Literal["drop", "truncate"] = "drop"
    truncate_weight: float = Field(1.0, gt=0, description="Cap on the importance weight of a stale sample.")


class AlgorithmConfig(_Section):
    """Critic-free clipped PPO (see services/trainer/onlinerl_trainer/loss.py for the math).

    The defaults let a reject carry gradient without flattening the policy or drowning the accepts (docs/demo.md,
    "Choosing the default algorithm" and "Offline screen"): the default reward (a reject at -0.25) with a running
    baseline pushes rejected completions down, and four tools bound how far: the rejects' share of the gradient
    (negativeWeight 0.05), a tighter lower clip for negative advantages (clipEpsNegative), the dual clip, and
    seq-mean aggregation (a long rejected completion weighs as much as a short accepted one, not more). The KL
    penalty to the base (klCoef) is available and off: at 0.1 it held the policy at the base. The ratio is clipped
    against the trainer's own weights before each update (oldLogprobs recompute), not against the served policy:
    under the canary most samples come from a version several behind, and run 18 met the bar where run 17 did not.
    """

    clip_eps: float = Field(0.2, gt=0, lt=1)
    clip_eps_negative: float | None = Field(
        0.1,
        gt=0,
        lt=1,
        description="Lower ratio bound 1 - eps for tokens with a negative advantage (None = clipEps). Smaller than "
        "clipEps caps how far one batch of rejects can push a token down (asymmetric clipping).",
    )
    dual_clip: float | None = Field(3.0, gt=1, description="c in Ye et al. dual clip; None disables it.")
    aggregation: Literal["token-mean", "seq-mean"] = Field(
        "seq-mean",
        description="seq-mean: every completion weighs the same; token-mean: every token (long completions, mostly "
        "rejected ones, then dominate the gradient).",
    )
    baseline: Literal["running", "batch", "none"] = "running"
    baseline_momentum: float = Field(0.9, ge=0, lt=1)
    normalize_advantages: bool = False
    old_logprobs: Literal["behaviour", "recompute"] = Field(
        "recompute",
        description="The policy the PPO ratio is clipped against. recompute (decoupled PPO): the trainer's own "
        "weights before the update (one no-grad forward per batch), with the served policy mu entering only through "
        "the importance weight min(pi_old / mu, isTruncation); behaviour: mu itself, what vLLM recorded. Under the "
        "canary a sample is served by a version several behind the trainer's, and clipping against mu clips a ratio "
        "that is mostly staleness (docs/demo.md, run 18).",
    )
    is_truncation: float = Field(
        2.0, gt=0, description="Cap on the behaviour-mismatch importance weight under recompute."
    )
    kl_coef: float = Field(
        0.0,
        ge=0,
        description="Weight of the per-token KL(pi_theta || pi_base) penalty, off by default: at 0.1 it held the "
        "policy at the base while the accepts' push was small (docs/demo.md, offline screen). With LoRA the base is "
        "the adapter switched off (no second model); full weights load a frozen, unsharded copy on every rank.",
    )
    kl_estimator: Literal["k1", "k3"] = Field(
        "k3", description="KL estimator on the sampled tokens: k3 (unbiased, never negative) or k1 (log ratio)."
    )
    entropy_coef: float = Field(0.0, ge=0)
    entropy_min: float = Field(
        0.2,
        ge=0,
        description="Entropy band (nats per completion token, at the sampled temperature): when the running entropy "
        "(entropyWindowTokens) leaves [entropyMin, entropyMax] the trainer logs a warning and sets "
        "onlinerl_trainer_entropy_out_of_band.",
    )
    entropy_max: float = Field(2.0, gt=0, description="Upper end of the entropy band (see entropyMin).")
    entropy_window_tokens: int = Field(
        512,
        ge=0,
        description="The band applies to the token-weighted mean entropy of the latest updates holding at least this "
        "many completion tokens (~20 samples), not to one update: a 2-sample update's entropy is noise (0.17-1.44 "
        "in one run). 0: each update alone.",
    )
    learning_rate: float = Field(1e-4, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    max_grad_norm: float = Field(1.0, gt=0)
    ppo_epochs: int = Field(
        1,
        ge=1,
        description="Gradient steps per batch. Under oldLogprobs recompute the ratio is exactly 1 in the first epoch, "
        "so with 1 epoch (this default, the GPU path) the clips never act and one AdamW step (each parameter moves "
        "at most learningRate) is the bound on an update; from the second epoch (the cpu profile: 4) the clips "
        "remove the gradient of tokens already past their bound (trainer loss.py: what bounds one update).",
    )
    negative_sample_rate: float = Field(
        1.0,
        gt=0,
        le=1,
        description="Share of negative-advantage samples (rejects) trained; each trained one carries "
        "negativeWeight/rate of its advantage (negativeWeight 1: the expected gradient is unchanged). Below 1 where "
        "trainer passes, not events, are scarce (the cpu profile: 0.05); the rest are acknowledged untrained "
        "(onlinerl_trainer_subsampled_samples).",
    )
    negative_weight: float = Field(
        0.05,
        gt=0,
        le=1,
        description="Share of the rejects' expected gradient kept: a trained negative-advantage sample carries "
        "negativeWeight / negativeSampleRate of its advantage. On shown suggestions this is a smaller constant "
        "baseline (weight x the running one), so the expected gradient keeps its direction, and the few accepts "
        "lead each update (docs/demo.md: weight 1 moved nothing held-out, 0.15 learned, 0.05 learned further; "
        "run 16).",
    )
    staleness: StalenessConfig = Field(default_factory=StalenessConfig)

    @model_validator(mode="after")
    def _band_ordered(self) -> AlgorithmConfig:
        if self.entropy_min >= self.entropy_max:
            raise ValueError(
                f"trainer.algorithm.entropyMin ({self.entropy_min}) must be below entropyMax ({self.entropy_max})"
            )
        return self


class TrainerLoraConfig(_Section):
    r: int = Field(16, ge=1, le=256)
    alpha: int = Field(32, ge=1)
    dropout: float = Field(0.0, ge=0, lt=1)
    target_modules: list[str] = Field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])
    last_layers: int = Field(
        0,
        ge=0,
        description="Adapt only the last N transformer layers (0, or N at least the model's layer count = all). "
        "Backward then stops N layers deep: measured 1.6x faster steps for N=8 of SmolLM2's 30 on CPU.",
    )


class CheckpointConfig(_Section):
    every_steps: int = Field(1, ge=1)
    every_seconds: float = Field(0.0, ge=0, description="0 disables the time trigger.")
    keep: int = Field(5, ge=1)


class TrainerConfig(_Section):
    weights: Literal["lora", "full"] = "lora"
    lora: TrainerLoraConfig = Field(default_factory=TrainerLoraConfig)
    engine: Literal["auto", "torch", "deepspeed"] = "auto"
    zero_stage: Literal[2, 3] = 2
    gpus: int = Field(0, ge=0)
    batch_size: int = Field(8, ge=1)
    micro_batch_size: int = Field(8, ge=1)
    batch_timeout_seconds: float = Field(30.0, gt=0)
    max_seq_len: int = Field(
        2048,
        ge=16,
        description="Longest prompt + completion the trainer takes, in tokens; at least model.maxModelLen. A longer "
        "sample is dropped and counted, never cut (the policy must see the context vLLM saw). Memory grows little: "
        "only completion positions are projected to the vocabulary.",
    )
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    suspend: bool = False
    metrics_port: int = Field(ports.TRAINER_METRICS, ge=1, le=65535)
    tensorboard_dir: str = ""
    torch_threads: int = Field(0, ge=0, description="0 = torch default.")
    seed: int = 0
    resources: ResourcesConfig = Field(default_factory=ResourcesConfig)
    max_restarts: int = Field(5, ge=0, description="k8s: failed trainer Jobs recreated before the job turns Failed.")
    restart_backoff_seconds: float = Field(30.0, ge=0, description="k8s: first retry delay, doubled per failure.")
    nodes: int = Field(
        1,
        ge=1,
        le=256,
        description="k8s: trainer pods (nodes), each running max(gpus, 1) ranks. Above 1: an Indexed Job (or a "
        "JobSet where jobset.x-k8s.io is served) plus a headless Service; torchrun on each pod rendezvouses at "
        "pod 0 (node rank = completion index). Rank 0 alone reads the samples stream. Needs engine deepspeed.",
    )
    rendezvous_port: int = Field(29500, ge=1, le=65535, description="k8s: torchrun's rendezvous port on pod 0.")
    multi_node_api: Literal["auto", "job", "jobset"] = Field(
        "auto",
        description="k8s, nodes > 1: `job` (Indexed Job + headless Service), `jobset` (jobset.x-k8s.io/v1alpha2), "
        "or `auto` (JobSet when the cluster serves it).",
    )
    pod_template: PodTemplateFragment = pod_template_field()


class StorageConfig(_Section):
    checkpoint_dir: str = ".onlinerl/checkpoints"
    existing_claim: str = ""
    size: str = "20Gi"
    storage_class: str = ""
    access_mode: Literal["ReadWriteMany", "ReadWriteOnce"] = "ReadWriteMany"


class GateConfig(_Section):
    """The offline eval gate: held-out requests to candidate and stable; the candidate must not be clearly worse.

    With ``evalSamples`` records per version the figures are noisy (64 records, 20 accepts: about 20 % relative
    error on accepted characters), so the gate's bars are coarse screens for broken or degenerate policies, and a
    rate past its bar fails only when the shortfall is credible (``confidence``); the canary, on live traffic with
    sequential tests, is where a candidate earns its promotion.

    Full-weight mode (one version in vLLM) evaluates stable while it serves, then *previews* the candidate: the
    reloader swaps vLLM's weights to it while the gateway holds user requests and lets only the gate's eval requests
    through (recorded as arm ``eval``); the verdict either keeps those weights for the blue/green switch (pass) or
    swaps stable back (fail). ``previewTimeoutSeconds`` bounds how long users can be held.
    """

    enabled: bool = True
    accept_rate_margin: float = Field(0.02, ge=0, le=1)
    accepted_per_100_margin: float = Field(2.0, ge=0)
    max_empty_rate: float = Field(0.9, ge=0, le=1)
    max_repetition_rate: float = Field(0.5, ge=0, le=1)
    min_suggestion_rate_ratio: float = Field(
        0.8, ge=0, le=1, description="Guardrail: candidate's shown / requests must be >= this x stable's."
    )
    min_accepted_chars_ratio: float = Field(
        0.75,
        ge=0,
        le=1,
        description="Guardrail: candidate's accepted characters per 100 requests must be >= this x stable's "
        "(a policy that only gets shorter or quieter must not pass). Lenient: eval figures are noisy.",
    )
    min_length_ratio: float = Field(0.25, ge=0, description="Guardrail: mean shown length >= this x stable's.")
    max_length_ratio: float = Field(4.0, ge=1, description="Guardrail: mean shown length <= this x stable's.")
    eval_samples: int = Field(64, ge=1)
    confidence: float = Field(
        0.95,
        ge=0.5,
        lt=1,
        description="A rate past its margin or floor (accept rate, accepted per 100 requests, suggestion rate, "
        "accepted characters) fails the gate only when P(candidate's rate below stable's) >= this: at evalSamples "
        "64 a candidate that loses 2 of ~7 accepts is noise, not a regression.",
    )
    preview_timeout_seconds: float = Field(
        180.0,
        gt=0,
        le=3600,
        description="Full-weight mode: longest time vLLM may hold a candidate for the gate's eval (user requests wait "
        "meanwhile, up to serving.requestTimeoutSeconds, then 503 + Retry-After); past it stable is restored and the "
        "gate retried later. Sized for CPU: a weight swap plus evalSamples requests.",
    )


class GuardrailConfig(_Section):
    """Live guardrails of the canary against reward hacking: figures the accept rate alone does not protect.

    A policy can raise its accept rate by suggesting less, or shorter, while helping users less. Each guardrail
    compares the candidate's figure with stable's over the same canary window. A point figure past its floor at a
    look blocks promotion. It rolls the candidate back once the breach is credible: its posterior probability passes
    the same alpha-spent bar as the accept-rate rollback, so a truly equal candidate is not rolled back on noise
    (mean shown length, which has no posterior, after ``breachLooks`` consecutive looks).
    """

    min_suggestion_rate_ratio: float = Field(
        0.8, ge=0, le=1, description="Candidate's shown / served must be >= this x stable's."
    )
    min_accepted_chars_ratio: float = Field(
        0.9,
        ge=0,
        le=1,
        description="Candidate's accepted characters per 100 served requests must be >= this x stable's.",
    )
    min_shown_length_ratio: float = Field(
        0.25,
        ge=0,
        le=1,
        description="Candidate's mean shown length (characters) must be >= this x stable's. A backstop against "
        "collapse only: learning where to stop shortens suggestions (run 6: 82.7 -> 22.2 chars, accept rate "
        "+114%); accepted characters per 100 requests is what keeps a shorter policy from winning on brevity.",
    )
    max_empty_rate_increase: float = Field(
        0.1, ge=0, le=1, description="Candidate's empty / (shown + empty) may exceed stable's by at most this."
    )
    breach_looks: int = Field(
        2, ge=1, description="Consecutive looks with the mean shown length below its floor before it is a rollback."
    )


class RolloutConfig(_Section):
    """Safe rollout: who is stable, who is the candidate, and how traffic is split.

    ``canary`` (default with ``serving.weightsMode: lora``): a loaded version must pass the eval gate, then earns
    traffic through the canary controller (promote / rollback). ``bluegreen`` (default with ``weightsMode: full``,
    which serves one version at a time): the eval gate, then the switch of all traffic to the candidate (policy
    ``canary_share`` 1), then a live watch window judged by the same decision function against a frozen snapshot of
    stable's figures, ending in keep (promote) or an automatic switch back (rollback); its gate evaluates a candidate
    vLLM does not hold yet in a *preview* (``gate.previewTimeoutSeconds``: the candidate's weights serve only the
    gate's eval requests while user requests wait; pass keeps them, fail swaps stable back). ``direct``: the reloader
    makes each loaded version stable at once, with nothing between a checkpoint and every user.

    The defaults let the local loop (2 CPU cores, a few requests per second) move within minutes while staying
    honest: every verdict is a Bayesian test at doubling looks with alpha spending, so the chance of ever promoting
    (or rolling back) a truly equal candidate stays below ``1 - promoteProbability`` whatever ``minSamples`` is.
    ``minSamples`` only sets the first look (and keeps the guardrails' point figures off tiny counts);
    ``minDwellSeconds`` makes the canary span a few minutes of traffic; ``canaryShare`` 0.25 gives the candidate
    enough traffic to reach a look quickly while three quarters of users stay on stable. On a busy cluster raise
    ``minDwellSeconds`` to span a traffic cycle (hours) and lower ``canaryShare`` to limit exposure.
    """

    strategy: Literal["direct", "canary", "bluegreen"] = Field(
        "canary",
        description="canary (two versions at once: LoRA), bluegreen (gate, switch everyone, watch, automatic "
        "switch back: the default for serving.weightsMode full), or direct (no gate, no watch).",
    )
    canary_share: float = Field(0.25, ge=0, le=1)
    pinned_version: int | None = Field(
        None,
        ge=0,
        description="Serve this version of the shared policy line to everyone on it (applied once per value; "
        "`onlinerl policy unpin` undoes it until the field changes). Project lines (projects.adapters) are pinned "
        "per project with `onlinerl policy --project P pin N`, never from here.",
    )
    rollback_to: int | None = Field(
        None,
        ge=0,
        description="Make this version stable and mark what it replaces rolled back (once per value). The shared "
        "line's only: a project line rolls back with `onlinerl policy --project P rollback N`.",
    )
    paused: bool = Field(
        False,
        description="Pause the shared line's promotions (false: resume, releasing a manual hold). Project lines are "
        "paused per project with `onlinerl policy --project P pause`.",
    )
    min_samples: int = Field(50, ge=1, description="Shown suggestions in the smaller arm before the first look.")
    min_dwell_seconds: float = Field(120.0, ge=0, description="Seconds a canary runs before any verdict.")
    promote_probability: float = Field(0.95, gt=0.5, lt=1)
    rollback_probability: float = Field(0.95, gt=0.5, lt=1)
    max_looks: int = Field(
        5,
        ge=0,
        le=10,
        description="The last look (look k at minSamples x 2^k shown per arm): a candidate still within noise there "
        "is inconclusive (see onInconclusive). Lower it where traffic is thin and versions come often (the cpu "
        "profile: 1).",
    )
    on_inconclusive: Literal["promote", "supersede"] = Field(
        "promote",
        description="A candidate still within noise at the last look: promote keeps it when it shows no sign of "
        "regression there (both rates' P(candidate >= stable) >= 0.5, no guardrail broken), as blue/green keeps a "
        "version at the end of its watch window: it passed the eval gate offline and live traffic found no "
        "regression (a 'kept' promotion, not a proven win). Otherwise, and always with supersede, it yields to a "
        "newer loaded version with no verdict on its quality.",
    )
    max_kept_in_a_row: int = Field(
        3,
        ge=0,
        le=100,
        description="Kept promotions (onInconclusive: promote, and blue/green's keep at the end of its watch: "
        "within noise, not a proven win) that may follow one another; past it only a proven win moves stable. A "
        "kept promotion must also not be credibly worse than the last proven stable's figures. Both stop small "
        "regressions, each within noise of the stable before it, from compounding. 0 = keep nothing.",
    )
    max_user_share: float = Field(
        0.25,
        gt=0,
        le=1,
        description="At each look, one user (API key) counts for at most this share of the look's shown "
        "suggestions (and of the requests they take) in an arm; a verdict must also hold with any one user left "
        "out. A look therefore needs at least 1 / maxUserShare users in each arm.",
    )
    few_users: Literal["wait", "decide"] = Field(
        "wait",
        description="A canary whose per-user ledgers hold fewer than 1 / maxUserShare users (a lone developer, a "
        "few teammates) never reaches a look under the per-user cap, and with users split by key one of its arms "
        "may get no traffic at all. wait (the default): such a canary holds, and `onlinerl status` says why. decide "
        "(the local stack's default: `onlinerl up` is one developer): once minSamples requests came from fewer "
        "users, the canary splits by request instead of by key (each request drawn, its record carrying the arm it "
        "was served under), and it is judged on its pooled counters: the eval gate, the doubling looks with alpha "
        "spending, the guardrails and the drift guard all still count, but not the per-user cap and leave-one-out "
        "check, which so few users cannot satisfy: any one of them can steer the verdict. Trust your few users "
        "before choosing it. A canary with 1 / maxUserShare users or more keeps every per-user rule either way.",
    )
    guardrails: GuardrailConfig = Field(default_factory=GuardrailConfig)
    gate: GateConfig = Field(default_factory=GateConfig)
    pod_template: PodTemplateFragment = pod_template_field()

    @property
    def controlled(self) -> bool:
        """Whether the rollout controller runs (canary, bluegreen); under ``direct`` the reloader decides alone."""
        return self.strategy != "direct"

    @property
    def few_users_below(self) -> int:
        """Users a canary's ledgers need before the per-user cap can let it reach a look: ``ceil(1 / maxUserShare)``.
        Fewer is a few-user canary (``fewUsers``)."""
        return math.ceil(1.0 / self.max_user_share - 1e-9)


class AutoscaleConfig(_Section):
    """Replicas follow load between ``minReplicas`` and ``maxReplicas`` (k8s; ``replicas`` is then the start only).

    ``metric``: ``load`` scales on the component's load metric per pod (serving: in-flight requests,
    ``onlinerl_serving_inflight_requests``; feedback: requests per second, the rate of
    ``onlinerl_feedback_responses_total``), through the HPA's Pods metric (custom.metrics.k8s.io, e.g.
    prometheus-adapter) or KEDA's Prometheus trigger; without either it falls back to CPU. ``cpu``: CPU utilization.
    """

    enabled: bool = False
    min_replicas: int = Field(1, ge=1, le=1000)
    max_replicas: int = Field(4, ge=1, le=1000)
    metric: Literal["load", "cpu"] = "load"
    target_load: float = Field(4.0, gt=0, description="Load per pod to hold: in-flight requests per serving pod.")
    target_cpu_utilization: int = Field(70, ge=1, le=100, description="Percent of the CPU request (metric cpu).")
    provider: Literal["auto", "hpa", "keda"] = Field(
        "auto", description="`auto`: a KEDA ScaledObject when keda.sh/v1alpha1 is served, else an HPA (autoscaling/v2)."
    )

    @model_validator(mode="after")
    def _bounds(self) -> AutoscaleConfig:
        if self.max_replicas < self.min_replicas:
            raise ValueError(f"maxReplicas ({self.max_replicas}) must be >= minReplicas ({self.min_replicas})")
        return self


class FeedbackAutoscaleConfig(AutoscaleConfig):
    """The feedback service's autoscaler: its load is requests per second per pod."""

    target_load: float = Field(20.0, gt=0, description="Requests per second per feedback pod to hold.")


class ComponentScalingConfig(_Section):
    """Autoscaling and disruption budget of one Deployment (serving or feedback)."""

    autoscale: AutoscaleConfig = Field(default_factory=AutoscaleConfig)
    max_unavailable: int = Field(
        1,
        ge=1,
        description="PodDisruptionBudget: pods a voluntary disruption (node drain) may take at once. Rendered when "
        "the component runs more than one replica (replicas or autoscale.minReplicas > 1).",
    )


class FeedbackScalingConfig(ComponentScalingConfig):
    autoscale: FeedbackAutoscaleConfig = Field(default_factory=FeedbackAutoscaleConfig)


class SpreadConfig(_Section):
    """topologySpreadConstraints of the serving and feedback pods: one per key, replicas spread across zones/nodes."""

    enabled: bool = True
    topology_keys: list[str] = Field(
        default_factory=lambda: ["topology.kubernetes.io/zone", "kubernetes.io/hostname"], max_length=8
    )
    max_skew: int = Field(1, ge=1)
    when_unsatisfiable: Literal["ScheduleAnyway", "DoNotSchedule"] = Field(
        "ScheduleAnyway", description="`ScheduleAnyway`: a preference (a one-zone cluster still schedules)."
    )


class ScalingConfig(_Section):
    """k8s: autoscalers, PodDisruptionBudgets and topology spread for the serving and feedback Deployments."""

    serving: ComponentScalingConfig = Field(default_factory=ComponentScalingConfig)
    feedback: FeedbackScalingConfig = Field(default_factory=FeedbackScalingConfig)
    spread: SpreadConfig = Field(default_factory=SpreadConfig)
    prometheus_url: str = Field(
        "",
        max_length=2048,
        description="Prometheus that KEDA's trigger queries for the load metric (e.g. "
        "http://prometheus-operated.monitoring:9090); empty: KEDA scales on CPU.",
    )


class IngressConfig(_Section):
    enabled: bool = False
    host: str = ""
    tls_secret: str = Field("", description="k8s: Secret with the TLS certificate for `host` (needs `host`).")
    class_name: str = ""
    annotations: dict[str, str] = Field(
        default_factory=dict,
        description="k8s: annotations of the Ingress (cert-manager's cluster-issuer, nginx's proxy-buffering: off "
        "for streamed completions, ...).",
    )


class MonitoringConfig(_Section):
    service_monitor: Literal["on", "off", "auto"] = "auto"
    labels: dict[str, str] = Field(
        default_factory=dict,
        description="k8s: extra labels of the ServiceMonitor and PodMonitor, for the Prometheus that selects them "
        "(kube-prometheus-stack: release: <its release name>).",
    )


class RetentionConfig(_Section):
    """How long each kind of data lives: the one place that says so (docs/architecture.md, "Data we keep"). Each kind
    is enforced by the component that owns it. ``redis.rolloutTtlSeconds`` and ``trainer.checkpoint.keep`` are the
    older spellings of two of these: unset here, the older field's value (its default: 1800 s, 5) holds; set here, it
    wins and the older field is overwritten with it, so every reader sees one value."""

    rollout_records_seconds: int | None = Field(
        None,
        ge=900,
        description="Rollout records (prompt, completion, token ids) expire this long after they were written "
        "(gateway: per-field TTL). Must outlive Continue's 10 s reject window by far. Unset: "
        "redis.rolloutTtlSeconds (1800).",
    )
    pending_samples_seconds: int = Field(
        7 * 24 * 3600,
        ge=3600,
        description="Training samples no trainer has acknowledged are deleted this long after they were appended "
        "(trainer, XTRIM MINID). Acknowledged samples are deleted as soon as a durable checkpoint holds them.",
    )
    audit_seconds: int = Field(
        30 * 24 * 3600,
        ge=3600,
        description="Audit entries are trimmed this long after they were written (every audit writer's XADD trims "
        "by age; the count cap of 100k entries stays).",
    )
    checkpoints_keep: int | None = Field(
        None,
        ge=1,
        description="Published versions kept on the checkpoint volume (trainer; versions serving uses stay). Unset: "
        "trainer.checkpoint.keep (5).",
    )


class PrivacyConfig(_Section):
    """What is screened before anything is stored or trained, and how long what is stored lives (issue 38)."""

    secret_screening: Literal["off", "audit", "block"] = Field(
        "audit",
        description="audit: a prompt or completion holding a credential (onlinerl/secret_scan.py) is served, recorded "
        "without its text and token ids, and its feedback audited `secret_detected`, never trained. block: as audit, "
        "and a prompt holding one is refused (400 `secret_in_prompt`) before it reaches the model. off: no screening.",
    )
    retention: RetentionConfig = Field(default_factory=RetentionConfig)


class ProjectsConfig(_Section):
    """Per-project adapters (issue 39, docs/per-project-adapters.md). A project is the tenant its API keys belong to.
    A project with its own adapter has its own policy line (``Keys.for_project``): its own version line and
    checkpoints, policy table, gate, canary, rollback, pin and hold. Every other project is served the shared
    policy. Off by default: one shared policy, as before."""

    adapters: Literal["off", "listed", "all"] = Field(
        "off",
        description="off: every project is served the shared policy. listed: the projects in `listed` get their own "
        "adapter once their traffic reaches minSamplesPerHour. all: every project does.",
    )
    listed: list[str] = Field(
        default_factory=list, max_length=1000, description="Projects (tenants) that get their own adapter."
    )
    min_samples_per_hour: int = Field(
        100,
        ge=0,
        description="A project stays on the shared policy until this many of its training samples arrived within "
        "one hour: below it, an adapter of its own would learn from too little and its canary could not decide.",
    )
    train_shared: bool = Field(
        False,
        description="Whether the samples of a project with its own adapter also train the shared policy. Off: that "
        "project's code never reaches another project's policy (the isolation promise).",
    )

    @field_validator("listed")
    @classmethod
    def _listed_are_tenants(cls, v: list[str]) -> list[str]:
        for name in v:
            problem = tenant_problem(name)
            if problem:
                raise ValueError(problem)
        if len(set(v)) != len(v):
            raise ValueError("a project is listed twice: list each project once")
        return v

    def has_own_line(self, project: str) -> bool:
        """Whether ``project`` may get an adapter of its own (its traffic threshold is the trainer's to check)."""
        return self.adapters == "all" or (self.adapters == "listed" and project in self.listed)


class OnlineRLConfig(_Section):
    """The whole configuration: one object, one shape, for every component and for the CRD spec."""

    job: str = Field("local", pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", max_length=48)
    profile: Literal["auto", "cpu", "none"] = Field(
        "auto",
        description="Hardware profile `onlinerl up` applies to the fields a config leaves unset "
        "(onlinerl/profiles.py): auto = cpu when the machine has no GPU (last-8-layer LoRA, one trainer thread, "
        "1024-token context, 4 PPO epochs at lr 2e-4, a version every 2 steps), else none (the documented "
        "defaults). Not applied on Kubernetes.",
    )
    model: ModelConfig = Field(default_factory=ModelConfig)
    redis: RedisConfig = Field(default_factory=RedisConfig)
    auth: AuthConfig = Field(default_factory=AuthConfig)
    serving: ServingConfig = Field(default_factory=ServingConfig)
    feedback: FeedbackConfig = Field(default_factory=FeedbackConfig)
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    storage: StorageConfig = Field(default_factory=StorageConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    ingress: IngressConfig = Field(default_factory=IngressConfig)
    monitoring: MonitoringConfig = Field(default_factory=MonitoringConfig)
    scaling: ScalingConfig = Field(default_factory=ScalingConfig)
    images: ImagesConfig = Field(default_factory=ImagesConfig)
    pod_template: PodTemplateFragment = pod_template_field()

    privacy: PrivacyConfig = Field(default_factory=PrivacyConfig)
    projects: ProjectsConfig = Field(default_factory=ProjectsConfig)

    @model_validator(mode="after")
    def _one_retention(self) -> OnlineRLConfig:
        """``privacy.retention`` is where retention is stated; ``redis.rolloutTtlSeconds`` and
        ``trainer.checkpoint.keep`` are older spellings of two of its fields. Set in ``privacy.retention``, the value
        wins and the older field is overwritten with it; unset, the older field's value is copied in. Either way both
        hold one value. (No refusal when both are given: on Kubernetes the API server fills the older field's
        default into every spec.)"""
        retention = self.privacy.retention
        if retention.rollout_records_seconds is None:
            retention.rollout_records_seconds = self.redis.rollout_ttl_seconds
        self.redis.rollout_ttl_seconds = retention.rollout_records_seconds
        if retention.checkpoints_keep is None:
            retention.checkpoints_keep = self.trainer.checkpoint.keep
        self.trainer.checkpoint.keep = retention.checkpoints_keep
        return self

    @model_validator(mode="after")
    def _trainer_takes_what_is_served(self) -> OnlineRLConfig:
        """vLLM serves prompt + completion up to model.maxModelLen; the trainer never cuts a sample, so a shorter
        trainer.maxSeqLen would silently drop every long-context rollout."""
        if self.trainer.max_seq_len < self.model.max_model_len:
            raise ValueError(
                f"trainer.maxSeqLen ({self.trainer.max_seq_len}) is less than model.maxModelLen "
                f"({self.model.max_model_len}): samples longer than trainer.maxSeqLen are dropped, never cut, so "
                "set trainer.maxSeqLen >= model.maxModelLen (or lower model.maxModelLen)"
            )
        return self

    @model_validator(mode="after")
    def _strategy_fits_weights_mode(self) -> OnlineRLConfig:
        """Full-weight serving holds one version per vLLM, so it cannot split traffic between two: a canary there
        would be silently skipped. An explicit ``canary`` is refused (naming ``bluegreen``, which fits); the default
        resolves to ``bluegreen``: the gate, the switch of everyone, a live watch and automatic switch back."""
        if self.serving.weights_mode == "full" and self.rollout.strategy == "canary":
            if "strategy" in self.rollout.model_fields_set:
                raise ValueError(
                    "rollout.strategy: canary needs two versions served at once, but serving.weightsMode: full holds "
                    "one version per vLLM: set rollout.strategy: bluegreen (eval gate, switch of all traffic, live "
                    "watch against stable's figures, automatic switch back on a regression), or direct (no gate), "
                    "or serving.weightsMode: lora for a canary"
                )
            self.rollout.strategy = "bluegreen"
        return self

    def dump(self) -> dict[str, Any]:
        """The camelCase form, as YAML/CRD spec would hold it."""
        return self.model_dump(by_alias=True, mode="json")


def _format_validation_error(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        path = ".".join(str(p) for p in e["loc"]) or "<root>"
        if not e["loc"]:  # a cross-field rule: its message names the fields; its input would be the whole config
            lines.append(e["msg"].removeprefix("Value error, "))
            continue
        lines.append(f"{path}: {e['msg']} (got {e.get('input')!r})")
    return "invalid onlinerl configuration:\n  " + "\n  ".join(lines)


def _set_path(tree: dict[str, Any], path: list[str], value: Any) -> None:
    node = tree
    for part in path[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"{'.'.join(path)}: cannot set a field below a scalar")
    node[path[-1]] = value


def _env_key_to_path(key: str) -> list[str]:
    """``ONLINERL__SERVING__MAX_TOKENS_CAP`` -> ``['serving', 'maxTokensCap']``."""
    parts = key[len(ENV_PREFIX) :].split("__")
    return [to_camel(p.lower()) for p in parts if p]


def env_overrides(environ: dict[str, str] | None = None) -> dict[str, Any]:
    """Nested dict of every ``ONLINERL__*`` variable, each value parsed as YAML (``3``, ``true``, ``[a, b]``)."""
    environ = dict(os.environ if environ is None else environ)
    tree: dict[str, Any] = {}
    for key, raw in sorted(environ.items()):
        if not key.startswith(ENV_PREFIX):
            continue
        try:
            value = yaml.safe_load(raw) if raw != "" else ""
        except yaml.YAMLError as exc:
            raise ConfigError(f"{key}: not a valid YAML value: {exc}") from exc
        _set_path(tree, _env_key_to_path(key), value)
    return tree


def _deep_merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in override.items():
        out[k] = _deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def from_mapping(data: dict[str, Any]) -> OnlineRLConfig:
    """Validate a camelCase mapping (a YAML file or an OnlineRLJob spec)."""
    try:
        return OnlineRLConfig.model_validate(data)
    except ValidationError as err:
        raise ConfigError(_format_validation_error(err)) from None


def _the_config_document(path: Path, documents: list[Any]) -> Any:
    """A file of several YAML documents is a manifest set (the examples: a Secret, then the OnlineRLJob): its one
    OnlineRLJob is the config."""
    if len(documents) <= 1:
        return documents[0] if documents else {}
    jobs = [d for d in documents if isinstance(d, dict) and d.get("kind") == "OnlineRLJob"]
    if len(jobs) != 1:
        raise ConfigError(
            f"config file {path} holds {len(documents)} YAML documents and {len(jobs)} OnlineRLJob: give one config "
            "mapping, or manifests with exactly one OnlineRLJob"
        )
    return jobs[0]


def load_config(path: str | Path | None = None, environ: dict[str, str] | None = None) -> OnlineRLConfig:
    """YAML file (``path`` or ``$ONLINERL_CONFIG``) overlaid with ``ONLINERL__*`` variables, validated."""
    env = dict(os.environ if environ is None else environ)
    path = path or env.get(CONFIG_ENV) or None
    data: dict[str, Any] = {}
    if path:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {p} does not exist")
        try:
            documents = [d for d in yaml.safe_load_all(p.read_text()) if d is not None]
        except yaml.YAMLError as exc:
            raise ConfigError(f"config file {p} is not valid YAML: {exc}") from exc
        loaded = _the_config_document(p, documents)
        if not isinstance(loaded, dict):
            raise ConfigError(f"config file {p} must hold a mapping at the top level")
        data = loaded.get("spec", loaded) if loaded.get("kind") == "OnlineRLJob" else loaded
    return from_mapping(_deep_merge(data, env_overrides(env)))
