"""The files that keep a tied LM head tied across vLLM's in-place reloads (onlinerl/tied_head.py), without an engine:
what a full checkpoint carries, v0's copy of the base, and what is refused when they are tampered with. The engine
side (vLLM serves exactly these weights, and the base again after v0) is tests/serving/test_full_weights_tied_head.py.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from onlinerl.tied_head import BASE_DIR, INDEX_FILE, LM_HEAD_FILE, LM_HEAD_KEY, base_weights_path
from onlinerl_trainer.checkpoint import CheckpointStore, render_manifest
from onlinerl_trainer.head_files import ensure_base_dir, ensure_base_dir_for, tied_embedding_name
from onlinerl_trainer.policy import save_weights

EMBED = "model.embed_tokens.weight"


def tiny_llama(tied: bool) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=1,
        num_key_value_heads=1,
        head_dim=16,
        tie_word_embeddings=tied,
    )
    return LlamaForCausalLM(config)


def publish(store: CheckpointStore, model: torch.nn.Module, version: int = 1) -> Path:
    weights = {k: p.detach().clone() for k, p in model.named_parameters()}

    def manifest_for(files: dict[str, str]):
        return render_manifest(
            job="j", version=version, parent_version=0, kind="full", base_model="b", step=1, sample_ids=[],
            metrics={}, files=files,
        )  # fmt: skip

    return store.publish(version, lambda tmp: save_weights(model, weights, tmp), manifest_for)


def flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))


def test_a_tied_checkpoint_carries_its_trained_head_checksummed_and_a_transformers_load_ignores_it(
    tmp_path: Path,
) -> None:
    model = tiny_llama(tied=True)
    assert tied_embedding_name(model) == EMBED
    with torch.no_grad():
        model.get_input_embeddings().weight.add_(1.0)  # "trained" embeddings
    store = CheckpointStore(tmp_path / "ckpt")
    v1 = publish(store, model)
    head = load_file(str(v1 / LM_HEAD_FILE))
    assert list(head) == [LM_HEAD_KEY] and torch.equal(head[LM_HEAD_KEY], model.get_input_embeddings().weight)
    assert LM_HEAD_FILE in store.manifest(1).files and store.verify(1)
    reloaded = AutoModelForCausalLM.from_pretrained(v1, dtype=torch.float32)  # what the trainer's resume reads
    assert torch.equal(reloaded.get_output_embeddings().weight, model.get_input_embeddings().weight)

    flip_a_byte(v1 / LM_HEAD_FILE)  # a tampered head is a corrupt version: the reloader never loads it
    assert any(LM_HEAD_FILE in p and "sha256" in p for p in store.problems(1)), store.problems(1)


def test_an_untied_model_writes_no_head_file_and_no_base_copy(tmp_path: Path) -> None:
    model = tiny_llama(tied=False)
    assert tied_embedding_name(model) is None
    v1 = publish(CheckpointStore(tmp_path / "ckpt"), model)
    assert not (v1 / LM_HEAD_FILE).exists()


def base_model_folder(tmp_path: Path, sharded: bool) -> Path:
    """A base model folder as Hugging Face writes it; ``sharded``: two safetensors files and their index."""
    base = tmp_path / "base"
    model = tiny_llama(tied=True)
    model.save_pretrained(base, safe_serialization=True)
    if sharded:
        state = load_file(str(base / "model.safetensors"))
        os.remove(base / "model.safetensors")
        names = sorted(state)
        halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
        for file, keys in halves.items():
            save_file({k: state[k] for k in keys}, str(base / file), metadata={"format": "pt"})
        weight_map = {k: file for file, keys in halves.items() for k in keys}
        (base / INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return base


@pytest.mark.parametrize("sharded", [False, True], ids=["one-file", "sharded"])
def test_v0s_copy_links_the_base_and_carries_its_embeddings_as_the_head(tmp_path: Path, sharded: bool) -> None:
    base = base_model_folder(tmp_path, sharded)
    root = tmp_path / "ckpt" / "job"
    root.mkdir(parents=True)
    assert base_weights_path(root, str(base)) == (str(base), [])  # no copy yet: the base itself, nothing to say

    folder = ensure_base_dir(root, base, EMBED)
    assert folder == root / BASE_DIR and base_weights_path(root, str(base)) == (str(folder), [])
    embeddings = {}
    for f in base.glob("*.safetensors"):
        embeddings.update({k: v for k, v in load_file(str(f)).items() if k == EMBED})
    assert torch.equal(load_file(str(folder / LM_HEAD_FILE))[LM_HEAD_KEY], embeddings[EMBED])
    for f in base.iterdir():  # every base file is there, a link to the original, but the index
        assert (folder / f.name).exists()
        assert (folder / f.name).is_symlink() == (f.name != INDEX_FILE)
    if sharded:  # vLLM reads only the files the index names: it names the head file
        weight_map = json.loads((folder / INDEX_FILE).read_text())["weight_map"]
        assert weight_map[LM_HEAD_KEY] == LM_HEAD_FILE
        assert {k: v for k, v in weight_map.items() if k != LM_HEAD_KEY} == json.loads((base / INDEX_FILE).read_text())[
            "weight_map"
        ]

    written = (folder / LM_HEAD_FILE).stat().st_mtime_ns
    assert ensure_base_dir(root, base, EMBED) == folder  # checks out: left alone
    assert (folder / LM_HEAD_FILE).stat().st_mtime_ns == written


def test_a_tampered_or_broken_base_copy_is_refused_by_the_reader_and_rewritten_by_the_trainer(tmp_path: Path) -> None:
    base = base_model_folder(tmp_path, sharded=False)
    root = tmp_path / "ckpt" / "job"
    root.mkdir(parents=True)
    folder = ensure_base_dir(root, base, EMBED)

    flip_a_byte(folder / LM_HEAD_FILE)
    path, problems = base_weights_path(root, str(base))
    assert path == str(base) and any(LM_HEAD_FILE in p and "sha256" in p for p in problems), problems
    ensure_base_dir(root, base, EMBED)  # the next full publish writes it again
    assert base_weights_path(root, str(base)) == (str(folder), [])

    os.remove(folder / "config.json")  # a link gone: vLLM would miss a file
    path, problems = base_weights_path(root, str(base))
    assert path == str(base) and any("config.json" in p and "link" in p for p in problems), problems
    ensure_base_dir(root, base, EMBED)

    torch.manual_seed(1)  # the base replaced at the same path (same shapes): the head is no longer its embeddings
    LlamaForCausalLM(tiny_llama(tied=True).config).save_pretrained(base, safe_serialization=True)
    path, problems = base_weights_path(root, str(base))
    assert path == str(base) and any("not the embeddings" in p for p in problems), problems
    ensure_base_dir(root, base, EMBED)
    assert base_weights_path(root, str(base)) == (str(folder), [])

    moved = base.rename(tmp_path / "base-elsewhere")  # model.path now names another folder
    path, problems = base_weights_path(root, str(moved))
    assert path == str(moved) and "was written for the base at" in problems[0], problems
    moved.rename(base)

    (folder / "base-manifest.json").write_text("{not json")
    path, problems = base_weights_path(root, str(base))
    assert path == str(base) and "not valid" in problems[0], problems
    ensure_base_dir(root, base, EMBED)
    assert base_weights_path(root, str(base)) == (str(folder), [])
    assert not [p.name for p in root.iterdir() if p.name.startswith(".")]  # nothing left aside


def test_a_base_without_safetensors_gets_no_copy_and_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """vLLM takes ``*.safetensors`` over ``*.bin``: a copy of a .bin base with a head file would load only the head."""
    base = tmp_path / "base"
    model = tiny_llama(tied=True)
    model.save_pretrained(base, safe_serialization=True)
    torch.save(load_file(str(base / "model.safetensors")), base / "pytorch_model.bin")
    os.remove(base / "model.safetensors")
    root = tmp_path / "ckpt" / "job"
    root.mkdir(parents=True)
    with caplog.at_level("WARNING", logger="onlinerl.trainer"):
        assert ensure_base_dir_for(model, root, base) is None
    assert not (root / BASE_DIR).exists() and "no safetensors" in caplog.text
    assert base_weights_path(root, str(base)) == (str(base), [])
