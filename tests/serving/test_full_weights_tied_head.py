"""Full-weight mode serves exactly the trained model when the LM head is tied to the embeddings, and the base again
after switching back to v0 (onlinerl/tied_head.py: vLLM 0.32's in-place reload does not keep a tied head tied).

The session's full-weight vLLM on the tiny model (``tie_word_embeddings: true``), the serving pod's reloader as a real
process under ``rollout.strategy: direct``, the session valkey; versions written and announced by the trainer's own
publisher. The oracle: every log-prob vLLM reports for a prompt and for the tokens it sampled at temperature 1 (both
``log softmax(logits)`` of the weights it holds) is recomputed with transformers from the published folder.

v1: the embeddings changed, published as the trainer writes it (with ``lm_head.safetensors``): served as trained.
v2: the embeddings changed again, written as the trainer wrote it before the fix (no head file): vLLM keeps v1's
head, which the oracle sees (this pins the engine's behaviour the fix works around). ``onlinerl policy pin 0``: v0's
copy of the base with its head (written by the publisher) brings the base back exactly.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis

from onlinerl.procs import Child, wait_for
from onlinerl.schemas import CheckpointManifest
from onlinerl.tied_head import BASE_DIR, LM_HEAD_FILE
from onlinerl.valkey import EmbeddedValkey, free_port
from tests.engines import BASE_NAME, SharedEngine, back_to_the_base, released
from tests.serving.conftest import start_reloader, write_config
from tests.trainer_publish import publish_as_the_trainer

pytestmark = pytest.mark.vllm
JOB = "tiedhead"
PROMPT = "def fibonacci(n):\n    if n < 2:\n        return n\n    return"
SAME = 1e-3  # same weights, both float32 on CPU: about 1e-6 apart
APART = 0.05  # different weights: the largest per-token gap is far above this


def served_logprobs(engine: SharedEngine) -> tuple[list[int], list[float]]:
    """One completion straight from vLLM at temperature 1: the token ids (prompt then sampled) and the log-prob vLLM
    gives each token after the first (prompt log-probs, then those it sampled with)."""
    body = {
        "model": BASE_NAME,
        "prompt": PROMPT,
        "max_tokens": 8,
        "temperature": 1.0,
        "seed": 7,
        "logprobs": 0,
        "prompt_logprobs": 0,
        "return_token_ids": True,
    }
    resp = httpx.post(f"{engine.url}/v1/completions", json=body, timeout=120)
    resp.raise_for_status()
    choice = resp.json()["choices"][0]
    prompt_ids, sampled = choice["prompt_token_ids"], choice["token_ids"]
    prompt_lps = [
        entry[str(tok)]["logprob"] for tok, entry in zip(prompt_ids[1:], choice["prompt_logprobs"][1:], strict=True)
    ]
    return prompt_ids + sampled, prompt_lps + choice["logprobs"]["token_logprobs"]


def gap(model, ids: list[int], served: list[float]) -> float:
    """Largest |vLLM's log-prob - the model's| over the tokens."""
    import torch

    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([ids])).logits[0, :-1].float(), -1)
    mine = logp.gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    return float((mine - torch.tensor(served)).abs().max())


def load(path: Path, head_of: Path | None = None):
    """The published weights under transformers (the trainer's view); ``head_of``: with the LM head untied and set to
    the embeddings of that folder instead (what a stale head serves)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    if head_of is not None:
        head = AutoModelForCausalLM.from_pretrained(head_of, dtype=torch.float32).get_input_embeddings().weight
        model.lm_head.weight = torch.nn.Parameter(head.detach().clone())
    return model


def with_new_embeddings(path: Path, seed: int):
    """The model at ``path`` with its (tied) embeddings moved: a full-weight version whose head must move too."""
    import torch

    torch.manual_seed(seed)
    model = load(path)
    with torch.no_grad():
        emb = model.get_input_embeddings().weight
        emb.add_(torch.randn_like(emb) * 0.05)
    return model


def as_the_trainer_wrote_it_before_the_fix(folder: Path) -> None:
    """No ``lm_head.safetensors``, and a manifest without it: a version published by an older trainer."""
    (folder / LM_HEAD_FILE).unlink()
    manifest = CheckpointManifest.from_json((folder / "manifest.json").read_bytes())
    files = {k: v for k, v in manifest.files.items() if k != LM_HEAD_FILE}
    (folder / "manifest.json").write_bytes(manifest.model_copy(update={"files": files}).to_json())


@pytest.fixture
def reloader(tmp_path: Path, empty_valkey: EmbeddedValkey, tiny_full_engine: SharedEngine) -> Iterator[tuple]:
    port = free_port()
    cfg_path = write_config(
        tmp_path / "config.yaml",
        job=JOB,
        redis={"url": empty_valkey.url},
        model={"path": str(tiny_full_engine.model_path), "maxModelLen": 1024},
        trainer={"weights": "full"},
        serving={
            "host": "127.0.0.1",
            "port": free_port(),  # no gateway: the reloader's calls to it fail fast and it goes on
            "engineUrl": tiny_full_engine.url,
            "weightsMode": "full",
            "drainTimeoutSeconds": 5,
        },
        rollout={"strategy": "direct"},
        storage={"checkpointDir": str(tmp_path / "ckpt")},
    )
    r = redis.Redis.from_url(empty_valkey.url)
    url = f"http://127.0.0.1:{port}"
    child: Child | None = None
    with released(tiny_full_engine, JOB):
        try:
            child = start_reloader(cfg_path, tmp_path / "reloader.log", port)
            yield cfg_path, url, r
        finally:
            back_to_the_base(r, JOB, url)
            r.close()
            if child is not None:
                child.stop(timeout=5)


def holding(url: str, version: int) -> None:
    wait_for(
        lambda: httpx.get(f"{url}/healthz", timeout=5).json()["holding"] == version,
        60,
        0.1,
        f"the reloader to hold v{version}",
    )


def test_trained_embeddings_are_served_with_their_head_and_v0_brings_the_base_back(
    reloader: tuple, empty_valkey: EmbeddedValkey, tiny_full_engine: SharedEngine, tmp_path: Path
) -> None:
    cfg_path, url, r = reloader
    base = tiny_full_engine.model_path
    ckpt = tmp_path / "ckpt" / JOB
    holding(url, 0)
    ids, lps = served_logprobs(tiny_full_engine)
    base_model = load(base)
    assert gap(base_model, ids, lps) < SAME

    t0 = time.monotonic()
    v1 = publish_as_the_trainer(cfg_path, empty_valkey.url, with_new_embeddings(base, seed=1), base)
    assert (ckpt / BASE_DIR / LM_HEAD_FILE).is_file()  # written with the first version that carries a head
    holding(url, v1)
    ids, lps = served_logprobs(tiny_full_engine)
    trained = load(ckpt / "v1")
    gaps = {
        "v1": gap(trained, ids, lps),
        "v1 with the base's head": gap(load(ckpt / "v1", head_of=base), ids, lps),
        "base": gap(base_model, ids, lps),
    }
    print(f"v1 served ({time.monotonic() - t0:.1f}s after publishing began): log-prob gaps {gaps}")
    assert gaps["v1"] < SAME and min(v for k, v in gaps.items() if k != "v1") > APART, gaps

    v2 = publish_as_the_trainer(
        cfg_path,
        empty_valkey.url,
        with_new_embeddings(ckpt / "v1", seed=2),
        base,
        parent=v1,
        before_announce=as_the_trainer_wrote_it_before_the_fix,
    )
    holding(url, v2)
    ids, lps = served_logprobs(tiny_full_engine)
    gaps = {
        "v2": gap(load(ckpt / "v2"), ids, lps),
        "v2 with v1's head": gap(load(ckpt / "v2", head_of=ckpt / "v1"), ids, lps),
    }
    print(f"v2 without a head file: log-prob gaps {gaps}")
    assert gaps["v2 with v1's head"] < SAME and gaps["v2"] > APART, gaps  # vLLM kept the last head it was given

    back_to_the_base(r, JOB, url)  # onlinerl policy pin 0: the reloader reloads v0's copy of the base with its head
    ids, lps = served_logprobs(tiny_full_engine)
    gaps = {"base": gap(base_model, ids, lps), "v1": gap(trained, ids, lps)}
    print(f"back on v0: log-prob gaps {gaps}")
    assert gaps["base"] < SAME and gaps["v1"] > APART, gaps
    assert tiny_full_engine.greedy() == tiny_full_engine.base_text
