"""How the CLI finds a running local stack's config, and what it says when it cannot."""

from __future__ import annotations

import pytest
import yaml

from onlinerl.auth import write_keys_file
from onlinerl.cli import main
from onlinerl.errors import CommandError
from onlinerl.loop.local import local_config


def test_a_config_without_a_redis_url_says_where_the_running_stacks_is(tmp_path, capsys) -> None:
    """`onlinerl --config mine.yaml status`: one line naming redis.url and the state directory's config, through the
    real CLI; without --config the state directory's config is used."""
    given = tmp_path / "mine.yaml"
    given.write_text(yaml.safe_dump({"job": "demo"}))
    state = tmp_path / "state"
    state.mkdir()
    (state / "config.yaml").write_text(yaml.safe_dump({"job": "demo", "redis": {"url": "redis://127.0.0.1:1/0"}}))
    assert local_config(state).redis.url == "redis://127.0.0.1:1/0"
    assert main(["--config", str(given), "status", "--state", str(state)]) == 2
    err = capsys.readouterr().err
    assert "no Redis URL: set redis.url" in err and "<state>/config.yaml" in err and "Traceback" not in err


def test_no_stack_and_no_config_says_how_to_start_one(tmp_path) -> None:
    with pytest.raises(CommandError, match="make run"):
        local_config(tmp_path / "nothing")


def test_the_demo_tenant_has_a_key_per_simulated_user_so_a_canary_gets_its_share(tmp_path) -> None:
    """Routing is by key: with one shared key every simulated user lands in the same arm, and a 25% canary got all of
    the demo's traffic or none (a 60-minute run served its canary 0 requests). `onlinerl up` creates one key per
    simulated user; an old state directory gains them on the next start, its keys kept."""
    from onlinerl.loop.local import local_user_keys
    from onlinerl.loop.stack import SIMULATED_USERS, StackPaths, demo_user_keys, ensure_demo_key
    from onlinerl_serving.routing import user_hash, user_point

    paths = StackPaths(tmp_path)
    write_keys_file(paths.keys, {"demo": ["sk-old-continue-key-0001"]})  # a state directory from before
    continue_key = ensure_demo_key(paths)
    keys = demo_user_keys(paths)
    assert continue_key == "sk-old-continue-key-0001" == keys[0]
    assert len(keys) == len(set(keys)) == 1 + SIMULATED_USERS
    assert ensure_demo_key(paths, "eval") not in keys  # the eval key pins versions; users never do
    assert demo_user_keys(paths) == keys and local_user_keys(tmp_path, None) == keys  # created once
    assert local_user_keys(tmp_path, "sk-given") == ["sk-given"]
    points = [user_point(user_hash(k)) for k in keys]
    assert len(set(points)) == len(keys)  # every simulated user has its own place in the routing


def test_a_listed_projects_local_keys_are_its_own_and_leave_the_demo_keys_alone(tmp_path) -> None:
    """Issue 39: `onlinerl up` creates keys for each of projects.listed, so `onlinerl simulate --tenant alpha` drives
    alpha's own line; the demo tenant's keys stay as they were, and a project with no keys is a clear error."""
    from onlinerl.auth import KeyRing
    from onlinerl.loop.local import local_api_key, local_user_keys
    from onlinerl.loop.stack import StackPaths, demo_user_keys, ensure_demo_key

    paths = StackPaths(tmp_path)
    demo = ensure_demo_key(paths)
    demo_users = demo_user_keys(paths)
    alpha_eval = ensure_demo_key(paths, "eval", tenant="alpha")
    assert demo_user_keys(paths) == demo_users and ensure_demo_key(paths) == demo
    alpha_users = local_user_keys(tmp_path, None, "alpha")
    assert alpha_users and not set(alpha_users) & set(demo_users)
    assert local_api_key(tmp_path, None, "eval", "alpha") == (alpha_eval, "alpha")
    ring = KeyRing.from_file(paths.keys)
    assert {ring.identity_for(k).tenant for k in alpha_users} == {"alpha"}
    assert ring.identity_for(demo).tenant == "demo"
    with pytest.raises(CommandError, match="no keys of project 'beta'"):
        local_user_keys(tmp_path, None, "beta")
