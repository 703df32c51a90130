"""``onlinerl up``: the whole loop on one machine, on embedded defaults.

Order: valkey (persistent) -> model bootstrap -> data set -> API key -> vLLM -> gateway, reloader, feedback, trainer
(-> rollout controller unless ``rollout.strategy: direct``). Each step waits on a health check with a deadline and
fails with the child's log tail. Logs go to ``<state>/logs/``. Once up, a child that dies is restarted with backoff
(:class:`onlinerl.procs.Supervisor`); only repeated quick deaths stop the stack. Ctrl-C stops every child at once,
then valkey. State (Redis data, checkpoints, keys, the Redis users' passwords) lives in ``<state>/``, so starting again
resumes the last policy version and the unconsumed samples. The embedded valkey runs with one ACL user per component
(onlinerl.dataplane.acl): each child gets its own Redis URL in ``ONLINERL__REDIS__URL``; config.yaml holds ``admin``'s,
for the CLI.
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from onlinerl import compile_cache, ports
from onlinerl.auth import new_api_key, write_keys_file
from onlinerl.config import OnlineRLConfig
from onlinerl.continue_config import CONFIG_PATH, continue_config
from onlinerl.dataplane.contract import Component
from onlinerl.portcheck import STATE_ENV, CannotListen, busy_ports, describe
from onlinerl.procs import Child, StartupError, Supervisor, python_module, stop_all
from onlinerl.redisconn import redacted
from onlinerl.secretfile import write_secret
from onlinerl.valkey import EmbeddedValkey, RedisUsers, ensure_users_file

DEMO_TENANT = "demo"
# Each local child's Redis user: the gateway and the reloader have their own, as in a Kubernetes serving pod.
CHILD_USERS = {
    "gateway": Component.GATEWAY,
    "reloader": Component.RELOADER,
    "feedback": Component.FEEDBACK,
    "trainer": Component.TRAINER,
    "rollout": Component.ROLLOUT,
}


REPLICA_ENV = "ONLINERL_REPLICA"  # each serving replica's id: the pod name in Kubernetes, local-<i> here


@dataclass(frozen=True)
class LocalPorts:
    """Ports of the processes whose port is not part of the job config (k8s gives each its own pod).

    With N > 1 serving replicas, replica i listens on ``replica_base + 10 i`` (gateway), ``+ 1`` (vLLM) and ``+ 2``
    (reloader), all on loopback; the configured gateway port is then the balancer's. ``replica_base = 0`` takes free
    ports instead (tests)."""

    redis: int = 16379
    reloader: int = ports.RELOADER
    rollout: int = ports.ROLLOUT
    replica_base: int = ports.REPLICA_BASE


@dataclass(frozen=True)
class ServingReplica:
    """One local serving replica: its id (``ONLINERL_REPLICA``) and the loopback ports of its three processes."""

    replica_id: str
    index: int
    gateway: int
    engine: int
    reloader: int

    @property
    def gateway_url(self) -> str:
        return f"http://127.0.0.1:{self.gateway}"

    def suffix(self, single: bool) -> str:
        """Child-name suffix: none for the one-replica stack (names, logs and ports exactly as before), ``-<i>``."""
        return "" if single else f"-{self.index}"

    def env(self, single: bool) -> dict[str, str]:
        """What makes a gateway/reloader/vLLM this replica's: its id, and (N > 1) its own ports on loopback."""
        env = {REPLICA_ENV: self.replica_id}
        if not single:
            env |= {
                "ONLINERL__SERVING__HOST": "127.0.0.1",
                "ONLINERL__SERVING__PORT": str(self.gateway),
                "ONLINERL__SERVING__ENGINE_URL": f"http://127.0.0.1:{self.engine}",
            }
        return env


CPU_BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"  # vLLM-CPU: which cores its worker's OpenMP threads are pinned to


def engine_cpu_binding(index: int, replicas: int, cores: list[int], environ: dict[str, str]) -> dict[str, str]:
    """The core binding of replica ``index``'s vLLM on CPU: with N > 1 local replicas, each its own core in turn.

    vLLM-CPU's default (``auto``) pins every engine's worker to the first core of the NUMA node, so two local engines
    shared core 0 while core 1 stayed idle: a request on one replica right after the other had served waited ~1 s
    (bench/replicas.py, 2026-11-26: ~40 % of requests through a gateway). One replica keeps vLLM's default; a
    binding the user set is kept; vLLM on a GPU does not read it."""
    if replicas <= 1 or CPU_BIND_ENV in environ or not cores:
        return {}
    return {CPU_BIND_ENV: str(cores[index % len(cores)])}


def with_serving_replicas(cfg: OnlineRLConfig, n: int) -> OnlineRLConfig:
    """``cfg`` with ``serving.replicas = n`` (``onlinerl up --serving-replicas``): 1 to 16, one vLLM each."""
    from onlinerl.errors import CommandError

    if not 1 <= n <= 16:
        raise CommandError(f"--serving-replicas {n}: give 1 to 16 (each replica runs its own vLLM)")
    data = cfg.dump()
    data["serving"]["replicas"] = n
    return OnlineRLConfig.model_validate(data)


def serving_replicas(cfg: OnlineRLConfig, local: LocalPorts) -> list[ServingReplica]:
    """The local serving replicas of ``cfg`` (``serving.replicas``, at least 1). One replica keeps the configured
    ports (no balancer); with more, each gets its own ports and the configured gateway port is the balancer's."""
    from onlinerl.valkey import free_port

    n = max(1, cfg.serving.replicas)
    if n == 1:
        engine = int(cfg.serving.engine_url.rsplit(":", 1)[1].split("/")[0])
        return [ServingReplica("local-0", 0, cfg.serving.port, engine, local.reloader)]
    if local.replica_base == 0:
        return [ServingReplica(f"local-{i}", i, free_port(), free_port(), free_port()) for i in range(n)]
    b = local.replica_base
    return [ServingReplica(f"local-{i}", i, b + 10 * i, b + 10 * i + 1, b + 10 * i + 2) for i in range(n)]


def needed_ports(cfg: OnlineRLConfig, local: LocalPorts, host: str) -> list[tuple[str, int, str]]:
    """Every ``(host, port, use)`` the stack of ``cfg`` will listen on: valkey (unless redis.url is given) and vLLM on
    loopback, the rest on ``host``."""
    reps = serving_replicas(cfg, local)
    single = len(reps) == 1
    wanted = [] if cfg.redis.url else [(ports.LOOPBACK, local.redis, "valkey")]
    for rep in reps:
        sfx = rep.suffix(single)
        wanted.append((ports.LOOPBACK, rep.engine, f"vLLM{sfx}"))
        wanted.append((host if single else ports.LOOPBACK, rep.gateway, f"gateway{sfx}"))
        wanted.append((host if single else ports.LOOPBACK, rep.reloader, f"reloader{sfx}"))
    if not single:
        wanted.append((host, cfg.serving.port, "balancer"))
    wanted += [(host, cfg.feedback.port, "feedback"), (host, cfg.trainer.metrics_port, "trainer metrics")]
    if cfg.rollout.controlled:
        wanted.append((host, local.rollout, "rollout controller"))
    return wanted


def check_ports(cfg: OnlineRLConfig, local: LocalPorts, host: str) -> None:
    """Refuse, in one line, to start a stack whose ports are taken (before anything starts or any file is written),
    naming each busy port, its use and its holder (another `onlinerl up` with its state directory, if it is one)."""
    from onlinerl.errors import CommandError

    try:
        busy = busy_ports(needed_ports(cfg, local, host))
    except CannotListen as exc:
        raise CommandError(f"{exc} (--host is an address of this machine, e.g. 127.0.0.1 or 0.0.0.0)") from None
    if busy:
        raise CommandError(describe(busy))


def exposure_warning(cfg: OnlineRLConfig, local: LocalPorts, host: str) -> str:
    """What ``--host`` off loopback makes reachable from other machines, in one line ("" on loopback)."""
    if host in (ports.LOOPBACK, "localhost", "::1"):
        return ""
    opened = ", ".join(f"{what} :{port}" for h, port, what in needed_ports(cfg, local, host) if h == host)
    return (
        f"--host {host}: reachable from other machines: {opened} (completions and feedback for anyone holding a "
        "key; metrics and health without one). valkey and vLLM stay on 127.0.0.1."
    )


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


# `onlinerl simulate`'s users each have their own key: the gateway routes by key (no client may choose its arm), so
# with one shared key every simulated user lands in the same arm and a canary gets all of the traffic or none of it.
SIMULATED_USERS = 32


def _tenants(paths: StackPaths) -> dict[str, list]:
    """Every tenant's key entries in the local keys file (in file order)."""
    if not paths.keys.is_file():
        return {}
    data = yaml.safe_load(paths.keys.read_text()) or {}
    return {str(t): list((spec or {}).get("keys") or []) for t, spec in (data.get("tenants") or {}).items()}


def _key_role(item: str | dict) -> tuple[str, str]:
    return (item, "user") if isinstance(item, str) else (item.get("key"), item.get("role", "user"))


def ensure_demo_key(paths: StackPaths, role: str = "user", tenant: str = DEMO_TENANT) -> str:
    """``tenant``'s local API key of ``role`` (the demo tenant's unless named): a ``user`` key for Continue and
    `onlinerl simulate`, an ``eval`` key for `onlinerl eval` and the rollout gate (they pin versions, which a user key
    may not). Created once, reused on every start, with ``SIMULATED_USERS`` more user keys for the simulated users
    (:func:`demo_user_keys`); a keys file from before roles (one plain key) gains its eval key. Other tenants' keys
    in the file are kept as they are (`onlinerl up` creates keys for each of ``projects.listed`` too: issue 39)."""
    tenants = _tenants(paths)
    entries = tenants.get(tenant, [])
    by_role: dict[str, str] = {}
    for item in entries:
        key, item_role = _key_role(item)
        by_role.setdefault(item_role, key)
    users = sum(1 for item in entries if _key_role(item)[1] == "user")
    if "user" not in by_role or "eval" not in by_role or users < 1 + SIMULATED_USERS:
        if "user" not in by_role:
            by_role["user"] = new_api_key()
            entries.insert(0, by_role["user"])
            users += 1
        if "eval" not in by_role:
            by_role["eval"] = new_api_key("orl-eval")
            entries.append({"key": by_role["eval"], "role": "eval"})
        entries += [new_api_key("orl-sim") for _ in range(1 + SIMULATED_USERS - users)]
        write_keys_file(paths.keys, {**tenants, tenant: entries})
    return by_role[role]


def demo_user_keys(paths: StackPaths, tenant: str = DEMO_TENANT) -> list[str]:
    """Every user key of the demo tenant (or ``tenant``), the Continue key first: one per simulated user."""
    return [key for key, role in map(_key_role, _tenants(paths).get(tenant, [])) if role == "user"]


def effective_config(
    cfg: OnlineRLConfig,
    paths: StackPaths,
    redis_url: str,
    model_path: Path,
    host: str = ports.LOOPBACK,
    own_engines: bool = False,
) -> OnlineRLConfig:
    """The config every child reads: embedded Redis URL, resolved model folder, local keys and checkpoint paths, and
    ``host`` for the gateway and feedback (their config default, every interface, is a pod's). ``own_engines``: the
    stack starts its vLLMs itself, so unless the config says otherwise each runs its gateway inside its own process
    (``serving.gatewayMode: inProcess``: no second hop, issue 40); a vLLM already running (``external_engine``) may
    be any vLLM, so there ``auto`` is the sidecar. The result always names the mode, as the engines it starts read
    it (onlinerl.vllm_flags.gateway_args)."""
    data = cfg.dump()
    if cfg.serving.gateway_mode == "auto":  # our own engines can load it; a running one may be any vLLM
        data["serving"]["gatewayMode"] = "inProcess" if own_engines else "sidecar"
    data["redis"]["url"] = redis_url
    data["serving"]["host"] = host
    data["feedback"]["host"] = host
    data["model"]["path"] = str(model_path)
    data["auth"]["apiKeysFile"] = str(paths.keys.resolve())
    if "max_samples_per_user_per_hour" not in cfg.feedback.limits.model_fields_set:
        # `onlinerl simulate` drives a whole team through 33 demo keys for an hour: a per-key hourly limit would
        # throttle the simulation, not a person. Set feedback.limits.maxSamplesPerUserPerHour to have one locally.
        data["feedback"]["limits"]["maxSamplesPerUserPerHour"] = 0
    if "few_users" not in cfg.rollout.model_fields_set:
        # `onlinerl up` is one developer by design: its one key must be able to move the canary, or it is served
        # v0 for ever (services/rollout/onlinerl_rollout/few_users.py). Set rollout.fewUsers: wait to keep it off.
        data["rollout"]["fewUsers"] = "decide"
    ckpt = Path(data["storage"]["checkpointDir"])
    if not ckpt.is_absolute():
        data["storage"]["checkpointDir"] = str((paths.state / "checkpoints").resolve())
    return OnlineRLConfig.model_validate(data)


def continue_snippet(cfg: OnlineRLConfig, api_key: str, host: str = "127.0.0.1") -> str:
    """The config.yaml for stock Continue (onlinerl/continue_config.py) pointing at this local stack."""
    from onlinerl.loop.template import template_for

    return continue_config(
        model=cfg.model.served_name,
        api_base=f"http://{host}:{cfg.serving.port}/v1",
        feedback_base=f"http://{host}:{cfg.feedback.port}",
        api_key=api_key,
        max_model_len=cfg.model.max_model_len,
        template=template_for(cfg, None),
    )


@dataclass
class Stack:
    """The running local stack: children in start order, stopped in reverse."""

    cfg: OnlineRLConfig
    paths: StackPaths
    valkey: EmbeddedValkey | None = None
    children: list[Child] = field(default_factory=list)
    api_key: str = ""
    replicas: list[ServingReplica] = field(default_factory=list)
    host: str = ports.LOOPBACK  # where the stack's own ports listen (`onlinerl up --host`); valkey, vLLM: loopback

    def child_env(self, name: str = "") -> dict[str, str]:
        env = {
            "ONLINERL_CONFIG": str(self.paths.config.resolve()),
            "OMP_NUM_THREADS": "1",
            "TOKENIZERS_PARALLELISM": "false",
            ports.LISTEN_HOST_ENV: self.host,  # trainer metrics, rollout controller: the stack's host, not a pod's
            STATE_ENV: str(self.paths.state.resolve()),  # a second `onlinerl up` names this stack as the holder
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
        self,
        name: str,
        module: str,
        health_url: str,
        timeout: float,
        extra_env: dict | None = None,
        role: str = "",
        argv: list[str] | None = None,
    ) -> Child:
        """Start ``python -m module`` (or ``argv``) as ``name`` with ``role``'s Redis user, and wait until healthy."""
        say(f"starting {name} (log: {self.paths.logs / (name + '.log')})")
        child = Child(
            name,
            argv or python_module(module),
            self.paths.logs / f"{name}.log",
            env={**self.child_env(role or name), **(extra_env or {})},
        )
        self.children.append(child.start())
        child.wait_healthy(health_url, timeout)
        say(f"{name} healthy")
        return child

    def start_engines(self, model_path: Path, replicas: list[ServingReplica], timeout: float = 600) -> list[Child]:
        """One vLLM per replica as ``python -m onlinerl_serving.engine`` (which execs vLLM with the serving package's
        own recipe, so the shared library starts the engine without importing serving code). All start at once,
        then each is waited on: N engines load side by side."""
        single = len(replicas) == 1
        cores, environ = sorted(os.sched_getaffinity(0)), dict(os.environ)
        shared = {compile_cache.SHARED_ENV: str(self.compile_cache_folder())}
        started = []
        for rep in replicas:
            argv = python_module(
                "onlinerl_serving.engine",
                *("--config", str(self.paths.config.resolve()), "--model", str(model_path)),
                *("--port", str(rep.engine), "--cache-dir", str(self.paths.logs.resolve())),
            )
            name = f"vllm{rep.suffix(single)}"
            env = rep.env(single) | engine_cpu_binding(rep.index, len(replicas), cores, environ) | shared
            if self.cfg.serving.gateway_mode == "inProcess":  # the gateway runs in this process: its config and user
                env = self.child_env("gateway") | env
            child = Child(name, argv, self.paths.logs / f"{name}.log", env=env)
            self.children.append(child.start())  # appended first: a failed start is stopped with the rest
            started.append(child)
        for rep, child in zip(replicas, started, strict=True):
            child.wait_healthy(f"http://127.0.0.1:{rep.engine}/v1/models", timeout)
            if self.cfg.serving.gateway_mode == "inProcess":
                child.wait_healthy(f"{rep.gateway_url}/healthz", 60)
        return started

    def start_serving(
        self,
        model_path: Path,
        local: LocalPorts,
        on_step: Callable[[str], None] = say,
        external_engine: bool = False,
    ) -> None:
        """``serving.replicas`` replicas (vLLM + gateway + reloader each); with more than one, the balancer on the
        configured gateway port in front of them (onlinerl/loop/balancer.py). ``external_engine``: one replica whose
        vLLM already runs at ``serving.engineUrl`` (started and stopped by the caller)."""
        self.replicas = serving_replicas(self.cfg, local)
        single = len(self.replicas) == 1
        n = len(self.replicas)
        if external_engine:
            if not single:
                raise ValueError("an external engine serves one replica: serving.replicas must be 1")
            if self.cfg.serving.gateway_mode == "inProcess":
                raise ValueError("serving.gatewayMode inProcess runs the gateway inside the vLLM it starts")
            on_step(f"using the running vLLM at {self.cfg.serving.engine_url}")
        else:
            on_step(f"starting vLLM{'' if single else f' x{n}'} (about a minute on CPU)")
            self.start_engines(model_path, self.replicas)
            on_step("vLLM healthy")
        for rep in self.replicas:
            env, sfx = rep.env(single), rep.suffix(single)
            if self.cfg.serving.gateway_mode == "sidecar":  # inProcess: it runs inside vLLM, already started
                self.start_child(
                    f"gateway{sfx}", "onlinerl_serving.gateway", f"{rep.gateway_url}/healthz", 60, env, "gateway"
                )
            self.start_child(
                f"reloader{sfx}",
                "onlinerl_serving.reloader",
                f"http://127.0.0.1:{rep.reloader}/healthz",
                60,
                {**env, "ONLINERL_RELOADER_PORT": str(rep.reloader)},
                "reloader",
            )
        if not single:
            upstreams = [a for rep in self.replicas for a in ("--upstream", f"{rep.replica_id}={rep.gateway_url}")]
            self.start_child(
                "balancer",
                "onlinerl.loop.balancer",
                f"http://127.0.0.1:{self.cfg.serving.port}/healthz",
                30,
                argv=python_module("onlinerl.loop.balancer", *upstreams),
            )

    def replica_children(self, replica_id: str) -> list[Child]:
        """The running processes of one serving replica (vLLM, gateway, reloader), e.g. to kill it in a test."""
        rep = next(r for r in self.replicas if r.replica_id == replica_id)
        sfx = rep.suffix(len(self.replicas) == 1)
        return [c for c in self.children if c.name in {f"vllm{sfx}", f"gateway{sfx}", f"reloader{sfx}"}]

    def compile_cache_folder(self) -> Path:
        """Where the local engines share compiled kernels: $ONLINERL_COMPILE_CACHE, else beside the model cache."""
        from onlinerl.model import default_cache_dir

        return compile_cache.shared_folder() or default_cache_dir() / "torchinductor"

    def stop(self) -> None:
        """Every child at once (``procs.stop_all``), then valkey, which they may use until they are gone."""
        live = [c for c in reversed(self.children) if c.alive()]
        if live:
            say(f"stopping {', '.join(c.name for c in live)}")
        stop_all(live)
        self.children.clear()
        for rep in self.replicas:  # what the engines compiled: the next engine on this machine starts from it
            compile_cache.publish(
                self.paths.logs.resolve() / f"torchinductor-{rep.engine}", self.compile_cache_folder()
            )
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
    serving_only: bool = False,
    external_engine: bool = False,
    host: str = ports.LOOPBACK,
) -> Stack:
    """Start every component and return the running :class:`Stack` (the caller stops it). ``serving_only``: valkey
    and the serving replicas only (tests and benchmarks that publish versions themselves). ``external_engine``: vLLM
    already runs at ``serving.engineUrl`` (a developer's own, or a test session's shared engine): start none.
    ``host``: where the gateway, feedback, trainer metrics, reloader and rollout ports listen (`onlinerl up --host`;
    valkey and vLLM stay on loopback)."""
    from onlinerl.model import resolve_model_path

    paths = StackPaths(state)
    paths.logs.mkdir(parents=True, exist_ok=True)
    stack = Stack(cfg, paths, host=host)
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
        for project in cfg.projects.listed:  # each listed project's own local keys, to try per-project adapters
            ensure_demo_key(paths, tenant=project)
        stack.cfg = effective_config(cfg, paths, redis_url, model_path, host, own_engines=not external_engine)
        write_secret(paths.config, yaml.safe_dump(stack.cfg.dump(), sort_keys=False))  # its Redis URL: a password
        stack.start_serving(model_path, ports, on_step, external_engine=external_engine)
        if serving_only:
            return stack
        c = stack.cfg
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


def replica_lines(stack: Stack) -> str:
    """With N > 1 replicas: one banner line each (its own gateway, whose /metrics are that replica's)."""
    if len(stack.replicas) <= 1:
        return ""
    lines = [
        f"  {r.replica_id:<13} gateway :{r.gateway}  vLLM :{r.engine}  reloader :{r.reloader}  (logs: *-{r.index}.log)"
        for r in stack.replicas
    ]
    head = f"  balancer      :{stack.cfg.serving.port} -> {len(stack.replicas)} serving replicas (least in flight)\n"
    return head + "\n".join(lines) + "\n"


def cli_command() -> str:
    """The CLI as the user can type it in their shell: ``onlinerl`` when it is on PATH, else its path from here.
    `make run` starts ``.venv/bin/onlinerl up`` without activating the venv, so a newcomer's ``onlinerl status``
    would answer "command not found"."""
    if shutil.which("onlinerl"):
        return "onlinerl"
    exe = Path(sys.executable).parent / "onlinerl"
    try:
        return os.path.relpath(exe)
    except ValueError:  # another drive (Windows)
        return str(exe)


def banner(stack: Stack) -> str:
    c = stack.cfg
    cli = cli_command()
    gateway_metrics = f":{c.serving.port}/metrics" if len(stack.replicas) <= 1 else "each replica's :PORT/metrics"
    return f"""
onlinerl is up.
  completions   http://127.0.0.1:{c.serving.port}/v1/completions
  feedback      http://127.0.0.1:{c.feedback.port}/api/training/data (stock Continue's data: destination)
                http://127.0.0.1:{c.feedback.port}/api/training/submit (the outcome itself: the fork, simulate)
{replica_lines(stack)}  metrics       gateway {gateway_metrics}  feedback :{c.feedback.port}/metrics
                trainer :{c.trainer.metrics_port}/metrics
  redis         {redacted(c.redis.url)}
  logs          {stack.paths.logs}
  demo API key  {stack.api_key}   (project: {DEMO_TENANT})

Stock Continue (VS Code, JetBrains): merge this into {CONFIG_PATH} (README: "Use it from your editor"):
{continue_snippet(c, stack.api_key)}
Check that outcomes arrive: {cli} status (the serving version's "accepted / shown" count grows)
Try it:     {cli} simulate --requests 50
Live view:  {cli} status --watch 5
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
