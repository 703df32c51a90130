"""The two figures that say whether rejections teach and whether the policy stays stable (learner.health_stats)."""

from __future__ import annotations

import logging

import pytest
import torch

from onlinerl.config import AlgorithmConfig
from onlinerl_trainer.learner import health_stats


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
