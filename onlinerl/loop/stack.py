"""``onlinerl up``: the whole loop on one machine, on embedded defaults.

Order: valkey (persistent) -> model bootstrap -> data set -> API key -> vLLM -> gateway, reloader, feedback, trainer
(-> rollout controller unless ``rollout.strategy: direct``). Each step waits on a health check with a deadline and
fails with the child's log tail. Logs go to ``<state>/logs/``. Once up, a child that dies is restarted with backoff
(:class:`onlinerl.procs.Supervisor`); only repeated quick deaths stop the stack. Ctrl-C stops everything in reverse
order. State (Redis data, checkpoints, keys, the Redis users' passwords) lives in ``<state>/``, so starting again
resumes the last policy version and the unconsumed samples. The embedded valkey runs with one ACL user per component
(onlinerl.dataplane.acl): each child gets its own Redis URL in ``ONLINERL__REDIS__URL``; config.yaml holds ``admin``'s,
for the CLI.
"""

from __future__ import annotations

import json
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from onlinerl import ports
from onlinerl.auth import new_api_key, write_keys_file
from onlinerl.config import OnlineRLConfig
from onlinerl.dataplane.contract import Component
from onlinerl.procs import Child, StartupError, Supervisor, python_module
from onlinerl.redisconn import redacted
from onlinerl.valkey import EmbeddedValkey, RedisUsers, ensure_users_file

DEMO_TENANT = "demo"
# Each local child's Redis user (the reloader is part of a serving pod in Kubernetes, so it is ``serving`` too).
CHILD_USERS = {
    "gateway": Component.SERVING,
    "reloader": Component.SERVING,
    "feedback": Component.FEEDBACK,
    "trainer": Component.TRAINER,
    "rollout": Component.ROLLOUT,
}


@dataclass(frozen=True)
class LocalPorts:
    """Ports of the processes whose port is not part of the job config (k8s gives each its own pod)."""

    redis: int = 16379
    reloader: int = ports.RELOADER
    rollout: int = ports.ROLLOUT


@dataclass
class StackPaths:
    state: Path

    @property
    def logs(self) -> Path:
        return self.state / "logs"

    @property
    def config(self) -> Path:
        return self.state / "config.yaml"

    @property
    def keys(self) -> Path:
        return self.state / "keys.yaml"

    @property
    def data(self) -> Path:
        return self.state / "data"

    @property
    def valkey(self) -> Path:
        return self.state / "valkey"

    @property
    def redis_users(self) -> Path:
        """Each component's Redis password (YAML, mode 0600)."""
        return self.state / "redis-users.yaml"


def start_valkey(paths: StackPaths, job: str, port: int) -> EmbeddedValkey:
    """The embedded valkey of ``paths``, durable, with one ACL user per component (passwords kept in the state)."""
    users = RedisUsers(job, ensure_users_file(paths.redis_users))
    return EmbeddedValkey(paths.valkey, port=port, users=users).start()


def say(msg: str) -> None:
    print(f"[up] {msg}", file=sys.stderr, flush=True)


def ensure_demo_key(paths: StackPaths, role: str = "user") -> str:
    """The demo tenant's API key of ``role``: a ``user`` key for Continue and `onlinerl simulate`, an ``eval`` key
    for `onlinerl eval` and the rollout gate (they pin versions, which a user key may not). Created once, reused on
    every start; a keys file from before roles (one plain key) gains its eval key."""
    entries: list = []
    if paths.keys.is_file():
        data = yaml.safe_load(paths.keys.read_text()) or {}
        entries = list(((data.get("tenants") or {}).get(DEMO_TENANT) or {}).get("keys") or [])
    by_role: dict[str, str] = {}
    for item in entries:
        key, item_role = (item, "user") if isinstance(item, str) else (item.get("key"), item.get("role", "user"))
        by_role.setdefault(item_role, key)
    if "user" not in by_role or "eval" not in by_role:
        if "user" not in by_role:
            by_role["user"] = new_api_key()
            entries.insert(0, by_role["user"])
        if "eval" not in by_role:
            by_role["eval"] = new_api_key("orl-eval")
            entries.append({"key": by_role["eval"], "role": "eval"})
        write_keys_file(paths.keys, {DEMO_TENANT: entries})
    return by_role[role]


def effective_config(cfg: OnlineRLConfig, paths: StackPaths, redis_url: str, model_path: Path) -> OnlineRLConfig:
    """The config every child reads: embedded Redis URL, resolved model folder, local keys and checkpoint paths."""
    data = cfg.dump()
    data["redis"]["url"] = redis_url
    data["model"]["path"] = str(model_path)
    data["auth"]["apiKeysFile"] = str(paths.keys.resolve())
    if "max_samples_per_user_per_hour" not in cfg.feedback.limits.model_fields_set:
        # `onlinerl simulate` sends every simulated user through the one demo key: a per-key hourly limit would
        # throttle the simulation, not a person. Set feedback.limits.maxSamplesPerUserPerHour to have one locally.
        data["feedback"]["limits"]["maxSamplesPerUserPerHour"] = 0
    ckpt = Path(data["storage"]["checkpointDir"])
    if not ckpt.is_absolute():
        data["storage"]["checkpointDir"] = str((paths.state / "checkpoints").resolve())
    return OnlineRLConfig.model_validate(data)


def continue_template_lines(template) -> str:
    """Continue picks its FIM template by model name; for a model it cannot recognise, say the template and stops."""
    if template.name == "qwen":
        return ""  # Continue recognises Qwen-coder names and renders exactly this template itself
    if template.prefix_only:
        tpl = "{{{prefix}}}"
    elif template.suffix_first:
        tpl = f"{template.begin}{{{{{{suffix}}}}}}{template.hole}{{{{{{prefix}}}}}}"
    else:
        tpl = f"{template.begin}{{{{{{prefix}}}}}}{template.hole}{{{{{{suffix}}}}}}{template.end}"
    stops = ", ".join(json.dumps(s) for s in template.stop)
    return (
        f"    promptTemplates:\n      autocomplete: {json.dumps(tpl)}\n"
        f"    defaultCompletionOptions:\n      maxTokens: 64\n      stop: [{stops}]\n"
    )


def continue_snippet(cfg: OnlineRLConfig, api_key: str, host: str = "127.0.0.1") -> str:
    """Ready-to-paste ~/.continue/config.yaml: the autocomplete model plus completion tracking."""
    from onlinerl.loop.template import template_for

    return f"""models:
  - name: onlinerl-autocomplete
    provider: openai
    model: {cfg.model.served_name}
    apiBase: http://{host}:{cfg.serving.port}/v1
    apiKey: {api_key}
    roles:
      - autocomplete
{continue_template_lines(template_for(cfg, None))}tabAutocompleteOptions:
  enableCompletionTracking: true
  completionTrackingUrl: http://{host}:{cfg.feedback.port}/api/training/submit
  completionTrackingHeaders:
    Authorization: "Bearer {api_key}"
    X-Project-ID: "{DEMO_TENANT}"
"""


@dataclass
class Stack:
    """The running local stack: children in start order, stopped in reverse."""

    cfg: OnlineRLConfig
    paths: StackPaths
    valkey: EmbeddedValkey | None = None
    children: list[Child] = field(default_factory=list)
    api_key: str = ""

    def child_env(self, name: str = "") -> dict[str, str]:
        env = {
            "ONLINERL_CONFIG": str(self.paths.config.resolve()),
            "OMP_NUM_THREADS": "1",
            "TOKENIZERS_PARALLELISM": "false",
        }
        url = self.redis_url_for(name)
        if url:
            env["ONLINERL__REDIS__URL"] = url
        return env

    def redis_url_for(self, name: str) -> str:
        """Child ``name``'s own Redis URL under the embedded valkey's ACL users; "" otherwise (config's URL)."""
        if self.valkey is None or self.valkey.users is None or name not in CHILD_USERS:
            return ""
        return self.valkey.url_for(CHILD_USERS[name])

    def start_child(
        self, name: str, module: str, health_url: str, timeout: float, extra_env: dict | None = None
    ) -> Child:
        say(f"starting {name} (log: {self.paths.logs / (name + '.log')})")
        child = Child(
            name,
            python_module(module),
            self.paths.logs / f"{name}.log",
            env={**self.child_env(name), **(extra_env or {})},
        )
        self.children.append(child.start())
        child.wait_healthy(health_url, timeout)
        say(f"{name} healthy")
        return child

    def start_engine(self, model_path: Path, timeout: float = 600) -> Child:
        """vLLM as ``python -m onlinerl_serving.engine`` (which execs vLLM with the serving package's own recipe):
        a child process, so the shared library starts the engine without importing serving code."""
        port = int(self.cfg.serving.engine_url.rsplit(":", 1)[1].split("/")[0])
        argv = python_module(
            "onlinerl_serving.engine",
            *("--config", str(self.paths.config.resolve()), "--model", str(model_path), "--port", str(port)),
            *("--cache-dir", str(self.paths.logs.resolve())),
        )
        child = Child("vllm", argv, self.paths.logs / "vllm.log")
        self.children.append(child.start())  # appended first: a failed start is stopped with the rest
        return child.wait_healthy(f"http://127.0.0.1:{port}/v1/models", timeout)

    def stop(self) -> None:
        for child in reversed(self.children):
            if child.alive():
                say(f"stopping {child.name}")
                child.stop()
        self.children.clear()
        if self.valkey is not None:
            say("stopping valkey")
            self.valkey.stop()
            self.valkey = None

    def dead_child(self) -> Child | None:
        return next((c for c in self.children if not c.alive()), None)


def start_stack(
    cfg: OnlineRLConfig,
    state: Path,
    *,
    build_data: bool = True,
    ports: LocalPorts = LocalPorts(),
    on_step: Callable[[str], None] = say,
) -> Stack:
    """Start every component and return the running :class:`Stack` (the caller stops it)."""
    from onlinerl.model import resolve_model_path

    paths = StackPaths(state)
    paths.logs.mkdir(parents=True, exist_ok=True)
    stack = Stack(cfg, paths)
    try:
        redis_url = cfg.redis.url
        if not redis_url:
            on_step(f"starting embedded valkey (data: {paths.valkey}, AOF fsync always, one ACL user per component)")
            stack.valkey = start_valkey(paths, cfg.job, ports.redis)
            redis_url = stack.valkey.url  # admin's: the CLI reads it from config.yaml; each child gets its own
        on_step("model: bootstrapping / verifying")
        model_path = resolve_model_path(cfg.model.path, progress=lambda m: on_step(f"model: {m}"))
        if build_data and not (paths.data / "train.jsonl").is_file():
            from onlinerl.data.builder import BuildOptions, build, write_jsonl

            on_step("building the FIM data set from the standard library")
            train, test = build(BuildOptions())
            write_jsonl(train, paths.data / "train.jsonl")
            write_jsonl(test, paths.data / "test.jsonl")
        stack.api_key = ensure_demo_key(paths)
        stack.cfg = effective_config(cfg, paths, redis_url, model_path)
        paths.config.write_text(yaml.safe_dump(stack.cfg.dump(), sort_keys=False))
        paths.config.chmod(0o600)  # the Redis URL in it carries the password
        on_step("starting vLLM (about a minute on CPU)")
        stack.start_engine(model_path)
        on_step("vLLM healthy")
        c = stack.cfg
        stack.start_child("gateway", "onlinerl_serving.gateway", f"http://127.0.0.1:{c.serving.port}/healthz", 60)
        stack.start_child(
            "reloader",
            "onlinerl_serving.reloader",
            f"http://127.0.0.1:{ports.reloader}/healthz",
            60,
            {"ONLINERL_RELOADER_PORT": str(ports.reloader)},
        )
        stack.start_child("feedback", "onlinerl_feedback", f"http://127.0.0.1:{c.feedback.port}/healthz", 60)
        stack.start_child("trainer", "onlinerl_trainer", f"http://127.0.0.1:{c.trainer.metrics_port}/healthz", 180)
        if c.rollout.controlled:
            stack.start_child(
                "rollout",
                "onlinerl_rollout",
                f"http://127.0.0.1:{ports.rollout}/healthz",
                60,
                {
                    "ONLINERL_ROLLOUT_PORT": str(ports.rollout),
                    "ONLINERL_ROLLOUT_EVALUATOR": "onlinerl_rollout.gate_eval:evaluate",
                    "ONLINERL_EVAL_DATA": str((paths.data / "test.jsonl").resolve()),
                },
            )
    except BaseException:
        stack.stop()
        raise
    return stack


def banner(stack: Stack) -> str:
    c = stack.cfg
    return f"""
onlinerl is up.
  completions   http://127.0.0.1:{c.serving.port}/v1/completions
  feedback      http://127.0.0.1:{c.feedback.port}/api/training/submit
  metrics       gateway :{c.serving.port}/metrics  feedback :{c.feedback.port}/metrics
                trainer :{c.trainer.metrics_port}/metrics
  redis         {redacted(c.redis.url)}
  logs          {stack.paths.logs}
  demo API key  {stack.api_key}   (project: {DEMO_TENANT})

Paste into ~/.continue/config.yaml:
{continue_snippet(c, stack.api_key)}
Try it:     onlinerl simulate --requests 50
Live view:  onlinerl status
Stop:       Ctrl-C
"""


def run_forever(stack: Stack, poll_s: float = 1.0, supervisor: Supervisor | None = None) -> int:
    """Block until Ctrl-C/SIGTERM; a child that dies is restarted with backoff (and a line saying so). Only a child
    that keeps dying soon after each start stops everything (exit 1, with its log tail). Always stops everything."""
    stopping = {"flag": False}
    from onlinerl.loop.valkey_child import ValkeyChild

    valkey = [ValkeyChild(stack.valkey)] if stack.valkey is not None else []  # first: everything else needs it
    supervisor = supervisor or Supervisor([*valkey, *stack.children], say)

    def _term(*_: object) -> None:
        stopping["flag"] = True

    signal.signal(signal.SIGTERM, _term)
    signal.signal(signal.SIGINT, _term)  # also when started in the background, where SIGINT is inherited as ignored
    try:
        while not stopping["flag"]:
            fatal = supervisor.poll()
            if fatal is not None:
                say(fatal)
                return 1
            time.sleep(poll_s)
    except KeyboardInterrupt:
        say("Ctrl-C: shutting down")
    finally:
        stack.stop()
    return 0


__all__ = ["Stack", "StackPaths", "StartupError", "banner", "continue_snippet", "run_forever", "start_stack"]
