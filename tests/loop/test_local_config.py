"""How the CLI finds a running local stack's config, and what it says when it cannot."""

from __future__ import annotations

import pytest
import yaml

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
