"""``onlinerl policy --state DIR`` against a real valkey: the command acts on the Redis and the job of the local stack
whose state directory it is given (the config `onlinerl up` wrote there), like ``onlinerl status --state``; after
`make run` a plain ``onlinerl policy show`` finds ``.onlinerl`` itself. A missing or URL-less state says what to do."""

from __future__ import annotations

import json

import pytest
import yaml

from onlinerl.cli import main
from onlinerl.config import from_mapping
from onlinerl.keys import Keys
from onlinerl.loop.stack import StackPaths
from onlinerl.schemas import PolicyTable
from onlinerl.secretfile import write_secret
from tests.rollout.sim import publish_loaded

JOB = "stackjob"  # not the default job ("local"): the command must take the job from the state's config


def write_state(state, redis_url: str, job: str = JOB) -> None:
    """What `onlinerl up` leaves: the effective config, with the admin's Redis URL, written as a secret file."""
    cfg = from_mapping({"job": job, "redis": {"url": redis_url}})
    write_secret(StackPaths(state).config, yaml.safe_dump(cfg.dump(), sort_keys=False))


def table(r, job: str = JOB) -> PolicyTable:
    return PolicyTable.from_redis(r.hgetall(Keys(job).policy))


@pytest.fixture
def no_config_env(monkeypatch, tmp_path):
    """No $ONLINERL_CONFIG or ONLINERL__* variable, and a working directory without a `.onlinerl` of its own."""
    monkeypatch.delenv("ONLINERL_CONFIG", raising=False)
    monkeypatch.delenv("ONLINERL__REDIS__URL", raising=False)
    monkeypatch.delenv("ONLINERL__JOB", raising=False)
    monkeypatch.chdir(tmp_path)


def test_state_dir_gives_the_redis_and_the_job(no_config_env, tmp_path, empty_valkey, redis_client, capsys) -> None:
    state = tmp_path / "stack-state"
    write_state(state, empty_valkey.url)
    for v in (1, 2):
        publish_loaded(redis_client, JOB, v)
        publish_loaded(redis_client, "local", v)  # another job on the same Redis: must stay untouched

    assert main(["policy", "--state", str(state), "pin", "2"]) == 0
    assert capsys.readouterr().out == "pin: pinned to v2\n"
    assert table(redis_client).pinned == 2
    assert table(redis_client, "local").pinned is None, "the state's job, not the default one, was acted on"

    assert main(["policy", "--state", str(state), "show"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["policy"]["pinned"] == 2

    assert main(["policy", "--state", str(state), "resume"]) == 0 and table(redis_client).hold is None
    assert main(["policy", "--state", str(state), "unpin"]) == 0 and table(redis_client).pinned is None


def test_after_make_run_the_default_state_is_found(no_config_env, tmp_path, empty_valkey, redis_client, capsys):
    """`make run` leaves .onlinerl in the working directory: `onlinerl policy pause` needs no flag."""
    write_state(tmp_path / ".onlinerl", empty_valkey.url)
    assert main(["policy", "pause"]) == 0
    assert capsys.readouterr().out.startswith("pause: ")
    assert table(redis_client).paused


def test_given_flags_win_over_the_state(no_config_env, tmp_path, empty_valkey, redis_client, capsys) -> None:
    """--redis-url and --job override the state's config, as they override --config's."""
    state = tmp_path / "stack-state"
    write_state(state, "redis://127.0.0.1:1/0")  # nothing listens there
    publish_loaded(redis_client, "other", 1)
    assert main(["policy", "--state", str(state), "--redis-url", empty_valkey.url, "--job", "other", "pin", "1"]) == 0
    assert table(redis_client, "other").pinned == 1 and table(redis_client).pinned is None


def test_missing_state_says_how_to_start_a_stack(no_config_env, tmp_path, capsys) -> None:
    assert main(["policy", "--state", str(tmp_path / "nothing"), "show"]) == 2
    err = capsys.readouterr().err
    assert "no running stack found" in err and "make run" in err and "Traceback" not in err


def test_no_state_and_no_url_says_every_way_to_give_one(no_config_env, capsys) -> None:
    assert main(["policy", "show"]) == 2
    err = capsys.readouterr().err
    assert "no Redis to act on" in err and "--redis-url" in err and "--state DIR" in err and "redis.url" in err


def test_state_without_a_redis_url_is_refused(no_config_env, tmp_path, capsys) -> None:
    state = tmp_path / "stack-state"
    write_state(state, "")
    assert main(["policy", "--state", str(state), "show"]) == 2
    assert "no Redis to act on" in capsys.readouterr().err
