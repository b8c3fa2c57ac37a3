"""Randomized-depth training: the number of recurrent steps of each optimizer step, drawn from a
sampler, and truncated back-propagation through the last ``k`` of them (issue 29).

One draw ``D`` per optimizer step, shared by its ``grad_accum_steps`` micro-batches and by every
rank; the model runs ``D`` steps through its forward's ``n_steps`` argument and back-propagates
through the last ``k = train.backprop_steps`` (``backprop_steps`` argument; the first ``D − k``
steps run under ``torch.no_grad()``, :mod:`energyformer.layers.truncation`). For NRGPT and
GPT_Rec ``D`` is the number of applications of the shared block; for CEM it is the recursion
``T`` of both sub-blocks of every layer, and the truncation is inside each sub-block.

The samplers (``train.depth_sampler``), each giving an integer ``D ≥ 1``:

* ``fixed``: ``D`` = the model's own ``n_steps``; nothing is drawn and the forward is called
  exactly as without this module (with ``backprop_steps`` only when it is set);
* ``poisson_lognormal`` (Huginn's scheme) with mean ``m = train.depth_mean > 1``::

      τ ~ N(log(m − 1) − σ²/2, σ²),  σ = 0.5,   λ = exp(τ)      (log-normal, E[λ] = m − 1)
      D = 1 + Poisson(λ)                                         (E[D] = m exactly, D ≥ 1)
      D ← min(D, depth_max)                                      (only with train.depth_max)

  Var[D] = (m − 1) + (m − 1)²(e^{σ²} − 1); the cap lowers the mean (P(D > 2m) ≈ 5%
  at m = 8), so the drawn mean is ``m`` only without it;
* ``uniform``: ``D`` uniform on the integers ``depth_min … depth_max``.

The draws come from a ``torch.Generator`` of their own on the CPU, seeded with
``(train.seed + DEPTH_SEED_OFFSET) mod 2³²`` (the CPU generator reads only the low 32 bits of a
seed, so a plain ``train.seed + 2³²`` would replay the batch stream's numbers): never the batch
stream's or the model's RNG, so the batches of two runs of one seed stay paired whatever their
samplers, and every rank draws the same ``D`` without communicating. The generator's state is
saved in the checkpoint's train state (``extra["depth_generator"]``) and restored on resume, so
N steps + resume + M steps draw what N + M steps draw. ``metrics.jsonl`` records the ``depth`` of
every logged step (not with ``fixed``).

Where it applies (:func:`check_supported`): models whose forward takes ``backprop_steps``
(NRGPT, GPT_Rec / GPT_Rec_parallel, CEM); a CEM model with ``per_step_scale`` (one factor per
trained step) or with different ``attn_n_steps`` and ``mlp_n_steps`` takes no sampler.

Evaluation, sampling and export run the model's configured ``n_steps``: set ``model.n_steps`` to
the depth to evaluate at (e.g. the mean).
"""
from __future__ import annotations

import math
from typing import Any

import torch

from energyformer.models.registry import ARCH_SPECS, get_spec
from energyformer.runs.config import TrainConfig

__all__ = ["DepthSampler", "check_supported", "LOGNORMAL_SIGMA", "DEPTH_SEED_OFFSET", "STATE_KEY"]

#: σ of the log-normal rate of ``poisson_lognormal`` (Huginn's value)
LOGNORMAL_SIGMA = 0.5
#: added to ``train.seed`` (mod 2³²) to seed the depth generator (the first 32 bits of frac(√2))
DEPTH_SEED_OFFSET = 0x6A09E667
#: the key of the generator state in the checkpoint's ``train_state["extra"]``
STATE_KEY = "depth_generator"


def _given(tc: TrainConfig) -> str:
    keys = [f"train.depth_sampler={tc.depth_sampler!r}"] if tc.depth_sampler != "fixed" else []
    keys += [f"train.backprop_steps={tc.backprop_steps}"] if tc.backprop_steps is not None else []
    return " and ".join(keys)


def check_supported(model_cfg: Any, tc: TrainConfig) -> None:
    """Refuse randomized depth or truncated back-propagation for a model that cannot take them.

    Raises:
        ValueError: ``train.depth_sampler`` other than ``fixed`` or ``train.backprop_steps`` set for
            an arch without recurrent steps (gpt, llama, regressor: its forward takes no
            ``backprop_steps``), or a sampler for a CEM model with ``per_step_scale`` or with
            ``attn_n_steps`` ≠ ``mlp_n_steps``. One line naming the keys and the model's values.
    """
    if tc.depth_sampler == "fixed" and tc.backprop_steps is None:
        return
    arch = model_cfg.arch
    if not get_spec(arch).takes("backprop_steps"):
        recurrent = " or ".join(repr(a) for a in ARCH_SPECS if get_spec(a).takes("backprop_steps"))
        verb = "need" if " and " in _given(tc) else "needs"
        raise ValueError(f"{_given(tc)} {verb} a recurrent model (arch {recurrent}); "
                         f"model.arch={arch!r} has no recurrent steps (leave train.depth_sampler 'fixed' "
                         "and train.backprop_steps null)")
    if tc.depth_sampler == "fixed":
        return
    # what a config with per-step factors or per-sub-block step counts (CEM) cannot draw
    if getattr(model_cfg, "per_step_scale", False):
        raise ValueError(f"train.depth_sampler={tc.depth_sampler!r} cannot train a {model_cfg.arch.upper()} model "
                         "with model.per_step_scale=true (one factor per trained step); use "
                         "train.depth_sampler 'fixed' or model.per_step_scale false")
    attn, mlp = (getattr(model_cfg, f"{k}_n_steps", None) for k in ("attn", "mlp"))
    if attn != mlp:
        raise ValueError(f"train.depth_sampler={tc.depth_sampler!r} draws one recursion depth for both "
                         f"sub-blocks, but model.attn_n_steps={attn} and model.mlp_n_steps={mlp} differ; give "
                         "them one value (model.n_steps)")


class DepthSampler:
    """The depth of each optimizer step, from ``tc`` (a validated :class:`TrainConfig`).

    :meth:`draw` gives the step's depth (an ``int >= 1``, or ``None`` for ``fixed``: the model's
    own ``n_steps``); :meth:`forward_kwargs` the keywords of the model's forward for it;
    :meth:`state` / :meth:`load_state` the generator state kept in the train state.
    """

    def __init__(self, tc: TrainConfig):
        self.kind, self.backprop_steps = tc.depth_sampler, tc.backprop_steps
        self.mean, self.low, self.high = tc.depth_mean, tc.depth_min, tc.depth_max
        self.generator = torch.Generator().manual_seed((tc.seed + DEPTH_SEED_OFFSET) % 2**32)

    def draw(self) -> int | None:
        """The depth ``D`` of the next optimizer step (module docstring); ``None`` for ``fixed``."""
        if self.kind == "fixed":
            return None
        if self.kind == "uniform":
            return int(torch.randint(self.low, self.high + 1, (), generator=self.generator))
        sigma = LOGNORMAL_SIGMA
        tau = torch.randn((), dtype=torch.float64, generator=self.generator)
        rate = torch.exp(math.log(self.mean - 1) - sigma**2 / 2 + sigma * tau)
        depth = 1 + int(torch.poisson(rate, generator=self.generator))
        return depth if self.high is None else min(depth, self.high)

    def forward_kwargs(self, depth: int | None) -> dict[str, int]:
        """``{"n_steps": D, "backprop_steps": k}`` without the ``None`` ones: ``{}`` for the
        default (``fixed``, no truncation), so such a run calls ``model(x, y)`` as before."""
        kwargs = {"n_steps": depth, "backprop_steps": self.backprop_steps}
        return {k: v for k, v in kwargs.items() if v is not None}

    def state(self) -> dict[str, torch.Tensor]:
        """What the checkpoint keeps: ``{STATE_KEY: generator state}`` (``{}`` for ``fixed``,
        whose checkpoints stay as they were)."""
        return {} if self.kind == "fixed" else {STATE_KEY: self.generator.get_state()}

    def load_state(self, extra: dict[str, Any]) -> None:
        """Continue the draws of a checkpoint (its ``train_state["extra"]``); a checkpoint without
        them (a run that had ``fixed``) leaves the freshly seeded generator."""
        if self.kind != "fixed" and STATE_KEY in extra:
            self.generator.set_state(extra[STATE_KEY])
