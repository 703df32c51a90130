"""The trainer's half of keeping a tied LM head tied in full-weight mode (why, and the layout: onlinerl/tied_head.py):
the head file a full checkpoint carries, and v0's copy of the base with the base's embeddings as its head."""

from __future__ import annotations

import json
import logging
import os
import shutil
import uuid
from pathlib import Path

import torch
from torch import nn

from onlinerl.checksums import sha256_file
from onlinerl.tied_head import (
    BASE_DIR,
    BASE_MANIFEST,
    INDEX_FILE,
    LM_HEAD_FILE,
    LM_HEAD_KEY,
    base_dir_problems,
)
from onlinerl_trainer.checkpoint import fsync_path

log = logging.getLogger("onlinerl.trainer")


def tied_embedding_name(module: nn.Module) -> str | None:
    """The parameter name of ``module``'s input embeddings when its LM head is the same tensor, else None."""
    get_in = getattr(module, "get_input_embeddings", None)
    get_out = getattr(module, "get_output_embeddings", None)
    if get_in is None or get_out is None:
        return None
    inp, out = get_in(), get_out()
    if inp is None or out is None or out.weight is not inp.weight:
        return None
    return next((name for name, p in module.named_parameters() if p is inp.weight), None)


def write_lm_head(directory: Path, embeddings: torch.Tensor) -> None:
    """``directory/lm_head.safetensors`` = ``embeddings`` as ``lm_head.weight``; a sharded folder's index names it."""
    from safetensors.torch import save_file

    save_file(
        {LM_HEAD_KEY: embeddings.detach().to("cpu").contiguous()},
        str(directory / LM_HEAD_FILE),
        metadata={"format": "pt"},
    )
    index = directory / INDEX_FILE
    if index.is_file() and not index.is_symlink():
        data = json.loads(index.read_text())
        data.setdefault("weight_map", {})[LM_HEAD_KEY] = LM_HEAD_FILE
        index.write_text(json.dumps(data, indent=2))


def read_base_tensor(model_path: Path, name: str) -> torch.Tensor:
    """One tensor of the base model, read from its safetensors files (no model load)."""
    from safetensors import safe_open

    index = model_path / INDEX_FILE
    if index.is_file():
        files = [model_path / json.loads(index.read_text())["weight_map"][name]]
    else:
        files = sorted(model_path.glob("*.safetensors"))
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            if name in st.keys():  # noqa: SIM118 (safe_open has keys(), no __contains__)
                return st.get_tensor(name)
    raise KeyError(f"{name} is in none of the safetensors files of {model_path}")


def ensure_base_dir(root: Path, model_path: Path, embed_name: str) -> Path:
    """Write ``root/base-tied-head`` for the base at ``model_path`` unless it is there and checks out
    (``base_dir_problems``: also when the base was replaced since). Built aside and
    renamed into place, manifest last (a crash leaves a ``.tmp-`` folder the checkpoint store cleans). The links are
    absolute paths of the base's files: the serving pod sees the model at the same path as the trainer
    (``model.path``)."""
    root, base = Path(root), Path(os.path.abspath(model_path))
    final = root / BASE_DIR
    if not base_dir_problems(root, base):
        return final
    tmp = root / f".tmp-{BASE_DIR}-{uuid.uuid4().hex}"
    tmp.mkdir(parents=True)
    try:
        links = []
        for entry in sorted(base.iterdir()):
            if entry.name in (LM_HEAD_FILE, BASE_MANIFEST) or entry.name.startswith("."):
                continue
            if entry.name == INDEX_FILE:
                shutil.copyfile(entry, tmp / INDEX_FILE)  # a copy: write_lm_head adds the head to it
            else:
                os.symlink(entry, tmp / entry.name)
                links.append(entry.name)
        write_lm_head(tmp, read_base_tensor(base, embed_name))
        own = [p for p in sorted(tmp.iterdir()) if not p.is_symlink()]
        files = {p.name: sha256_file(p) for p in own}
        manifest = {"base_model": str(base), "embeddings": embed_name, "files": files, "links": links}
        (tmp / BASE_MANIFEST).write_text(json.dumps(manifest, indent=2))
        for p in [*own, tmp / BASE_MANIFEST, tmp]:
            fsync_path(p)
        if final.exists():
            trash = root / f".del-{BASE_DIR}-{uuid.uuid4().hex}"
            os.rename(final, trash)
            shutil.rmtree(trash, ignore_errors=True)
        os.rename(tmp, final)
        fsync_path(root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def ensure_base_dir_for(module: nn.Module, root: Path, model_path: Path) -> Path | None:
    """:func:`ensure_base_dir` when ``module``'s head is tied to its embeddings (None, and nothing written, if not).
    A base stored without safetensors files gets none either: vLLM would read only the head file of such a folder (it
    takes ``*.safetensors`` over ``*.bin``), so v0 is reloaded from ``model.path`` and a warning says the head may
    stay the last version's."""
    name = tied_embedding_name(module)
    if name is None:
        return None
    if not any(Path(model_path).glob("*.safetensors")):
        log.warning(
            "the base model at %s has no safetensors files: no copy of it with its tied LM head is written, so a "
            "switch back to v0 may keep the last version's head (convert the base to safetensors)",
            model_path,
        )
        return None
    return ensure_base_dir(root, model_path, name)
