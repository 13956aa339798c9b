"""Image corruptions of CIFAR-10-C's kinds and severity levels (Hendrycks and Dietterich,
"Benchmarking Neural Network Robustness to Common Corruptions and Perturbations", ICLR 2019),
computed here on images (N, C, H, W) in [0, 1]: the feature-shift groups of the ``corrupted``
scenarios. Never downloaded: CIFAR-10-C's files are these functions applied to CIFAR-10's test
set, and computing them lets every split and every data set (MNIST too) have them.

The severity parameters are CIFAR-10-C's (its ``make_cifar_c.py``), used unchanged on 28 x 28
images. Noise draws come from a generator seeded by the caller, so a scenario is the same in
every run.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from stocfl.errors import UserError

# kind -> its parameter at severity 1..5 (CIFAR-10-C)
SEVERITIES: dict[str, tuple[float, ...]] = {
    "gaussian_noise": (0.04, 0.06, 0.08, 0.09, 0.10),  # std of the added noise
    "shot_noise": (500, 250, 100, 75, 50),  # photons per unit intensity (Poisson)
    "impulse_noise": (0.01, 0.02, 0.03, 0.05, 0.07),  # share of pixels set to 0 or 1
    "contrast": (0.75, 0.5, 0.4, 0.3, 0.15),  # factor on the distance to the image's mean
    "brightness": (0.05, 0.1, 0.15, 0.2, 0.3),  # added to HSV's value
    "gaussian_blur": (0.4, 0.6, 0.7, 0.8, 1.0),  # sigma in pixels
}
CORRUPTIONS = tuple(SEVERITIES)


def _gaussian_blur(x: torch.Tensor, sigma: float) -> torch.Tensor:
    """A separable Gaussian filter truncated at 4 sigma, edges extended (scikit-image's
    ``filters.gaussian`` defaults, which CIFAR-10-C calls)."""
    radius = int(4.0 * sigma + 0.5)
    t = torch.arange(-radius, radius + 1, dtype=torch.float64)
    k = torch.exp(-0.5 * (t / sigma) ** 2)
    k = (k / k.sum()).to(x.dtype)
    n, c, h, w = x.shape
    y = x.reshape(n * c, 1, h, w)
    y = F.conv2d(F.pad(y, (radius, radius, 0, 0), mode="replicate"), k.view(1, 1, 1, -1))
    y = F.conv2d(F.pad(y, (0, 0, radius, radius), mode="replicate"), k.view(1, 1, -1, 1))
    return y.reshape(n, c, h, w)


def _brightness(x: torch.Tensor, c: float) -> torch.Tensor:
    """HSV's value V = max over channels raised by c (clipped to 1), hue and saturation kept:
    every channel scaled by V' / V (a black pixel, V = 0, becomes grey c)."""
    v = x.amax(dim=1, keepdim=True)
    v_new = (v + c).clamp(max=1.0)
    scaled = x * torch.where(v > 0, v_new / v.clamp(min=1e-12), torch.zeros_like(v))
    return torch.where(v > 0, scaled, v_new.expand_as(x))


def corrupt(x: torch.Tensor, kind: str, severity: int, seed: int = 0) -> torch.Tensor:
    """``x`` (N, C, H, W) in [0, 1] corrupted by ``kind`` at ``severity`` (1..5), in [0, 1]."""
    if kind not in SEVERITIES:
        raise UserError(f"corruption {kind!r}: unknown; choose one of {', '.join(CORRUPTIONS)}")
    if not (isinstance(severity, int) and 1 <= severity <= 5):
        raise UserError(f"corruption {kind}: severity = {severity!r}, expected an integer 1..5")
    c = SEVERITIES[kind][severity - 1]
    g = torch.Generator().manual_seed(int(seed))
    if kind == "gaussian_noise":
        out = x + c * torch.randn(x.shape, generator=g, dtype=x.dtype)
    elif kind == "shot_noise":
        out = torch.poisson(x.double() * c, generator=g).to(x.dtype) / c
    elif kind == "impulse_noise":
        u = torch.rand(x.shape, generator=g, dtype=torch.float64)
        salt = torch.rand(x.shape, generator=g, dtype=torch.float64) < 0.5
        out = torch.where(u < c, salt.to(x.dtype), x)
    elif kind == "contrast":
        mean = x.mean(dim=(2, 3), keepdim=True)  # per image and channel, as CIFAR-10-C's axes (0, 1)
        out = (x - mean) * c + mean
    elif kind == "brightness":
        out = _brightness(x, c)
    else:
        out = _gaussian_blur(x, c)
    return out.clamp(0.0, 1.0)


def corruption_seed(kind: str, split: str, seed: int) -> int:
    """A seed per (kind, split, scenario seed): train and test draw different noise."""
    return (seed * 1_000_003 + CORRUPTIONS.index(kind) * 7919 + (split == "test")) % (2**63 - 1) or 1


__all__ = ["CORRUPTIONS", "SEVERITIES", "corrupt", "corruption_seed"]
