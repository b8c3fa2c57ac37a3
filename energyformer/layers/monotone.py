"""Energy-safe descent steps: accept a token's step only if it lowers that token's energy
(docs/inference_compute.md §5).

For an energy model (CEM sub-blocks, NRGPT) the step of token ``i`` is ``x_i ← x_i − s_i Δ_i``
with ``Δ_i`` the model's full step (``η P ∇ε`` for CEM, ``κ η ∂E/∂g`` for NRGPT). With
``accept_lower_energy=True`` a token first tries ``s_i = 1``; if its energy does not fall
(``E_i(candidate) > E_i(x)``) it halves ``s_i`` and tries again, at most ``max_halvings`` times; if
no trial lowers the energy the step is rejected and the token keeps ``x_i``. So no accepted step
raises the token's energy, whatever the number of steps (running past the trained depth
included), and when the full step already descends for every token the result is the plain
update exactly (the first trial is the plain step itself, bit for bit).

The energy ``E_i`` is the one the step descends with the context held where the step was
computed: CEM's ``ε(g_i | ĥ)`` (its context ``ĥ`` is fixed, so this is the token's whole energy)
and NRGPT's ``E_i`` with earlier tokens at their step-``t`` states (docs/inference_compute.md §5:
the earlier tokens' own moves can still change ``E_i``; causality forbids undoing them).
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from energyformer._validate import check_int

__all__ = ["accept_lower_energy_step", "DEFAULT_MAX_HALVINGS"]

#: halvings of the step a token tries before its step is rejected
DEFAULT_MAX_HALVINGS = 4


def accept_lower_energy_step(x: torch.Tensor, x_full: torch.Tensor, energy: Callable[[torch.Tensor], torch.Tensor],
                             max_halvings: int = DEFAULT_MAX_HALVINGS, e_old: torch.Tensor | None = None,
                             return_energy: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The per-token accepted step ``(B, N, d)``.

    Args:
        x: the states before the step ``(B, N, d)``.
        x_full: the plain full step's result ``x − Δ`` ``(B, N, d)`` (returned unchanged for every
            token whose energy it lowers or keeps).
        energy: ``energy(states (B, N, d)) -> (B, N)`` per-token energies with the context held
            fixed (a token's value must not depend on the other tokens' rows of ``states``).
        max_halvings: how many times a token may halve its step before the step is rejected (≥ 0).
        e_old: ``energy(x)`` if already computed.
        return_energy: also return the energies of the result (``(B, N)``, computed on the way):
            with a fixed context (CEM) they are the next step's ``e_old``.

    Returns:
        ``x − s Δ`` per token with ``s ∈ {1, 1/2, …, 2^-max_halvings}`` the first trial whose
        energy is ``≤`` the old one, or ``x`` itself (rejected); with ``return_energy`` the pair
        ``(states, energies)``.

    Raises:
        ValueError: ``max_halvings`` not an integer ≥ 0.
    """
    check_int("max_halvings", max_halvings, 0)
    with torch.no_grad():  # the energies only decide; the accepted states keep their graph
        if e_old is None:
            e_old = energy(x)
    delta = x - x_full
    out, e_out = x, e_old
    pending = torch.ones(x.shape[:-1], dtype=torch.bool, device=x.device)
    scale = 1.0
    for k in range(max_halvings + 1):
        cand = x_full if k == 0 else x - scale * delta
        with torch.no_grad():
            e_cand = energy(cand)
            ok = pending & (e_cand <= e_old)
        out = torch.where(ok.unsqueeze(-1), cand, out)
        e_out = torch.where(ok, e_cand, e_out)
        pending = pending & ~ok
        if not bool(pending.any()):
            break
        scale *= 0.5
    return (out, e_out) if return_energy else out
