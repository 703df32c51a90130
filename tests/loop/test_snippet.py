"""The Continue config that `onlinerl up` prints is a complete config.yaml pointing Continue at both services (that
Continue's own parser loads it: tests/continue/)."""

import yaml

from onlinerl.config import OnlineRLConfig
from onlinerl.continue_config import continue_budget
from onlinerl.fim import get_template
from onlinerl.loop.stack import continue_snippet
from onlinerl.profiles import with_local_profile


def test_snippet_for_a_model_continue_does_not_recognise():
    cfg = OnlineRLConfig.model_validate({"model": {"fimTemplate": "plain"}, "serving": {"port": 9000}})
    doc = yaml.safe_load(continue_snippet(cfg, "sk-1"))
    assert (doc["name"], doc["version"], doc["schema"]) == ("onlinerl", "1.0.0", "v1")
    model = doc["models"][0]
    assert model["provider"] == "openai" and model["roles"] == ["autocomplete"]
    assert model["apiBase"] == "http://127.0.0.1:9000/v1" and model["apiKey"] == "sk-1"
    rendered = model["promptTemplates"]["autocomplete"].replace("{{{prefix}}}", "P").replace("{{{suffix}}}", "S")
    assert rendered == get_template("plain").render("P", "S")
    assert model["defaultCompletionOptions"]["stop"] == list(get_template("plain").stop)
    assert doc["data"] == [
        {
            "name": "onlinerl-feedback",
            "destination": "http://127.0.0.1:8002/api/training/data",
            "schema": "0.2.0",
            "level": "all",
            "events": ["autocomplete"],
            "apiKey": "sk-1",
        }
    ]
    assert "tabAutocompleteOptions" not in doc  # the fork's keys: only in a comment, for that fork


def test_qwen_needs_no_template_override_under_a_qwen_coder_name():
    cfg = OnlineRLConfig.model_validate({"model": {"fimTemplate": "qwen", "servedName": "qwen2.5-coder-1.5b"}})
    assert "promptTemplates" not in yaml.safe_load(continue_snippet(cfg, "k"))["models"][0]
    # Continue picks its template by the model name: under any other name the qwen template is spelled out
    cfg = OnlineRLConfig.model_validate({"model": {"fimTemplate": "qwen"}})
    model = yaml.safe_load(continue_snippet(cfg, "k"))["models"][0]
    rendered = model["promptTemplates"]["autocomplete"].replace("{{{prefix}}}", "P").replace("{{{suffix}}}", "S")
    assert rendered == get_template("qwen").render("P", "S")


def test_continues_prompt_budget_fits_the_served_context_in_every_profile():
    for has_gpu in (False, True):
        cfg = with_local_profile(OnlineRLConfig.model_validate({"model": {"fimTemplate": "qwen"}}), has_gpu)
        model = yaml.safe_load(continue_snippet(cfg, "k"))["models"][0]
        prompt, completion = (
            model["autocompleteOptions"]["maxPromptTokens"],
            model["defaultCompletionOptions"]["maxTokens"],
        )
        # a prompt of `prompt` Continue tokens is at most ~1.3x as many served tokens; the completion comes on top
        assert 1.3 * prompt + 16 + completion <= cfg.model.max_model_len, (has_gpu, prompt, completion)
        assert (prompt, completion) == continue_budget(cfg.model.max_model_len)
    assert continue_budget(1024) == (640, 64)  # the cpu profile: Continue's default 1,024-token prompt would not fit
    assert continue_budget(2048) == (1024, 128)  # Continue's default prompt budget
