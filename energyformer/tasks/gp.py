"""In-context GP regression: the exact posterior-mean floor, the prior mean and RMSE per context
length (docs/cem.md §9; data from :mod:`energyformer.data.gp`).

For a sequence ``(x_1, y_1), …, (x_n, y_n)`` with ``y = f(x) + σε``, ``f ~ GP(0, k)``, the
Bayes-optimal prediction of ``y_i`` from ``x_1, y_1, …, x_{i−1}, y_{i−1}, x_i`` (squared error)
is the posterior mean with the true kernel::

    μ_i = k(x_i, X_{<i}) (K(X_{<i}, X_{<i}) + σ² I)⁻¹ y_{<i}          (μ_1 = 0, the prior mean)

No model can beat its RMSE in expectation; the prior mean ``0`` is the no-context baseline.
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from energyformer.data.gp import rbf_kernel


def posterior_mean(xy: torch.Tensor | np.ndarray, length_scale: float, variance: float, noise: float) -> torch.Tensor:
    """Exact GP posterior mean of every ``y_i`` given the pairs before it: ``(B, n, k + 1) -> (B, n)`` float64.

    Computed per context length with a Cholesky solve in float64 (``μ_1 = 0``).

    Raises:
        ValueError: ``xy`` not 3-D with at least 2 features, or ``noise == 0`` with a singular kernel matrix.
    """
    xy = torch.as_tensor(xy).to(torch.float64)
    if xy.dim() != 3 or xy.shape[-1] < 2:
        raise ValueError(f"xy must have shape (B, n, x_dim + 1); got {tuple(xy.shape)}")
    x, y = xy[..., :-1], xy[..., -1]
    B, n = y.shape
    out = torch.zeros(B, n, dtype=torch.float64)
    for i in range(1, n):
        ctx = x[:, :i]
        K = rbf_kernel(ctx, ctx, length_scale, variance) + noise ** 2 * torch.eye(i, dtype=torch.float64)
        k_star = rbf_kernel(x[:, i:i + 1], ctx, length_scale, variance)  # (B, 1, i)
        try:
            L = torch.linalg.cholesky(K)
        except torch.linalg.LinAlgError:
            raise ValueError(f"the kernel matrix of {i} context points is singular (noise={noise}); "
                             "use noise > 0") from None
        alpha = torch.cholesky_solve(y[:, :i].unsqueeze(-1), L)  # (B, i, 1)
        out[:, i] = (k_star @ alpha).reshape(B)
    return out


def rmse_per_position(pred: torch.Tensor | np.ndarray, target: torch.Tensor | np.ndarray) -> np.ndarray:
    """Root mean squared error over the batch at each position: ``(B, n), (B, n) -> (n,)``.

    Raises:
        ValueError: the shapes differ.
    """
    pred, target = torch.as_tensor(pred).double(), torch.as_tensor(target).double()
    if pred.shape != target.shape:
        raise ValueError(f"pred shape {tuple(pred.shape)} differs from target shape {tuple(target.shape)}")
    return (pred - target).pow(2).mean(0).sqrt().numpy()


@torch.no_grad()
def evaluate_regressor(model: torch.nn.Module, xy: np.ndarray, settings: dict[str, Any],
                       batch_size: int = 256, device: str | torch.device = "cpu") -> dict[str, Any]:
    """RMSE per context length of ``model`` on ``xy`` ``(B, n, k + 1)``, beside the GP floor and the prior.

    Args:
        model: ``model(xy) -> (ŷ (B, n), _)`` (e.g. :class:`~energyformer.models.regression.SequenceRegressor`).
        xy: the test sequences.
        settings: the data's GP settings (``length_scale``, ``variance``, ``noise``; meta.json ``settings``).
        batch_size: sequences per forward.
        device: where the model runs.

    Returns:
        ``{"context": [0, 1, …, n−1] (pairs seen before the query), "model": [...], "gp_floor": [...],
        "prior": [...], "rmse_model", "rmse_gp_floor", "rmse_prior" (over all positions), "n": B}``.
    """
    was_training = model.training
    model.eval()
    try:
        preds = [model(torch.as_tensor(xy[i:i + batch_size], device=device))[0].double().cpu()
                 for i in range(0, len(xy), batch_size)]
    finally:
        model.train(was_training)
    pred = torch.cat(preds)
    y = torch.as_tensor(xy[..., -1]).double()
    floor = posterior_mean(xy, settings["length_scale"], settings["variance"], settings["noise"])

    def overall(p: torch.Tensor) -> float:
        return math.sqrt(float((p - y).pow(2).mean()))

    return {"context": list(range(y.shape[1])), "model": rmse_per_position(pred, y).tolist(),
            "gp_floor": rmse_per_position(floor, y).tolist(),
            "prior": rmse_per_position(torch.zeros_like(y), y).tolist(),
            "rmse_model": overall(pred), "rmse_gp_floor": overall(floor), "rmse_prior": overall(torch.zeros_like(y)),
            "n": int(y.shape[0])}
