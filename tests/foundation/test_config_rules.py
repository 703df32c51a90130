"""`onlinerl config check` refuses what the CRD refuses, with the same message (issue 37).

The CRD side is the generated file itself (crds/onlinerljob.yaml): its ``x-kubernetes-validations`` CEL rules are
evaluated by a real CEL implementation (PyPI common-expression-language, cel-rust) on each spec of a table, after the
schema's own defaults are applied the way the API server applies them before it validates. The CLI side is the real
command (``onlinerl --config FILE config check``) and the operator's ``parse_spec``. For every row: the CRD refuses iff
the check refuses, and every message the CRD gives is in what the check and the operator print.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import cel
import pytest
import yaml

from onlinerl.cli import main
from onlinerl.config import from_mapping
from onlinerl.config_rules import ENGINE_GPU_IMAGE, FIM_TEMPLATE_NAMES, RULES, project_lines_refusals
from onlinerl_operator.spec import SpecError, parse_spec
from tests.crd_schema import api_server_defaults, spec_schema

ROOT = Path(__file__).resolve().parents[2]
CRD = ROOT / "crds" / "onlinerljob.yaml"
KEYS = {"auth": {"apiKeysSecret": "team-keys"}}  # what every cluster job needs (a rule of its own, tested below)


def crd_spec_schema() -> dict[str, Any]:
    return spec_schema(yaml.safe_load(CRD.read_text()))


def crd_rules(schema: dict[str, Any], path: str = "") -> list[tuple[str, dict[str, str]]]:
    """Every CEL validation in the spec schema with the dotted path it is attached to (transition rules left out:
    they need the stored object)."""
    found = [(path, v) for v in schema.get("x-kubernetes-validations", []) if "oldSelf" not in v["rule"]]
    for name, sub in schema.get("properties", {}).items():
        found += crd_rules(sub, f"{path}.{name}" if path else name)
    return found


def at(obj: dict[str, Any], path: str) -> Any:
    for part in filter(None, path.split(".")):
        obj = obj[part]
    return obj


def crd_refusals(spec: dict[str, Any]) -> list[str]:
    """The messages the API server would answer ``spec`` with: each CEL rule of the generated CRD, evaluated."""
    schema = crd_spec_schema()
    obj = api_server_defaults(schema, spec)
    return [
        rule["message"]
        for path, rule in crd_rules(schema)
        if cel.evaluate(rule["rule"], {"self": at(obj, path)}) is not True
    ]


def check(tmp_path: Path, document: dict[str, Any], capsys) -> tuple[int, str]:
    """The real command on a file: exit code and what it printed (stdout + stderr)."""
    f = tmp_path / "job.yaml"
    f.write_text(yaml.safe_dump(document))
    code = main(["--config", str(f), "config", "check"])
    out = capsys.readouterr()
    return code, out.out + out.err


def manifest(spec: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": "onlinerl.dev/v1alpha1", "kind": "OnlineRLJob", "metadata": {"name": "demo"}, "spec": spec}


BAD = {
    "micro batch above the batch": {"trainer": {"batchSize": 4, "microBatchSize": 8}},
    "unknown FIM template": {"model": {"fimTemplate": "starcoder9"}},
    "FIM template in capitals": {"model": {"fimTemplate": "Qwen"}},
    "trainer weights differ from serving's": {"trainer": {"weights": "full"}},
    "adapter rank above serving's max": {"trainer": {"lora": {"r": 32}}, "serving": {"lora": {"maxRank": 16}}},
    "torch engine on two GPUs": {"trainer": {"engine": "torch", "gpus": 2}},
    "two nodes on CPU auto": {"trainer": {"nodes": 2}},
    "two nodes on torch": {"trainer": {"nodes": 2, "engine": "torch", "gpus": 1}},
    "model claim and image": {"model": {"claim": "models", "image": "reg/model:1", "path": "/models/m"}},
    "model image without path": {"model": {"image": "reg/model:1"}},
    "model path outside the claim": {"model": {"claim": "models", "path": "/data/m"}},
    "no checkpoint size": {"storage": {"size": ""}},
    "TLS without host": {"ingress": {"enabled": True, "tlsSecret": "cert"}},
    "project adapters on full weights": {
        "projects": {"adapters": "all"},
        "trainer": {"weights": "full"},
        "serving": {"weightsMode": "full"},
    },
    "project adapters on deepspeed": {
        "projects": {"adapters": "listed", "listed": ["acme"]},
        "trainer": {"engine": "deepspeed"},
    },
    "project adapters on two GPUs": {"projects": {"adapters": "all"}, "trainer": {"gpus": 2}},
    "project adapters on two nodes": {"projects": {"adapters": "all"}, "trainer": {"nodes": 2, "gpus": 1}},
    "project adapters, trainer on full weights": {"projects": {"adapters": "all"}, "trainer": {"weights": "full"}},
    "several at once": {
        "trainer": {"batchSize": 2, "microBatchSize": 4, "weights": "full"},
        "ingress": {"tlsSecret": "c"},
    },
}
GOOD = {
    "defaults": {},
    "full weights on both sides": {"trainer": {"weights": "full"}, "serving": {"weightsMode": "full"}},
    "adapter rank at serving's max": {"trainer": {"lora": {"r": 16}}, "serving": {"lora": {"maxRank": 16}}},
    "alias template": {"model": {"fimTemplate": "qwen2.5-coder"}},
    "two nodes on deepspeed": {"trainer": {"nodes": 2, "engine": "deepspeed", "gpus": 1}},
    "two GPU nodes on auto": {"trainer": {"nodes": 2, "gpus": 8}},
    "model on a claim": {"model": {"claim": "models", "path": "/models/qwen"}},
    "existing claim without size": {"storage": {"existingClaim": "ckpt", "size": ""}},
    "TLS with host": {"ingress": {"enabled": True, "tlsSecret": "cert", "host": "rl.example.com"}},
    "project adapters on LoRA": {"projects": {"adapters": "listed", "listed": ["acme"]}},
    "project adapters on one GPU": {"projects": {"adapters": "all"}, "trainer": {"engine": "auto", "gpus": 1}},
    "project adapters on torch": {"projects": {"adapters": "all"}, "trainer": {"engine": "torch", "gpus": 1}},
}


def _deep(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for k, v in over.items():
        out[k] = _deep(out.get(k, {}), v) if isinstance(v, dict) else v
    return out


@pytest.mark.parametrize("name", list(BAD))
def test_check_refuses_what_the_crd_refuses_with_its_message(name: str, tmp_path, capsys) -> None:
    spec = _deep(KEYS, BAD[name])
    messages = crd_refusals(spec)
    assert messages, f"the CRD accepts {name!r}: the table row is wrong"
    code, printed = check(tmp_path, manifest(spec), capsys)
    assert code == 2 and "invalid onlinerl configuration" in printed and "Traceback" not in printed
    for message in messages:
        assert message in printed, f"{name}: the CRD says {message!r}; the check printed {printed!r}"
    assert printed.count("\n  ") == len(messages), "one line per broken rule, no more"
    with pytest.raises(SpecError) as err:  # the operator: the same messages
        parse_spec("demo", spec)
    assert all(m in str(err.value) for m in messages)
    # A plain config file (what `make run` takes) is refused alike: these rules hold wherever the config runs.
    code, printed = check(tmp_path, BAD[name], capsys)
    assert code == 2 and all(m in printed for m in messages)


@pytest.mark.parametrize("name", list(GOOD))
def test_check_passes_what_the_crd_passes(name: str, tmp_path, capsys) -> None:
    spec = _deep(KEYS, GOOD[name])
    assert crd_refusals(spec) == []
    assert check(tmp_path, manifest(spec), capsys) == (0, "configuration is valid\n")
    parse_spec("demo", spec)


@pytest.mark.parametrize("example", sorted((ROOT / "examples").glob("*.yaml")), ids=lambda p: p.name)
def test_the_examples_pass_both(example: Path, capsys) -> None:
    (job,) = [d for d in yaml.safe_load_all(example.read_text()) if d and d["kind"] == "OnlineRLJob"]
    assert crd_refusals(job["spec"]) == []
    assert main(["--config", str(example), "config", "check"]) == 0, capsys.readouterr().err


def test_a_cluster_rule_applies_to_a_manifest_not_to_a_local_config(tmp_path, capsys) -> None:
    """Without auth.apiKeysSecret the CRD refuses an OnlineRLJob; a local config (keys from auth.apiKeysFile, or the
    demo keys `make run` writes) needs none, so its check passes."""
    messages = crd_refusals({})
    assert messages == [next(r.message for r in RULES if r.scope == "cluster")]
    code, printed = check(tmp_path, manifest({}), capsys)
    assert code == 2 and messages[0] in printed
    assert check(tmp_path, {}, capsys) == (0, "configuration is valid\n")
    assert check(tmp_path, manifest({"auth": {"allowAnonymous": True}}), capsys)[0] == 0


def test_the_crd_rules_are_the_shared_rules_and_each_matches_its_python() -> None:
    """Every CEL rule in the generated CRD comes from onlinerl.config_rules (same place, expression and message), and
    on every row of the tables each rule's CEL and its Python predicate agree."""
    in_crd = [(path, rule["rule"], rule["message"]) for path, rule in crd_rules(crd_spec_schema())]
    assert sorted(in_crd) == sorted((r.at, r.cel, r.message) for r in RULES)
    schema = crd_spec_schema()
    for row in [*BAD.values(), *GOOD.values(), {}]:
        spec = _deep(KEYS, row)
        crd_view = api_server_defaults(schema, spec)
        pydantic_view = from_mapping(spec).dump()
        for rule in RULES:
            by_cel = cel.evaluate(rule.cel, {"self": at(crd_view, rule.at)})
            assert by_cel is rule.holds(rule.value_at(pydantic_view)), (rule.message, row)


def test_template_names_are_the_fim_modules() -> None:
    """The CRD's list is onlinerl/fim.py's templates and aliases: a new template is accepted everywhere at once."""
    from onlinerl.fim import TEMPLATES, get_template

    assert {get_template(n).name for n in FIM_TEMPLATE_NAMES[1:]} == set(TEMPLATES)
    assert all(
        cel.evaluate(next(r.cel for r in RULES if "fimTemplate" in r.cel), {"self": {"fimTemplate": n}})
        for n in FIM_TEMPLATE_NAMES
    )


def test_a_manifest_set_is_checked_by_its_one_job(tmp_path, capsys) -> None:
    """Several documents (a Secret and the job, as the examples): the OnlineRLJob is checked; none or two is refused
    with a message saying what the file must hold."""
    secret = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "team-keys"}}
    f = tmp_path / "set.yaml"
    f.write_text(yaml.safe_dump_all([secret, manifest(_deep(KEYS, BAD["unknown FIM template"]))]))
    assert main(["--config", str(f), "config", "check"]) == 2
    assert "model.fimTemplate must be auto" in capsys.readouterr().err
    for documents in ([secret, secret], [secret, manifest(KEYS), manifest(KEYS)]):
        f.write_text(yaml.safe_dump_all(documents))
        assert main(["--config", str(f), "config", "check"]) == 2
        assert "exactly one OnlineRLJob" in capsys.readouterr().err


@pytest.mark.parametrize("name", [n for n in BAD if n.startswith("project adapters")])
def test_the_project_line_rules_alone_give_the_crds_project_messages(name: str) -> None:
    """What the trainer checks at its start (project_lines_refusals, through adapters.lines_problem) is the CRD's
    refusal of a project-adapter configuration, message for message, with the values it got."""
    spec = _deep(KEYS, BAD[name])
    mine = project_lines_refusals(from_mapping(spec).dump())
    crd = [m for m in crd_refusals(spec) if m.startswith("projects.adapters")]
    assert crd and len(mine) == len(crd)
    assert all(got.startswith(message + " (got projects.adapters=") for got, message in zip(mine, crd, strict=True))
    assert all("projects.adapters: off" in m for m in mine)  # each says how to turn it off, too


GPU_IN_PROCESS = {"serving": {"gpus": 1, "gatewayMode": "inProcess"}}
IN_PROCESS_IMAGES = {  # images.vllm -> refused with serving.gpus 1 and gatewayMode inProcess
    "vllm/vllm-openai:v0.32.0": True,  # the default
    "vllm/vllm-openai:latest": True,  # upstream at any tag or digest lacks our package
    "vllm/vllm-openai@sha256:" + "0" * 64: True,
    "docker.io/vllm/vllm-openai:v0.33.0": True,
    ENGINE_GPU_IMAGE: False,
    "registry.example.com/team/onlinerl-engine-gpu:dev": False,
    "registry.example.com/vllm/vllm-openai:v0.32.0": False,  # a mirror may hold anything: not refused by name
}


@pytest.mark.parametrize("image", list(IN_PROCESS_IMAGES))
def test_in_process_on_gpus_needs_an_engine_image_with_our_package(image: str, tmp_path, capsys) -> None:
    """serving.gatewayMode inProcess on GPUs runs the gateway in images.vllm: upstream vLLM's image cannot import it.
    The CRD, `onlinerl config check` of a manifest and the operator refuse it alike, with the message that says what
    to set and the values it got; a local config (no images) passes, as does sidecar mode or a CPU job (vllmCpu)."""
    spec = _deep(KEYS, {**GPU_IN_PROCESS, "images": {"vllm": image}})
    [rule] = [r for r in RULES if "gatewayMode" in r.cel]
    crd = crd_refusals(spec)
    code, printed = check(tmp_path, manifest(spec), capsys)
    if IN_PROCESS_IMAGES[image]:
        assert crd == [rule.message]
        assert code == 2 and rule.message in printed
        got = f"(got serving.gatewayMode='inProcess', serving.gpus=1, images.vllm={image!r})"
        assert f"{rule.message} {got}" in printed
        assert "make images-engine-gpu" in rule.message and "serving.gatewayMode: sidecar" in rule.message
        assert f"set images.vllm to it, e.g. {ENGINE_GPU_IMAGE}" in rule.message
        with pytest.raises(SpecError, match="inProcess runs the gateway inside vLLM's process"):
            parse_spec("demo", spec)
    else:
        assert crd == [] and (code, printed) == (0, "configuration is valid\n")
        parse_spec("demo", spec)
    assert check(tmp_path, {**GPU_IN_PROCESS, "images": {"vllm": image}}, capsys)[0] == 0  # a local config
    for fine in (_deep(spec, {"serving": {"gatewayMode": "sidecar"}}), _deep(spec, {"serving": {"gpus": 0}})):
        assert crd_refusals(fine) == [] and parse_spec("demo", fine)
    # the CEL and the Python predicate agree on this value (the table test above covers the other rules)
    schema = crd_spec_schema()
    by_cel = cel.evaluate(rule.cel, {"self": api_server_defaults(schema, spec)})
    assert by_cel is rule.holds(from_mapping(spec).dump()) is (not IN_PROCESS_IMAGES[image])


def test_the_engine_gpu_image_the_rule_names_is_what_make_builds() -> None:
    """The message's example tag is `make images-engine-gpu`'s default, and the rule's upstream default is
    images.vllm's."""
    from onlinerl.config import ImagesConfig
    from onlinerl.config_rules import is_upstream_vllm_image
    from tests.foundation.dockerfiles import make_images

    assert list(make_images(target="images-engine-gpu")) == [ENGINE_GPU_IMAGE]
    assert is_upstream_vllm_image(ImagesConfig().vllm)
    assert not is_upstream_vllm_image(ImagesConfig().vllm_cpu) and not is_upstream_vllm_image("vllm/vllm-openai-x:1")
