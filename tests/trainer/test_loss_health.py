"""The two figures that say whether rejections teach and whether the policy stays stable (learner.health_stats), and
the running entropy the band applies to (learner.running_entropy, EntropyWindow)."""

from __future__ import annotations

import logging

import pytest
import torch

from onlinerl.config import AlgorithmConfig
from onlinerl_trainer.learner import EntropyWindow, health_stats, running_entropy


def test_negative_advantage_share_counts_samples_below_zero():
    adv = torch.tensor([-0.1, -0.25, 0.0, 0.9, -0.05, 0.2, -1.0, -0.3])
    out = health_stats({"entropy": 1.0}, adv, 0.2, 2.0)
    assert out["negative_advantage_share"] == pytest.approx(5 / 8)
    assert out["entropy_out_of_band"] == 0.0
    assert health_stats({}, torch.zeros(0), 0.2, 2.0)["negative_advantage_share"] == 0.0


@pytest.mark.parametrize(("entropy", "outside"), [(0.1, 1.0), (0.2, 0.0), (1.05, 0.0), (2.0, 0.0), (2.33, 1.0)])
def test_entropy_band_warns_outside(entropy, outside, caplog):
    with caplog.at_level(logging.WARNING, logger="onlinerl.trainer"):
        out = health_stats({"entropy": entropy}, torch.tensor([-0.25]), 0.2, 2.0)
    assert out["entropy_out_of_band"] == outside
    assert ("outside the band [0.200, 2.000]" in caplog.text) == bool(outside)


def test_entropy_band_must_be_ordered():
    with pytest.raises(ValueError, match=r"entropyMin \(2.0\) must be below entropyMax \(1.0\)"):
        AlgorithmConfig(entropy_min=2.0, entropy_max=1.0)


def test_running_entropy_weighs_the_newest_updates_by_their_tokens():
    updates = [(2.5, 400.0), (0.1, 40.0), (1.0, 200.0), (0.5, 300.0)]  # oldest first
    # newest back until 400 tokens: 300 at 0.5 and 200 at 1.0
    assert running_entropy(updates, 400) == pytest.approx((0.5 * 300 + 1.0 * 200) / 500)
    assert running_entropy(updates, 0) == 0.5  # the newest update alone
    everything = sum(e * t for e, t in updates) / sum(t for _, t in updates)
    assert running_entropy(updates, 10_000) == pytest.approx(everything)  # fewer tokens than the window: all of them
    assert running_entropy([(0.7, 0.0)], 512) == 0.7  # no token count: that update's figure
    assert running_entropy([], 512) is None


def test_one_small_update_does_not_leave_the_band_but_a_sustained_drift_does(caplog):
    """Run 14's case: a 3-sample update at 0.17 among updates near 0.8 is noise; many updates at 0.1 are collapse."""
    window = EntropyWindow(512)
    for _ in range(5):
        running = window.add(0.8, 150.0)
    running = window.add(0.17, 60.0)
    with caplog.at_level(logging.WARNING, logger="onlinerl.trainer"):
        out = health_stats({"entropy": 0.17}, torch.tensor([-0.05, 0.9, -0.05]), 0.2, 2.0, running)
    assert out["entropy_running"] == pytest.approx((0.17 * 60 + 0.8 * 600) / 660)  # 4 of the 5 fill 512
    assert out["entropy_out_of_band"] == 0.0 and "outside the band" not in caplog.text
    for _ in range(10):
        running = window.add(0.1, 150.0)
    with caplog.at_level(logging.WARNING, logger="onlinerl.trainer"):
        out = health_stats({"entropy": 0.1}, torch.tensor([-0.05]), 0.2, 2.0, running)
    assert out["entropy_running"] == pytest.approx(0.1)
    assert out["entropy_out_of_band"] == 1.0
    assert "running entropy 0.100 is outside the band [0.200, 2.000]" in caplog.text
    assert sum(t for _, t in window.updates) - window.updates[0][1] < 512  # keeps only what the window needs
