"""The part every rank runs: the model, the optimizer (engine), the reference model, and the PPO update.

No Redis here. With several ranks the leader calls the same methods as a single process; each one first broadcasts
its command so the followers join the collective (``follow`` is a follower's whole life; see ranks.py).

With per-project adapters (``lines=True``, issue 39) the model holds one LoRA adapter per policy line
(``adapters.AdapterSet``); ``on_line(line)`` makes one line's adapter and optimizer the ones the update, the weights
and the resume state below use (single process, plain torch only). Outside it, everything means the shared line.
"""

from __future__ import annotations

import contextlib
import logging
import random
import time
from collections import deque
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch

from onlinerl.config import TrainerConfig
from onlinerl.keys import SHARED_LINE
from onlinerl_trainer.adapters import AdapterSet
from onlinerl_trainer.batching import Batch, StreamSample, collate
from onlinerl_trainer.checkpoint import CheckpointStore
from onlinerl_trainer.engine import Engine, build_engine
from onlinerl_trainer.policy import load_policy, load_reference, load_weights_from_checkpoint
from onlinerl_trainer.ranks import Ranks
from onlinerl_trainer.update import UpdateResult, ppo_update

log = logging.getLogger("onlinerl.trainer")


def vocab_size(model_path: Path) -> int:
    """Rows of the input embedding: a token id outside [0, vocab) cannot be trained (index error, or worse on GPU)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_path)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return int(text.vocab_size)


def pad_id(model_path: Path) -> int:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_path)
    for name in ("pad_token_id", "eos_token_id", "bos_token_id"):
        value = getattr(config, name, None)
        if isinstance(value, list):
            value = value[0] if value else None
        if value is not None:
            return int(value)
    return 0


def running_entropy(updates: Sequence[tuple[float, float]], window_tokens: int) -> float | None:
    """Token-weighted mean entropy of the newest updates that together hold at least ``window_tokens`` completion
    tokens (all of them while fewer were trained; 0: the newest update alone). ``updates``: (entropy, tokens), oldest
    first. Why a window: an update of two samples measures its entropy on ~50 tokens, too few to say the policy
    flattened or collapsed (one run's updates: 0.17-1.44, its running mean stayed inside the band)."""
    weighted = tokens_seen = 0.0
    for entropy, tokens in reversed(updates):
        weighted += entropy * tokens
        tokens_seen += tokens
        if tokens_seen >= window_tokens:
            break
    if tokens_seen > 0:
        return weighted / tokens_seen
    return updates[-1][0] if updates else None


class EntropyWindow:
    """The updates :func:`running_entropy` needs, and no older ones."""

    def __init__(self, window_tokens: int) -> None:
        self.window_tokens = window_tokens
        self.updates: deque[tuple[float, float]] = deque()

    def add(self, entropy: float, tokens: float) -> float | None:
        self.updates.append((entropy, tokens))
        while len(self.updates) > 1 and sum(t for _, t in self.updates) - self.updates[0][1] >= self.window_tokens:
            self.updates.popleft()  # the newer ones already fill the window
        return running_entropy(self.updates, self.window_tokens)


def health_stats(
    stats: dict[str, float], advantages: torch.Tensor, low: float, high: float, running: float | None = None
) -> dict[str, float]:
    """Share of samples with a negative advantage (a reject that carries gradient) and the entropy band check, on
    the running entropy when given (:class:`EntropyWindow`), else on this update's.

    The band is a warning, not a control: an entropy that leaves it means the policy is flattening (pushed-down
    rejects spread mass over junk tokens) or collapsing, which the KL penalty and the asymmetric clip should prevent.
    """
    out = {"negative_advantage_share": float((advantages < 0).float().mean()) if advantages.numel() else 0.0}
    entropy = stats.get("entropy") if running is None else running
    if running is not None:
        out["entropy_running"] = running
    outside = entropy is not None and not low <= entropy <= high
    out["entropy_out_of_band"] = 1.0 if outside else 0.0
    if outside:
        what = "running entropy" if running is not None else "entropy"
        log.warning("%s %.3f is outside the band [%.3f, %.3f]", what, entropy, low, high)
    return out


class Learner:
    """Model + optimizer of one rank, resumed from ``weights_from`` (a checkpoint folder) when given. ``lines``: keep
    an adapter per policy line (``self.adapters``), the shared line's first."""

    def __init__(
        self,
        tcfg: TrainerConfig,
        model_path: Path,
        ranks: Ranks,
        weights_from: Path | None = None,
        lines: bool = False,
    ) -> None:
        self.tcfg = tcfg
        self.algo = tcfg.algorithm
        self.ranks = ranks
        self.model_path = Path(model_path)
        self.pad_id = pad_id(self.model_path)
        self.vocab_size = vocab_size(self.model_path)
        module = load_policy(self.model_path, tcfg)
        self.reference = load_reference(self.model_path, tcfg)
        if weights_from is not None:
            load_weights_from_checkpoint(module, weights_from)
        self._engine = build_engine(module, tcfg)
        if self.reference is not None:
            self.reference.to(self._engine.device)
        self.last_command = time.monotonic()
        self.entropy_windows: dict[str, EntropyWindow] = {}
        self.adapters = AdapterSet(module, tcfg, self._engine) if lines else None
        self.line = SHARED_LINE  # the line the update, weights and state calls act on (on_line)

    @property
    def engine(self) -> Engine:
        """The engine (model + optimizer) of the line in use: the shared line's outside ``on_line``."""
        if self.adapters is None:
            return self._engine
        return self.adapters.engines[self.line]

    @contextlib.contextmanager
    def on_line(self, line: str) -> Iterator[Engine]:
        """Within the block, the update, ``trainable_weights``, ``save_state`` and ``resume`` act on ``line``'s
        adapter and optimizer, and forward passes use that adapter."""
        if line == SHARED_LINE and self.adapters is None:
            yield self._engine
            return
        assert self.adapters is not None, "a project line needs the learner's adapter set (lines=True)"
        with self.adapters.active(line) as engine:
            self.line = line
            try:
                yield engine
            finally:
                self.line = SHARED_LINE

    @property
    def entropy_window(self) -> EntropyWindow:
        """The running entropy of the line in use (each line's policy has its own)."""
        window = self.entropy_windows.get(self.line)
        if window is None:
            window = self.entropy_windows[self.line] = EntropyWindow(self.tcfg.algorithm.entropy_window_tokens)
        return window

    def rebase(self, weights_from: Path | None) -> None:
        """A human rolled back: from now on train from ``weights_from`` (a checkpoint folder; None: the base model)
        with a fresh optimizer, on every rank. The model is built again exactly as at a start from that version (the
        old model and optimizer are dropped first, so a GPU never holds both). With an adapter per line only the
        line in use (``on_line``) goes back, in place: the other lines' adapters and optimizers stay as they are."""
        if self.adapters is not None:
            engine = self.adapters.reset(self.line, weights_from)
            if self.line == SHARED_LINE:
                self._engine = engine
            self.entropy_windows.pop(self.line, None)
            return
        self._command("rebase", None if weights_from is None else str(weights_from))
        self._rebuild(weights_from)

    def _rebuild(self, weights_from: Path | None) -> None:
        del self._engine
        module = load_policy(self.model_path, self.tcfg)
        if weights_from is not None:
            load_weights_from_checkpoint(module, Path(weights_from))
        self._engine = build_engine(module, self.tcfg)
        self.entropy_windows = {}

    def resume(self, state_dir: Path, meta: dict) -> None:
        """Optimizer state (this rank's partition) and the RNG of the version resumed from, on every rank."""
        self.engine.load_state(state_dir)
        if "rng" in meta:
            random.seed(meta["rng"])
            torch.manual_seed(meta["rng"])

    # --- what the leader asks of every rank ---------------------------------------------------------------------
    def _command(self, name: str, payload: object = None) -> None:
        if self.ranks.distributed and self.ranks.leader:
            self.ranks.broadcast((name, payload))
            self.last_command = time.monotonic()

    def send_update(self, samples: list[StreamSample], advantages: list[float]) -> None:
        """Leader: give the followers this step's samples and advantages (they collate the same batch)."""
        self._command("train", (samples, advantages))

    def update_batch(self, batch: Batch, advantages: torch.Tensor) -> UpdateResult:
        """One PPO update, plus the two figures that say whether rejections teach and the policy stays stable."""
        result = ppo_update(
            self.engine, batch, advantages, self.algo, self.tcfg.micro_batch_size, self.reference, self.ranks
        )
        if self.ranks.leader:
            st = result.stats
            running = None
            if "entropy" in st and result.skipped_reason is None:
                running = self.entropy_window.add(st["entropy"], st.get("tokens", 0.0))
            st.update(health_stats(st, advantages, self.algo.entropy_min, self.algo.entropy_max, running))
            log.info(
                "update: %d samples, negative-advantage share %.2f, entropy %.3f, approx KL %.2e, KL to base %s, "
                "clip fraction %.3f, running entropy %.3f",
                len(advantages),
                st["negative_advantage_share"],
                st.get("entropy", float("nan")),
                st.get("approx_kl", float("nan")),
                f"{st['kl']:.2e}" if "kl" in st else "off (klCoef 0)",
                st.get("clip_fraction", float("nan")),
                st.get("entropy_running", float("nan")),
            )
        return result

    def trainable_weights(self) -> dict[str, torch.Tensor]:
        self._command("gather")  # a collective under ZeRO-3
        if self.adapters is not None:
            return self.adapters.weights(self.line)
        return self.engine.trainable_state_dict()

    def save_state(self, directory: Path) -> None:
        self._command("save_state", str(directory))
        self.engine.save_state(directory)
        self.ranks.barrier()  # every rank's optimizer partition is on disk before the directory is renamed

    def keep_followers_alive(self, every_s: float = 60.0) -> None:
        """Followers wait inside a collective with a timeout: an idle leader pings them."""
        if self.ranks.distributed and time.monotonic() - self.last_command >= every_s:
            self._command("idle")

    def stop_followers(self) -> None:
        self._command("stop")

    # --- a follower's whole life --------------------------------------------------------------------------------
    @classmethod
    def for_follower(cls, tcfg: TrainerConfig, model_path: Path, ranks: Ranks, store: CheckpointStore) -> Learner:
        """A follower resumes exactly the version the leader picked once it held the lease (a file it sees later
        may come from a stale trainer still draining)."""
        ranks.connect()
        name, latest = ranks.broadcast(None)
        assert name == "resume", f"expected the leader's resume command first, got {name!r}"
        learner = cls(tcfg, model_path, ranks, store.path(latest) if latest else None)
        state = store.state_for(latest) if latest else None
        if state is not None:
            learner.resume(*state)
        return learner

    def follow(self) -> None:
        """Do what the leader broadcasts until it says stop."""
        assert not self.ranks.leader
        while True:
            name, payload = self.ranks.broadcast(None)
            if name == "train":
                samples, adv = payload
                batch = collate(samples, self.tcfg.max_seq_len, self.pad_id)
                self.update_batch(batch, torch.tensor(adv, dtype=torch.float32))
            elif name == "gather":
                self.engine.trainable_state_dict()
            elif name == "save_state":
                self.engine.save_state(Path(payload))
                self.ranks.barrier()
            elif name == "rebase":
                self._rebuild(None if payload is None else Path(payload))
            elif name == "stop":
                return
