"""One typed config: YAML + env, camelCase like the CRD, errors name the field path."""

import pytest

from onlinerl.config import ConfigError, OnlineRLConfig, load_config


def test_defaults_are_valid_and_camelcase_roundtrip():
    cfg = OnlineRLConfig()
    dumped = cfg.dump()
    assert dumped["serving"]["maxTokensCap"] == 4096
    assert dumped["feedback"]["reward"] == {
        "preset": "chars",
        "accepted": 0.5,
        "acceptedPerChar": 0.0125,
        "acceptedCharsCap": 40,
        "rejected": -0.25,
        "empty": 0.0,
    }
    assert OnlineRLConfig.model_validate(dumped) == cfg


def test_yaml_then_env_precedence(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("job: demo\nserving:\n  port: 9100\n  maxTokensCap: 256\ntrainer:\n  algorithm:\n    clipEps: 0.1\n")
    cfg = load_config(
        f, environ={"ONLINERL__SERVING__PORT": "9200", "ONLINERL__TRAINER__LORA__TARGET_MODULES": "[q_proj]"}
    )
    assert cfg.job == "demo"
    assert cfg.serving.port == 9200  # env wins over the file
    assert cfg.serving.max_tokens_cap == 256
    assert cfg.trainer.algorithm.clip_eps == 0.1
    assert cfg.trainer.lora.target_modules == ["q_proj"]


def test_onlinerljob_manifest_is_accepted_as_config(tmp_path):
    f = tmp_path / "job.yaml"
    f.write_text(
        "apiVersion: onlinerl.dev/v1alpha1\nkind: OnlineRLJob\nmetadata: {name: x}\nspec:\n  serving: {replicas: 2}\n"
    )
    assert load_config(f, environ={}).serving.replicas == 2


def test_reward_presets():
    assert OnlineRLConfig.model_validate({"feedback": {"reward": {"preset": "rlinf"}}}).feedback.reward.accepted == 1.0
    cursor = OnlineRLConfig.model_validate({"feedback": {"reward": {"preset": "cursor"}}}).feedback.reward
    assert (cursor.accepted, cursor.accepted_per_char, cursor.rejected) == (0.75, 0.0, -0.25)
    custom = OnlineRLConfig.model_validate({"feedback": {"reward": {"preset": "custom", "rejected": -1}}})
    assert custom.feedback.reward.rejected == -1.0


@pytest.mark.parametrize(
    ("data", "path", "reason"),
    [
        ({"serving": {"port": 70000}}, "serving.port", "less than or equal to 65535"),
        ({"trainer": {"algorithm": {"clipEps": 2}}}, "trainer.algorithm.clipEps", "less than 1"),
        ({"trainer": {"engine": "jax"}}, "trainer.engine", "'auto', 'torch' or 'deepspeed'"),
        ({"serving": {"maxTokenCap": 5}}, "serving.maxTokenCap", "Extra inputs are not permitted"),
        ({"redis": {"rolloutTtlSeconds": 60}}, "redis.rolloutTtlSeconds", "greater than or equal to 900"),
    ],
)
def test_invalid_values_fail_with_field_path_and_reason(tmp_path, data, path, reason):
    import yaml

    f = tmp_path / "bad.yaml"
    f.write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError) as err:
        load_config(f, environ={})
    assert path in str(err.value) and reason in str(err.value)


def test_bad_env_value_names_the_variable():
    with pytest.raises(ConfigError, match=r"serving\.port"):
        load_config(environ={"ONLINERL__SERVING__PORT": "not-a-port"})


def test_missing_file_is_a_clear_error(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml", environ={})
