"""Stock Continue closes the loop, with Continue's own PUBLISHED code (tests/continue/: @continuedev/config-yaml,
pinned, installed by `make setup`): its parser loads the config we print, and its versioned dev-data schemas build the
events that are POSTed, as its DataLogger posts them, to the real feedback service (a real valkey behind it).

The served rollouts are written as the gateway writes them (tests/feedback/rollouts.py), so each event has a
completion to join; the gateway itself is tested elsewhere. Each node run takes well under a second.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import uuid
from pathlib import Path
from typing import Any

import pytest
import yaml

from onlinerl.config import OnlineRLConfig
from onlinerl.fim import TEMPLATES, get_template
from onlinerl.loop.stack import continue_snippet
from onlinerl.profiles import with_local_profile

from .conftest import KEYS, start_feedback, stream_entries
from .rollouts import make_rollout, record_rollout

CLIENT_DIR = Path(__file__).resolve().parents[1] / "continue"
QWEN = get_template("qwen")
# Continue's DEFAULT_AUTOCOMPLETE_OPTS, which AutocompleteLoggingService spreads into every outcome it logs.
AUTOCOMPLETE_OPTIONS = {
    "disable": False,
    "useFileSuffix": True,
    "maxPromptTokens": 1024,
    "prefixPercentage": 0.3,
    "maxSuffixPercentage": 0.2,
    "debounceDelay": 350,
    "multilineCompletions": "auto",
    "slidingWindowPrefixPercentage": 0.75,
    "slidingWindowSize": 500,
    "useCache": True,
    "onlyMyCode": True,
    "useRecentlyEdited": True,
    "useImports": True,
    "transform": True,
}


def continue_client(request: dict[str, Any]) -> dict[str, Any]:
    """Run tests/continue/continue_client.mjs (Continue's parser and schemas) on ``request``; its JSON answer."""
    for package in ("config-yaml", "fetch", "openai-adapters"):  # tests/continue/package.json
        if not (CLIENT_DIR / "node_modules" / "@continuedev" / package).is_dir():
            pytest.fail(
                f"Continue's npm package @continuedev/{package} is not installed: run `make setup` (npm ci in "
                "tests/continue)"
            )
    node = shutil.which("node")
    assert node, "node is not on PATH"
    done = subprocess.run(
        [node, "continue_client.mjs"],
        input=json.dumps(request),
        capture_output=True,
        text=True,
        cwd=CLIENT_DIR,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def outcome(prompt: str, completion: str, accepted: bool) -> dict[str, Any]:
    """An AutocompleteOutcome as Continue's AutocompleteLoggingService hands it to the DataLogger."""
    return {
        **AUTOCOMPLETE_OPTIONS,
        "accepted": accepted,
        "time": 812,
        "prefix": "def add(a, b):\n",
        "suffix": "\n",
        "prompt": prompt,
        "completion": completion,
        "modelProvider": "openai",
        "modelName": "onlinerl-base",
        "completionOptions": {"temperature": 0.01},
        "cacheHit": False,
        "filepath": "file:///w/app.py",
        "gitRepo": "https://example.com/w.git",
        "completionId": str(uuid.uuid4()),
        "uniqueId": "vscode-installation-1",
        "timestamp": "2026-11-27T20:00:00.000Z",
        "numLines": 1,
        "enabledStaticContextualization": False,
    }


@pytest.fixture(scope="module")
def server(module_valkey, tmp_path_factory):
    srv = start_feedback(tmp_path_factory.mktemp("feedback-continue"), module_valkey.url)
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def printed(server) -> str:
    """The config `onlinerl up` prints, for a stack whose feedback is this server, with acme's key."""
    cfg = OnlineRLConfig.model_validate(
        {"model": {"fimTemplate": "qwen"}, "feedback": {"port": int(server.url.rsplit(":", 1)[1])}}
    )
    return continue_snippet(cfg, KEYS["acme"][0])


def post(printed: str, sent: list[dict], **destination: Any) -> list[dict]:
    """Continue's DataLogger posts ``sent`` through the printed config's data: entry (``destination``: overrides)."""
    answer = continue_client({"config": printed, "events": sent, "destination": destination})
    assert answer["error"] is None, answer["error"]
    return answer["posts"]


def served(r, keys, tokenizer, n: int, completion: str) -> str:
    prompt = QWEN.render(f"def add{n}(a, b):\n", "\n")
    record_rollout(r, keys, make_rollout(tokenizer, tenant="acme", prompt=prompt, completion=completion))
    return prompt


def test_continues_parser_loads_the_printed_config_and_drops_nothing() -> None:
    """Every FIM template we know, under the cpu profile (1,024-token context) and the GPU default (2,048)."""
    cfgs = [
        with_local_profile(OnlineRLConfig.model_validate({"model": {"fimTemplate": name}}), has_gpu)
        for name in TEMPLATES
        for has_gpu in (False, True)
    ]
    texts = [continue_snippet(cfg, "sk-test") for cfg in cfgs]
    answer = continue_client({"config": texts[0], "configs": texts})
    for cfg, text, parsed in zip(cfgs, texts, answer["many"], strict=True):
        assert parsed["error"] is None, (cfg.model.fim_template, parsed["error"])
        assert parsed["config"] == yaml.safe_load(text)  # every key we print is one Continue keeps
        (model,) = parsed["config"]["models"]
        budget = model["autocompleteOptions"]["maxPromptTokens"] + model["defaultCompletionOptions"]["maxTokens"]
        assert budget < cfg.model.max_model_len


def test_continues_parser_refuses_what_we_printed_before() -> None:
    """The old snippet (models + the fork's tabAutocompleteOptions): refused, so the parser here is the real one."""
    old = "models: []\ntabAutocompleteOptions:\n  enableCompletionTracking: true\n"
    answer = continue_client({"config": old})
    assert answer["error"] == "Failed to parse config: name: Required, version: Required"


def test_continues_accepts_and_rejects_train_and_a_repeat_is_a_duplicate(server, printed, r, keys, tokenizer) -> None:
    accept = outcome(served(r, keys, tokenizer, 1, "    return a + b"), "    return a + b", True)
    reject = outcome(served(r, keys, tokenizer, 2, "    return a - b"), "    return a - b", False)
    first, second, again = post(printed, [{"name": "autocomplete", "data": d} for d in (accept, reject, accept)])
    assert [p["status"] for p in (first, second, again)] == [200, 200, 200]
    assert "numLines" not in first["sent"]["data"] and first["sent"]["schema"] == "0.2.0"  # 0.2.0 dropped it
    assert first["body"]["status"] == second["body"]["status"] == "accepted_for_training", (first, second)
    assert (again["body"]["status"], again["body"]["reason"]) == ("duplicate", "completion_id_seen")
    assert again["body"]["entry_id"] == first["body"]["sample_id"]
    samples = stream_entries(r, keys.samples)
    assert [(s["event_id"], s["accepted"]) for s in samples] == [
        (accept["completionId"], True),
        (reject["completionId"], False),
    ]
    assert samples[0]["reward"] > 0 > samples[1]["reward"]
    assert all(s["tenant"] == "acme" for s in samples)  # no X-Project-ID: the key named the project


def test_a_0_1_0_event_trains_as_0_2_0_does(server, printed, r, keys, tokenizer) -> None:
    accept = outcome(served(r, keys, tokenizer, 3, "    return a * b"), "    return a * b", True)
    (sent,) = post(printed, [{"name": "autocomplete", "data": accept}], schema="0.1.0")
    assert sent["sent"]["schema"] == "0.1.0" and "completionOptions" in sent["sent"]["data"]
    assert (sent["status"], sent["body"]["status"]) == (200, "accepted_for_training"), sent
    assert [s["event_id"] for s in stream_entries(r, keys.samples)] == [accept["completionId"]]


def test_a_no_code_event_is_answered_audited_and_never_trained(server, printed, r, keys, tokenizer) -> None:
    accept = outcome(served(r, keys, tokenizer, 4, "    return a / b"), "    return a / b", True)
    (sent,) = post(printed, [{"name": "autocomplete", "data": accept}], level="noCode")
    assert "completion" not in sent["sent"]["data"] and "prompt" not in sent["sent"]["data"]
    assert (sent["status"], sent["body"]["status"], sent["body"]["reason"]) == (200, "rejected", "no_code")
    assert not stream_entries(r, keys.samples)
    assert [a["reason"] for a in stream_entries(r, keys.audit)] == ["no_code"]


def test_other_events_are_answered_and_not_trained(server, printed, r, keys) -> None:
    tokens = {"model": "onlinerl-base", "provider": "openai", "promptTokens": 310, "generatedTokens": 12}
    # the printed config sends autocomplete only; a destination without `events` gets every event Continue logs
    (filtered,) = post(printed, [{"name": "tokensGenerated", "data": tokens}])
    assert filtered is None
    (sent,) = post(printed, [{"name": "tokensGenerated", "data": tokens}], events=None)
    assert sent["sent"]["data"]["eventName"] == "tokensGenerated"
    assert (sent["status"], sent["body"]) == (200, {"status": "ignored", "name": "tokensGenerated", "tenant": "acme"})
    assert not stream_entries(r, keys.samples) and not stream_entries(r, keys.audit)
