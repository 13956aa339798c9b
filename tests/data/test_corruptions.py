"""The corruptions against plain references: the Gaussian blur against scipy's filter, the
brightness against colorsys's HSV pixel by pixel, the contrast against its formula in numpy;
the noises by their statistics; all in [0, 1], the same for the same seed."""

from __future__ import annotations

import colorsys

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import ndimage

from stocfl.data.corruptions import CORRUPTIONS, SEVERITIES, corrupt
from stocfl.errors import UserError


def images(seed: int, n: int = 3, c: int = 3, h: int = 9, w: int = 7) -> torch.Tensor:
    return torch.rand((n, c, h, w), generator=torch.Generator().manual_seed(seed))


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**16), severity=st.integers(1, 5), c=st.sampled_from([1, 3]))
def test_blur_contrast_and_brightness_equal_their_references(seed, severity, c):
    x = images(seed, c=c)
    sigma = SEVERITIES["gaussian_blur"][severity - 1]
    want = np.stack(
        [[ndimage.gaussian_filter(ch.double().numpy(), sigma, mode="nearest", truncate=4.0) for ch in im] for im in x]
    )
    assert np.allclose(corrupt(x, "gaussian_blur", severity).numpy(), want.clip(0, 1), atol=1e-6)
    k = SEVERITIES["contrast"][severity - 1]
    xn = x.double().numpy()
    mean = xn.mean(axis=(2, 3), keepdims=True)
    assert np.allclose(corrupt(x, "contrast", severity).numpy(), ((xn - mean) * k + mean).clip(0, 1), atol=1e-6)
    if c == 3:
        b = SEVERITIES["brightness"][severity - 1]
        got = corrupt(x, "brightness", severity).numpy()
        for i in range(len(x)):
            for r in range(x.shape[2]):
                for q in range(x.shape[3]):
                    hh, ss, vv = colorsys.rgb_to_hsv(*xn[i, :, r, q])
                    assert np.allclose(got[i, :, r, q], colorsys.hsv_to_rgb(hh, ss, min(1.0, vv + b)), atol=1e-5)


def test_a_black_pixel_brightens_to_grey():
    x = torch.zeros((1, 1, 2, 2))
    assert torch.allclose(corrupt(x, "brightness", 5), torch.full_like(x, 0.3))


def test_the_noises_have_their_severitys_statistics_and_their_seeds_numbers():
    x = torch.full((20, 1, 32, 32), 0.5)
    for severity in (1, 5):
        g = corrupt(x, "gaussian_noise", severity, seed=1)
        assert abs(float((g - 0.5).std()) - SEVERITIES["gaussian_noise"][severity - 1]) < 3e-3
        imp = corrupt(x, "impulse_noise", severity, seed=1)
        share = float((imp != 0.5).double().mean())
        assert abs(share - SEVERITIES["impulse_noise"][severity - 1]) < 5e-3
        assert set(torch.unique(imp).tolist()) <= {0.0, 0.5, 1.0}
        shot = corrupt(x, "shot_noise", severity, seed=1)
        lam = SEVERITIES["shot_noise"][severity - 1]
        assert abs(float(shot.mean()) - 0.5) < 0.01 and abs(float(shot.var()) - 0.5 / lam) < 0.2 * 0.5 / lam
    for kind in CORRUPTIONS:
        a, b = corrupt(images(0), kind, 3, seed=7), corrupt(images(0), kind, 3, seed=7)
        assert torch.equal(a, b) and float(a.min()) >= 0 and float(a.max()) <= 1, kind
    assert not torch.equal(corrupt(x, "gaussian_noise", 3, seed=1), corrupt(x, "gaussian_noise", 3, seed=2))


@pytest.mark.parametrize(
    "kind, severity, says", [("fog", 3, "unknown"), ("contrast", 0, "severity"), ("contrast", 6, "1..5")]
)
def test_a_bad_corruption_is_one_line(kind, severity, says):
    with pytest.raises(UserError, match=says):
        corrupt(images(0), kind, severity)
