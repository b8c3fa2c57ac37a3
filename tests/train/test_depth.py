"""Randomized-depth training (train/depth.py and its use in the training loop, issue 29).

- the samplers: ``poisson_lognormal`` has the configured mean (and the stated variance), the cap
  holds; ``uniform`` covers its range evenly; ``fixed`` draws nothing; the generator is seeded
  from ``train.seed`` but is not the batch stream's, and its state round-trips;
- only recurrent models take the keys (gpt, llama, regressor and CEM with per-step factors or two
  recursion depths are refused before anything is written);
- a default run calls the model exactly as before (no new keyword), and ``fixed`` with
  ``backprop_steps`` at the full depth gives the default run bit for bit;
- every micro-batch of a step gets the step's drawn depth, which ``metrics.jsonl`` records;
- N steps + resume + M steps equals N + M steps (losses, depths, weights) for every family.
"""
import functools
import math

import pytest
import torch
from helpers import tiny_config

from energyformer.models import get_arch
from energyformer.runs import load_config, load_run
from energyformer.runs.checkpoint import find_checkpoint, load_train_state
from energyformer.runs.config import TrainConfig
from energyformer.runs.rundir import read_metrics
from energyformer.train import train
from energyformer.train.depth import DEPTH_SEED_OFFSET, STATE_KEY, DepthSampler, check_supported

NRGPT = dict(arch="nrgpt", d_model=16, n_heads=2, n_steps=3, dropout=0.1)
GPT_REC = dict(arch="gpt_rec", d_model=16, n_heads=2, n_steps=3, dropout=0.1)
CEM = dict(arch="cem", d_model=16, n_heads=2, n_layers=2, n_steps=2)


def cfg(data_dir, out_dir, model, **train_kw):
    return tiny_config(data_dir, out_dir, model, **{"max_steps": 6, "eval_interval": 3, **train_kw})


def spy_forward(monkeypatch, arch):
    """Record the keyword arguments of every forward call of the arch's model class."""
    cls = get_arch(arch)[0]
    real, calls = cls.forward, []

    @functools.wraps(real)  # keeps the signature, which tells a recurrent model
    def forward(self, *args, **kwargs):
        if self.training and torch.is_grad_enabled() and args[0].shape[0] > 1:
            calls.append(dict(kwargs))  # training steps: not evaluation, not the FLOP count (one sequence)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(cls, "forward", forward)
    return calls


# ------------------------------------------------------------------------------------------------
# the samplers


def test_poisson_lognormal_has_the_configured_mean_and_the_stated_variance():
    m, n = 8.0, 20000
    draws = torch.tensor(_draws(TrainConfig(depth_sampler="poisson_lognormal", depth_mean=m), n), dtype=torch.float64)
    var = (m - 1) + (m - 1) ** 2 * (math.exp(0.25) - 1)  # Var[1 + Poisson(λ)], λ log-normal, σ = 0.5
    assert abs(draws.mean().item() - m) < 4 * math.sqrt(var / n)
    assert abs(draws.var().item() - var) < 0.15 * var
    assert draws.min().item() >= 1
    capped = _draws(TrainConfig(depth_sampler="poisson_lognormal", depth_mean=3.5, depth_max=5), 2000)
    assert min(capped) >= 1 and max(capped) == 5
    assert sum(d == 5 for d in capped) > sum(d == 4 for d in capped) / 4  # the tail piles up at the cap


def _draws(tc, n):
    sampler = DepthSampler(tc)
    return [sampler.draw() for _ in range(n)]


def test_uniform_covers_its_range_evenly_and_fixed_draws_nothing():
    draws = _draws(TrainConfig(depth_sampler="uniform", depth_min=2, depth_max=5), 4000)
    counts = {d: draws.count(d) for d in set(draws)}
    assert set(counts) == {2, 3, 4, 5} and min(counts.values()) > 900
    fixed = DepthSampler(TrainConfig())
    assert fixed.draw() is None and fixed.forward_kwargs(None) == {} and fixed.state() == {}
    assert DepthSampler(TrainConfig(backprop_steps=2)).forward_kwargs(None) == {"backprop_steps": 2}
    assert DepthSampler(TrainConfig(depth_sampler="uniform", depth_min=1, depth_max=3, backprop_steps=2)
                        ).forward_kwargs(3) == {"n_steps": 3, "backprop_steps": 2}


def test_the_generator_is_seeded_from_the_seed_but_is_not_the_batch_streams():
    tc = TrainConfig(depth_sampler="uniform", depth_min=1, depth_max=1000, seed=7)
    assert _draws(tc, 20) == _draws(tc, 20)
    assert _draws(tc, 20) != _draws(TrainConfig(depth_sampler="uniform", depth_min=1, depth_max=1000, seed=8), 20)
    sampler = DepthSampler(tc)
    assert sampler.generator.initial_seed() == (7 + DEPTH_SEED_OFFSET) % 2**32
    batch_stream = torch.Generator().manual_seed(tc.seed)  # what the loop draws its batches from
    assert not torch.equal(sampler.generator.get_state(), batch_stream.get_state())
    big = TrainConfig(depth_sampler="uniform", depth_min=1, depth_max=1000, seed=2**32 - 1)
    assert DepthSampler(big).generator.initial_seed() != torch.Generator().manual_seed(big.seed).initial_seed()


def test_the_sampler_state_round_trips():
    tc = TrainConfig(depth_sampler="poisson_lognormal", depth_mean=4.5)
    a = DepthSampler(tc)
    _ = [a.draw() for _ in range(5)]
    saved = a.state()
    assert set(saved) == {STATE_KEY}
    later = [a.draw() for _ in range(10)]
    b = DepthSampler(tc)
    b.load_state(saved)
    assert [b.draw() for _ in range(10)] == later
    c = DepthSampler(tc)
    c.load_state({})  # a checkpoint of a run that had 'fixed': the fresh seeded stream
    assert [c.draw() for _ in range(3)] == _draws(tc, 3)


# ------------------------------------------------------------------------------------------------
# which models take it


@pytest.mark.parametrize("model", [dict(arch="gpt", d_model=16, n_heads=2, n_layers=2),
                                   dict(arch="llama", d_model=16, n_heads=2, n_layers=2)])
@pytest.mark.parametrize("keys", [dict(depth_sampler="uniform", depth_min=1, depth_max=2), dict(backprop_steps=1)])
def test_models_without_recurrent_steps_are_refused_before_anything_is_written(data_dir, tmp_path, model, keys):
    out = tmp_path / "run"
    with pytest.raises(ValueError, match=rf"needs? a recurrent model .*model.arch='{model['arch']}' has no "
                                         "recurrent steps"):
        train(cfg(data_dir, out, model, **keys), progress=False)
    assert not out.exists()


def test_the_regressor_is_refused(tmp_path):
    run = load_config({"model": {"arch": "regressor", "d_model": 16, "n_heads": 2, "n_layers": 1, "n_steps": 2},
                       "data": {"data_dir": str(tmp_path / "gp")},
                       "train": {"out_dir": str(tmp_path / "run"), "backprop_steps": 1}})
    with pytest.raises(ValueError, match=r"train.backprop_steps=1 needs a recurrent model .*'regressor'"):
        train(run, progress=False)


def test_cem_with_per_step_factors_or_two_depths_takes_no_sampler(data_dir, tmp_path):
    uniform = dict(depth_sampler="uniform", depth_min=1, depth_max=3)
    with pytest.raises(ValueError, match=r"CEM model with model.per_step_scale=true \(one factor per trained step\)"):
        train(cfg(data_dir, tmp_path / "a", dict(CEM, per_step_scale=True), **uniform), progress=False)
    with pytest.raises(ValueError, match=r"model.attn_n_steps=2 and model.mlp_n_steps=1 differ"):
        train(cfg(data_dir, tmp_path / "b", dict(CEM, mlp_n_steps=1), **uniform), progress=False)
    # a fixed depth with truncation is fine for both
    for model in (dict(CEM, per_step_scale=True), dict(CEM, mlp_n_steps=1)):
        run = cfg(data_dir, tmp_path / "c", model, backprop_steps=1)
        check_supported(run.model, run.train)


# ------------------------------------------------------------------------------------------------
# the training loop


def test_a_default_run_calls_the_model_as_before(data_dir, tmp_path, monkeypatch):
    """No new keyword reaches the model in a default run; ``fixed`` with backprop_steps at the
    model's depth goes through the truncation path and gives the default run bit for bit."""
    calls = spy_forward(monkeypatch, "nrgpt")
    default = tmp_path / "default"
    train(cfg(data_dir, default, NRGPT), progress=False)
    assert calls and all(c == {} for c in calls)
    assert "depth" not in read_metrics(default)[0]
    assert STATE_KEY not in load_train_state(default)["extra"]  # checkpoints stay as they were

    calls.clear()
    full_depth = tmp_path / "fixed_k3"
    train(cfg(data_dir, full_depth, NRGPT, depth_sampler="fixed", backprop_steps=3), progress=False)
    assert calls and all(c == {"backprop_steps": 3} for c in calls)
    a, b = read_metrics(default), read_metrics(full_depth)
    assert [r["train_loss"] for r in a] == [r["train_loss"] for r in b]
    assert [r.get("val_loss") for r in a] == [r.get("val_loss") for r in b]
    ma, _, _ = load_run(default)
    mb, _, _ = load_run(full_depth)
    for (name, p), q in zip(ma.state_dict().items(), mb.state_dict().values()):
        assert torch.equal(p, q), name


def test_every_micro_batch_gets_the_steps_draw_and_metrics_record_it(data_dir, tmp_path, monkeypatch):
    calls = spy_forward(monkeypatch, "nrgpt")
    keys = dict(depth_sampler="uniform", depth_min=1, depth_max=5, backprop_steps=2)
    run = cfg(data_dir, tmp_path / "run", NRGPT, max_steps=8, grad_accum_steps=2, **keys)
    train(run, progress=False)
    drawn = [c["n_steps"] for c in calls]
    assert drawn[0::2] == drawn[1::2]  # both micro-batches of a step
    assert all(c["backprop_steps"] == 2 for c in calls)
    expected = _draws(run.train, 8)
    assert drawn[0::2] == expected and len(set(expected)) > 1
    assert [r["depth"] for r in read_metrics(tmp_path / "run")] == expected


@pytest.mark.parametrize("model,keys", [
    (NRGPT, dict(depth_sampler="poisson_lognormal", depth_mean=3.0, depth_max=6, backprop_steps=2)),
    (GPT_REC, dict(depth_sampler="uniform", depth_min=1, depth_max=4, backprop_steps=2)),
    (CEM, dict(depth_sampler="uniform", depth_min=1, depth_max=4, backprop_steps=1)),
], ids=["nrgpt", "gpt_rec", "cem"])
def test_resume_with_randomized_depth_is_exact(data_dir, tmp_path, model, keys):
    kw = dict(max_steps=10, lr_decay_steps=10, eval_interval=4, ckpt_interval=4, grad_accum_steps=2, **keys)
    full = tmp_path / "full"
    train(cfg(data_dir, full, model, **kw), progress=False)
    part = tmp_path / "part"
    train(cfg(data_dir, part, model, **dict(kw, max_steps=5)), progress=False)
    assert find_checkpoint(part)["step"] == 5
    assert STATE_KEY in load_train_state(part)["extra"]
    summary = train(cfg(data_dir, part, model, **kw), progress=False)
    assert summary["resumed_from"] == 5

    a, b = read_metrics(full), read_metrics(part)
    assert [r["step"] for r in a] == [r["step"] for r in b] == list(range(1, 11))
    assert [r["depth"] for r in a] == [r["depth"] for r in b]
    assert len({r["depth"] for r in a}) > 1
    assert [r["train_loss"] for r in a] == [r["train_loss"] for r in b]
    ma, _, _ = load_run(full)
    mb, _, _ = load_run(part)
    for (name, p), q in zip(ma.state_dict().items(), mb.state_dict().values()):
        assert torch.equal(p, q), name


def test_a_resume_keeps_the_runs_depth_sampler_unless_given():
    """Resuming with more steps from a recipe that does not name the sampler keeps the run's randomized depth
    (it used to fall back to the recipe's fixed depth); a sampler given on the command line wins."""
    from energyformer.runs.config import TrainConfig
    from energyformer.train.preflight import resolve_resumed_train

    saved = TrainConfig(max_steps=30, depth_sampler="poisson_lognormal", depth_mean=4.0, depth_max=12)
    new = TrainConfig(max_steps=60)
    kept, words = resolve_resumed_train(saved, new, frozenset({"max_steps"}))
    assert (kept.depth_sampler, kept.depth_mean, kept.depth_max, kept.max_steps) == ("poisson_lognormal", 4.0, 12, 60)
    assert "train.depth_sampler=poisson_lognormal" in words
    given = TrainConfig(max_steps=60, depth_sampler="uniform", depth_min=2, depth_max=6)
    kept, _ = resolve_resumed_train(saved, given, frozenset({"max_steps", "depth_sampler", "depth_min", "depth_max"}))
    assert (kept.depth_sampler, kept.depth_min, kept.depth_max) == ("uniform", 2, 6)
