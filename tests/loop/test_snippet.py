"""The Continue config that `onlinerl up` prints is valid YAML that points Continue at both services."""

import yaml

from onlinerl.config import OnlineRLConfig
from onlinerl.fim import get_template
from onlinerl.loop.stack import continue_snippet


def test_snippet_for_a_model_continue_does_not_recognise():
    cfg = OnlineRLConfig.model_validate({"model": {"fimTemplate": "plain"}, "serving": {"port": 9000}})
    doc = yaml.safe_load(continue_snippet(cfg, "sk-1"))
    model = doc["models"][0]
    assert model["provider"] == "openai" and model["roles"] == ["autocomplete"]
    assert model["apiBase"] == "http://127.0.0.1:9000/v1" and model["apiKey"] == "sk-1"
    rendered = model["promptTemplates"]["autocomplete"].replace("{{{prefix}}}", "P").replace("{{{suffix}}}", "S")
    assert rendered == get_template("plain").render("P", "S")
    assert model["defaultCompletionOptions"]["stop"] == list(get_template("plain").stop)
    track = doc["tabAutocompleteOptions"]
    assert track["enableCompletionTracking"] is True
    assert track["completionTrackingUrl"] == "http://127.0.0.1:8002/api/training/submit"
    assert track["completionTrackingHeaders"] == {"Authorization": "Bearer sk-1", "X-Project-ID": "demo"}


def test_qwen_needs_no_template_override():
    cfg = OnlineRLConfig.model_validate({"model": {"fimTemplate": "qwen"}})
    assert "promptTemplates" not in yaml.safe_load(continue_snippet(cfg, "k"))["models"][0]
