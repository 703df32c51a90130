"""Full-weight mode with a tied LM head: the head file a checkpoint carries, and the base model's weights with one.

Why. A model with ``tie_word_embeddings`` (SmolLM2, the tiny test model) stores its embeddings once
(``model.embed_tokens.weight``); its LM head is the same tensor. vLLM 0.32's in-place ``reload_weights`` does not keep
that tie. It puts every layer back on the meta device, each with its own copy of its tensors' metadata
(``model_loader/reload/meta.py``: ``capture_layer_to_meta``), so during a reload the head is a layer of its own whose
weight is no alias of the embeddings (``AutoWeightsLoader`` skips ``lm_head.weight`` only while it is one). A layer
that receives no weight gets its old tensors back without being processed again (``reload/layerwise.py``:
``finalize_layerwise_processing``). On vLLM-CPU the head's matmul runs on a copy of the weight packed when the layer
was last processed (``dispatch_cpu_unquantized_gemm``), so the new embeddings were served with the old head: not the
trained model. Reloading the base does not repair it either (its files hold no ``lm_head.weight``).

A weight named ``lm_head.weight`` equal to the embeddings makes vLLM load and process the head again. So:

* a full checkpoint of a tied model carries :data:`LM_HEAD_FILE` (the trained embeddings under the head's name),
  covered by the version's manifest like every other file (the trainer's ``policy.save_weights``);
* going back to the base (v0) reloads :data:`BASE_DIR` in the checkpoint root: links to the base model's files plus the
  same head file holding the base embeddings, with a manifest of its own. The trainer writes it, before the first
  version that carries a head (it has the model and the writable checkpoint volume; the serving pod has neither),
  and the reloader uses it only when it checks out (:func:`base_weights_path`).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from onlinerl.checksums import file_problems

LM_HEAD_FILE = "lm_head.safetensors"
LM_HEAD_KEY = "lm_head.weight"
BASE_DIR = "base-tied-head"  # in the checkpoint root; never a v{N} name, so no reader takes it for a version
BASE_MANIFEST = "base-manifest.json"
INDEX_FILE = "model.safetensors.index.json"  # vLLM loads only the files a sharded model's index names


def base_dir_problems(root: Path, model_path: str | Path) -> list[str]:
    """What is wrong with ``root/base-tied-head`` as v0 for the base at ``model_path`` (empty: nothing). Its manifest
    parses and names that base; its own files match their sha256; every link reaches that base's file; and its head is,
    byte for byte, the embeddings tensor in the base's files now (a base replaced at the same path is caught)."""
    folder = Path(root) / BASE_DIR
    base = Path(os.path.abspath(model_path))
    try:
        manifest = json.loads((folder / BASE_MANIFEST).read_text())
        files, links, embeddings = manifest["files"], manifest["links"], manifest["embeddings"]
        written_for = manifest["base_model"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return [f"{folder / BASE_MANIFEST} is missing or not valid: {exc}"]
    if written_for != str(base):
        return [f"{folder} was written for the base at {written_for}, model.path is {base}"]
    if LM_HEAD_FILE not in files:
        return [f"{folder / BASE_MANIFEST} lists no {LM_HEAD_FILE}"]
    problems = file_problems(folder, files)
    for name in links:
        link = folder / name
        if not link.is_symlink() or os.readlink(link) != str(base / name) or not link.exists():
            problems.append(f"{link} is not a link to {base / name}")
    if not problems:
        problems += _head_is_not(folder / LM_HEAD_FILE, base, embeddings)
    return problems


def base_weights_path(root: Path, model_path: str) -> tuple[str, list[str]]:
    """What vLLM reloads for v0: ``root/base-tied-head`` when it is there and checks out, else ``model_path``; with the
    problems of a folder that is there but refused (the caller says so loudly: the head may then stay stale)."""
    folder = Path(root) / BASE_DIR
    if not folder.exists():
        return model_path, []
    problems = base_dir_problems(Path(root), model_path)
    return (model_path, problems) if problems else (str(folder), [])


def tensor_span(path: Path, key: str) -> tuple[str, list[int], int, int] | None:
    """Where ``key``'s bytes lie in a safetensors file: (dtype, shape, start, end); None when the file lacks it. Read
    from the header alone (8 bytes of length, then JSON), so the reloader needs no torch."""
    with open(path, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(size))
    meta = header.get(key)
    if not isinstance(meta, dict):
        return None
    start, end = meta["data_offsets"]
    return meta["dtype"], list(meta["shape"]), 8 + size + start, 8 + size + end


def _head_is_not(head_file: Path, base: Path, embeddings: str) -> list[str]:
    """Empty when ``head_file``'s ``lm_head.weight`` is byte for byte the base's ``embeddings`` tensor."""
    try:
        head = tensor_span(head_file, LM_HEAD_KEY)
        index = base / INDEX_FILE
        candidates = (
            [base / json.loads(index.read_text())["weight_map"][embeddings]]
            if index.is_file()
            else sorted(base.glob("*.safetensors"))
        )
        found = next(((f, span) for f in candidates if (span := tensor_span(f, embeddings)) is not None), None)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return [f"cannot compare {head_file} with the base's {embeddings}: {exc}"]
    if head is None or found is None:
        return [f"{head_file} or the base at {base} lacks the tensor ({LM_HEAD_KEY}, {embeddings})"]
    (dtype, shape, h0, h1), (source, (edtype, eshape, e0, e1)) = head, found
    if (dtype, shape) != (edtype, eshape) or h1 - h0 != e1 - e0:
        return [f"{head_file} is {dtype}{shape}, the base's {embeddings} is {edtype}{eshape}"]
    with open(head_file, "rb") as a, open(source, "rb") as b:
        a.seek(h0)
        b.seek(e0)
        left = h1 - h0
        while left > 0:
            n = min(left, 1 << 22)
            if a.read(n) != b.read(n):
                return [f"{head_file} is not the embeddings of the base at {base} (replaced since it was written?)"]
            left -= n
    return []
