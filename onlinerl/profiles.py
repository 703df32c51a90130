"""Hardware profiles: the defaults that depend on the machine, chosen by the product, not by a demo file.

``onlinerl up`` looks for a GPU; finding none it applies the ``cpu`` profile to every field the configuration did
not set (an explicit value always wins). Pure: a config and a choice in, a config out.

Why each ``cpu`` value (docs/demo.md, "Configuration of the demonstration"; measured on 2 cores, SmolLM2-135M):

* ``trainer.lora.lastLayers: 8``: the adapter covers the last 8 layers, so the backward pass stops there
  (1.6x faster steps: 15.6 s -> 9.7 s for 8 x 320 tokens on one thread). Where a suggestion stops is decided near
  the output, which is what the policy learns first.
* ``trainer.torchThreads: 1``: locally the trainer shares the machine's cores with vLLM; more threads only contend.
* ``model.maxModelLen: 1024`` (``trainer.maxSeqLen`` follows): CPU attention and the trainer's activations grow with
  the context; an editor's prefix and suffix around the cursor fit in 1024 tokens.
* ``trainer.batchTimeoutSeconds: 20``: a CPU machine serves ~20 requests a minute, so an update closes on this
  timeout, not on ``batchSize``, and the timeout sets how often the policy moves. At 60 the trainer idled three
  quarters of the hour (run 14: 44 updates of ~5 samples); at 20 it made 119 updates of the same samples (run 15)
  and the held-out suggestions shortened twice as far (docs/demo.md, run 15).
* ``trainer.checkpoint.everySteps: 2`` / ``everySeconds: 120``: each published version costs serving a LoRA load, so
  versions come every two steps (run 15: a version every ~60 s, 0 failed requests).
* ``trainer.algorithm.ppoEpochs: 4``, ``learningRate: 2e-4``: with a few samples a minute, each is reused four times;
  from the second epoch the PPO clip stops pushing a token already past its bound (in the first the ratio is 1 and
  no clip acts: each epoch is one AdamW step of at most lr per parameter, loss.py "What bounds one update"; run 5 at
  2 epochs and 1e-4 moved nothing in 11 minutes).
* ``trainer.algorithm.negativeSampleRate: 0.05``: under the product's reward every reject carries gradient, and
  ~90% of events are rejects. Training all of them, the trainer kept up with a quarter of the traffic (a 53-minute
  run: 464 of ~2,000 samples trained, a backlog of ~570 growing all run, so it trained on ever older samples and
  saw a quarter of the accepts). A reject is trained with probability 0.05 (every accept is), so the trainer's
  passes go to the accepts. Each kept reject carries negativeWeight / rate of its advantage
  (advantages.subsample_negatives); the product's ``negativeWeight`` is 0.05 (not the profile's business; loss.py
  says why), so a kept reject carries its own advantage. At weight 1 a kept reject carried 1/rate of it and the
  rejects' noise drowned the accepts (docs/demo.md, offline screen); at rate and weight 0.15 (until run 16) 73% of
  the trained samples were rejects, at 0.05 38%, and the policy learned further (run 16).
* ``rollout.canaryShare: 0.5``, ``rollout.maxLooks: 1``: at ~30 requests a minute and a new version every few
  minutes, a 25% canary needs ~7 minutes to reach its first look (50 shown) and a within-noise candidate held the
  canary for the whole hour (max looks 5: 1,600 shown per arm), so the newer, better-trained versions never got
  traffic. Half the traffic reaches look 0 in ~2 minutes and look 1 in ~4; a candidate still within noise then is
  kept if it shows no sign of regression (``rollout.onInconclusive: promote``, a "kept" promotion that says it is no
  proven win), else it yields to the newest loaded version. The test for a *win* at each look is unchanged (alpha
  spent over the looks): fewer looks never make a proven win easier.
* ``rollout.minSamples: 30``, ``rollout.gate.evalSamples: 32``: on 2 cores a candidate's cycle was ~7 minutes of
  gate (64 held-out requests beside the users' traffic) and ~10 of canary (100 shown per arm at ~20 requests a
  minute) before its verdict, so users met at most three trained versions in an hour and the accepts that teach
  most stayed scarce (runs 8, 10, 11: nothing promoted). The gate is a screen for broken policies (empty,
  repetitive, far shorter) and, since its credibility rule, 64 records could not fail a near-equal candidate either;
  32 screen the same at half the cost. A first look at 30 shown keeps the alpha spending (a win is no easier to
  prove) and lets a within-noise candidate without a sign of regression through in about half the time.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

from onlinerl.config import OnlineRLConfig

Profile = Literal["cpu", "none"]

CPU_PROFILE: dict[str, Any] = {
    "model.maxModelLen": 1024,
    "trainer.maxSeqLen": 1024,
    "trainer.torchThreads": 1,
    "trainer.batchTimeoutSeconds": 20.0,
    "trainer.lora.lastLayers": 8,
    "trainer.algorithm.learningRate": 2e-4,
    "trainer.algorithm.ppoEpochs": 4,
    "trainer.algorithm.negativeSampleRate": 0.05,
    "trainer.checkpoint.everySteps": 2,
    "trainer.checkpoint.everySeconds": 120.0,
    "rollout.canaryShare": 0.5,
    "rollout.maxLooks": 1,
    "rollout.minSamples": 30,
    "rollout.gate.evalSamples": 32,
}

PROFILES: dict[str, dict[str, Any]] = {"cpu": CPU_PROFILE, "none": {}}


def gpu_present(dev: Path = Path("/dev")) -> bool:
    """An NVIDIA device node (the driver is loaded), or a device list from the environment (CUDA_VISIBLE_DEVICES
    naming a device). Cheap: no torch import in the CLI."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "-1"):
        return False
    return (dev / "nvidiactl").exists() or any(dev.glob("nvidia[0-9]*"))


def select_profile(cfg: OnlineRLConfig, has_gpu: bool) -> Profile:
    """``profile: auto`` -> ``cpu`` when the machine has no GPU, else ``none`` (the documented defaults)."""
    if cfg.profile != "auto":
        return cfg.profile
    return "none" if has_gpu else "cpu"


def _was_set(cfg: OnlineRLConfig, path: list[str]) -> bool:
    """Whether the configuration set this field itself (file, variables), rather than taking its default."""
    node: Any = cfg
    for part in path:
        name = _field_name(node, part)
        if name not in node.model_fields_set:
            return False
        node = getattr(node, name)
    return True


def _field_name(model: Any, alias: str) -> str:
    for name, info in type(model).model_fields.items():
        if alias in (name, info.alias):
            return name
    raise KeyError(f"{type(model).__name__} has no field {alias!r}")


def apply_profile(cfg: OnlineRLConfig, profile: Profile) -> tuple[OnlineRLConfig, dict[str, Any]]:
    """The config with the profile's value in every field it did not set, and the values applied (for the log)."""
    applied: dict[str, Any] = {}
    # Only what the config set, plus the profile's values: every other field stays unset in the result, so a later
    # step can still tell a default from a choice (the local stack lifts the per-key hourly limit only when unset).
    data = cfg.model_dump(by_alias=True, mode="json", exclude_unset=True)
    for dotted, value in PROFILES[profile].items():
        path = dotted.split(".")
        if _was_set(cfg, path):
            continue
        if dotted == "trainer.maxSeqLen" and _was_set(cfg, ["model", "maxModelLen"]):
            value = max(value, cfg.model.max_model_len)  # the trainer takes whatever the user lets vLLM serve
        node = data
        for part in path[:-1]:
            node = node.setdefault(part, {})
        node[path[-1]] = value
        applied[dotted] = value
    out = OnlineRLConfig.model_validate(data)
    out.profile = profile
    return out, applied


def with_local_profile(cfg: OnlineRLConfig, has_gpu: bool | None = None) -> OnlineRLConfig:
    """What ``onlinerl up`` runs: the profile this machine selects, applied, and said on stderr."""
    import sys

    profile = select_profile(cfg, gpu_present() if has_gpu is None else has_gpu)
    out, applied = apply_profile(cfg, profile)
    if applied:
        shown = ", ".join(f"{k}={v}" for k, v in applied.items())
        print(f"hardware profile {profile} (no GPU found or profile set): {shown}", file=sys.stderr, flush=True)
    return out
