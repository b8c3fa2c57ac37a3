"""Per-token adaptive exit and energy-safe steps in the models (docs/inference_compute.md): NRGPT,
the recurrent GPT and CEM's within-layer recursion.

* a criterion that never fires (threshold 0) gives exactly the fixed-depth model;
* a plain reference loop (written out here) gives the same states and step counts;
* causality with exits: changing later tokens changes no earlier logit and no earlier step count;
* cached decoding equals the whole sequence (logits and steps), generate with and without a cache;
* an exited token stops changing while the others continue;
* ``accept_lower_energy``: no accepted step raises a token's energy over 16 steps (past the
  trained depth), and it is the plain update exactly when every step descends.
"""
import math

import pytest
import torch

from energyformer.layers.exit import EXIT_CRITERIA, ExitCriterion
from energyformer.layers.kv_cache import KVCache
from energyformer.models.cem import CEMConfig, CEMLlama
from energyformer.models.nrgpt import NRGPT, NRGPTConfig
from energyformer.models.recurrent_gpt import RecurrentGPT, RecurrentGPTConfig

V, BLOCK, N = 13, 32, 11
CRITERIA = {"nrgpt": ("abs", "rel", "kl", "energy", "grad"), "gpt_rec": ("abs", "rel", "kl"),
            "cem": ("abs", "rel", "energy", "grad")}


def perturbed(model, scale):
    """A random model whose weights are far from init (trained-like: states move, energies vary)."""
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn_like(p))
    return model.double().eval()


def make(kind, **kw):
    torch.manual_seed(0)
    if kind == "nrgpt":
        return perturbed(NRGPT(NRGPTConfig(vocab_size=V, block_size=BLOCK, d_model=16, n_heads=2, n_steps=3,
                                           **kw)), 0.2)
    if kind == "gpt_rec":
        return perturbed(RecurrentGPT(RecurrentGPTConfig(vocab_size=V, block_size=BLOCK, d_model=16, n_heads=2,
                                                         n_steps=3, **kw)), 0.2)
    return perturbed(CEMLlama(CEMConfig(vocab_size=V, block_size=BLOCK, d_model=16, n_heads=2, n_layers=2, n_steps=2,
                                        **kw)), 0.05)


@pytest.fixture(scope="module")
def models():
    return {kind: make(kind) for kind in CRITERIA}


@pytest.fixture(scope="module")
def idx():
    torch.manual_seed(1)
    return torch.randint(0, V, (2, N))


def varying_spec(model, name, idx, n_steps=8):
    """The first threshold 10^k (k = -4, -3.5, ..., 3) at which the steps differ between tokens."""
    for k in range(-8, 7):
        spec = f"{name}:{10 ** (k / 2):g}"
        with torch.no_grad():
            model(idx, exit=spec, n_steps=n_steps)
        steps = model.exit_steps
        if steps.min() < steps.max():
            return spec
    raise AssertionError(f"no threshold of {name} makes the steps differ")


@pytest.mark.parametrize("kind, name", [(k, c) for k, cs in CRITERIA.items() for c in cs])
def test_a_criterion_that_never_fires_is_the_fixed_depth_model(models, idx, kind, name):
    model = models[kind]
    with torch.no_grad():
        plain = model(idx, n_steps=5)[0]
        exited = model(idx, n_steps=5, exit=f"{name}:0")[0]
    assert torch.equal(plain, exited)
    total = 5 * (4 if kind == "cem" else 1)  # CEM: 2 layers x 2 sub-blocks, each 5 steps
    assert model.exit_steps.tolist() == [[total] * N] * 2


def reference_exit(model, idx, spec, T):
    """NRGPT / GPT_Rec with an exit, written out: step every token, freeze the exited, count."""
    from energyformer.layers.exit import parse_exit

    crit = parse_exit(spec)
    x = model.embed(idx)
    active = torch.ones(idx.shape, dtype=torch.bool)
    steps = torch.zeros(idx.shape, dtype=torch.long)
    for t in range(T):
        new = model.block(x)
        for b in range(idx.shape[0]):
            for i in range(idx.shape[1]):
                if not active[b, i]:
                    new[b, i] = x[b, i]
        steps += active.long()
        if t + 1 < T:
            from energyformer.layers.exit import ExitView

            view = ExitView(t, x, new, logits_prev=model.readout(x), logits_new=model.readout(new))
            if isinstance(model, NRGPT):
                view.energy_prev, view.energy_new = model.energy(x)["total"], model.energy(new)["total"]
                view.grad_new = model.block.force(new)
            active &= ~crit.fires(view)
        x = new
    return model.readout(x), steps


@pytest.mark.parametrize("kind, name", [(k, c) for k in ("nrgpt", "gpt_rec") for c in CRITERIA[k]])
def test_exit_equals_the_written_out_reference(models, idx, kind, name):
    model = models[kind]
    spec = varying_spec(model, name, idx)
    with torch.no_grad():
        logits = model(idx, exit=spec, n_steps=8)[0]
        ref, ref_steps = reference_exit(model, idx, spec, 8)
    torch.testing.assert_close(logits, ref, rtol=0, atol=1e-12)
    assert torch.equal(model.exit_steps, ref_steps)


@pytest.mark.parametrize("kind, name", [(k, c) for k, cs in CRITERIA.items() for c in cs])
def test_exits_are_causal(models, idx, kind, name):
    model = models[kind]
    spec = varying_spec(model, name, idx)
    other = idx.clone()
    other[:, 6:] = (other[:, 6:] + 5) % V
    with torch.no_grad():
        a, steps_a = model(idx, exit=spec, n_steps=8)[0], model.exit_steps
        b, steps_b = model(other, exit=spec, n_steps=8)[0], model.exit_steps
    torch.testing.assert_close(a[:, :6], b[:, :6], rtol=0, atol=1e-12)
    assert torch.equal(steps_a[:, :6], steps_b[:, :6])
    assert not torch.equal(steps_a, steps_b) or not torch.allclose(a[:, 6:], b[:, 6:])


def cached_run(model, idx, split, **kw):
    cache = KVCache()
    outs, steps = [model(idx[:, :split], cache=cache, **kw)[0]], [model.exit_steps]
    for i in range(split, idx.shape[1]):
        outs.append(model(idx[:, i:i + 1], cache=cache, **kw)[0])
        steps.append(model.exit_steps)
    return torch.cat(outs, 1), torch.cat(steps, 1)


@pytest.mark.parametrize("kind, name", [(k, c) for k, cs in CRITERIA.items() for c in cs])
def test_cached_equals_uncached_with_exits(models, idx, kind, name):
    model = models[kind]
    spec = varying_spec(model, name, idx)
    with torch.no_grad():
        full, steps = model(idx, exit=spec, n_steps=8)[0], model.exit_steps
        got, got_steps = cached_run(model, idx, 4, exit=spec, n_steps=8)
    torch.testing.assert_close(got, full, rtol=0, atol=1e-10)
    assert torch.equal(got_steps, steps)


@pytest.mark.parametrize("kind", ["nrgpt", "gpt_rec", "cem"])
def test_generate_with_exit_cached_equals_uncached_and_reports_steps(models, idx, kind):
    model = models[kind]
    spec = varying_spec(model, "rel", idx)
    kw = dict(temperature=0, exit=spec, n_steps=8)
    cached = model.generate(idx[:, :5], 6, **kw)
    steps = model.generated_exit_steps
    plain = model.generate(idx[:, :5], 6, use_cache=False, **kw)
    assert torch.equal(cached, plain) and torch.equal(model.generated_exit_steps, steps)
    assert steps.shape == (2, 6) and int(steps.max()) <= 8 * (4 if kind == "cem" else 1)
    lists = model.generate([idx[0, :5].tolist(), idx[1, :3].tolist()], 4, **kw)  # prompts of two lengths
    assert [len(s) for s in model.generated_exit_steps] == [len(lists[0]) - 5, len(lists[1]) - 3]


@pytest.mark.parametrize("kind", ["nrgpt", "cem"])
def test_monotone_cached_equals_uncached(models, idx, kind):
    model = models[kind]
    spec = varying_spec(model, "kl" if kind == "nrgpt" else "rel", idx)
    with torch.no_grad():
        full, steps = model(idx, exit=spec, n_steps=8, accept_lower_energy=True)[0], model.exit_steps
        got, got_steps = cached_run(model, idx, 3, exit=spec, n_steps=8, accept_lower_energy=True)
    torch.testing.assert_close(got, full, rtol=0, atol=1e-10)
    assert torch.equal(got_steps, steps)


class _FirstTokenExits(ExitCriterion):
    """Exit position 0 after its first step (test criterion)."""

    def score(self, view):
        s = torch.ones(view.x_new.shape[:-1], dtype=torch.float64)
        s[:, 0] = 0.0
        return s


def test_an_exited_token_stops_while_the_others_continue(models, idx):
    EXIT_CRITERIA.register("test_first_token")(_FirstTokenExits)
    try:
        model = models["nrgpt"]  # strict mask: token 0 sees only itself
        with torch.no_grad():
            exited, steps = model(idx, exit="test_first_token:0.5", n_steps=6)[0], model.exit_steps
            one = model(idx, n_steps=1)[0]
            six = model(idx, n_steps=6)[0]
        assert model.exit_steps is None  # a call without exit clears it
        assert steps[:, 0].tolist() == [1, 1] and steps[:, 1:].eq(6).all()
        torch.testing.assert_close(exited[:, 0], one[:, 0], rtol=0, atol=0)
        assert not torch.allclose(exited[:, 1:], six[:, 1:])  # later tokens read token 0's frozen state
    finally:
        EXIT_CRITERIA.unregister("test_first_token")


def test_exit_errors(models, idx):
    with pytest.raises(ValueError, match="'energy' needs.*usable criteria here: abs, rel, kl"):
        models["gpt_rec"](idx, exit="energy:1e-3")
    with pytest.raises(ValueError, match="'kl' needs.*no next-token readout inside a layer"):
        models["cem"](idx, exit="kl:1e-3")
    with pytest.raises(ValueError, match="not both"):
        models["nrgpt"](idx, exit="kl:1e-3", stop_tol=1e-3)
    with pytest.raises(ValueError, match="unknown exit criterion 'kk'"):
        models["nrgpt"](idx, exit="kk:1")
    cache = KVCache()
    models["nrgpt"](idx[:, :3], cache=cache, exit="kl:1e-3")
    with pytest.raises(ValueError, match="start a new cache"):
        models["nrgpt"](idx[:, 3:4], cache=cache, exit="kl:1e-2")


# ------------------------------------------------------------------ energy-safe steps (item 3)
def nrgpt_states(model, idx, T, **kw):
    with torch.no_grad():
        return [model.descend(model.embed(idx), n_steps=t, **kw) if t else model.embed(idx) for t in range(T + 1)]


def test_nrgpt_monotone_never_raises_a_tokens_energy_over_16_steps():
    model = make("nrgpt", mask="strict")  # a free η far from init: plain steps can raise the energy
    torch.manual_seed(2)
    idx = torch.randint(0, V, (2, N))
    blk = model.block
    plain = nrgpt_states(model, idx, 16)
    rises = [(blk.energy_in_context(b, a) - model.energy(a)["total"]).max() for a, b in zip(plain, plain[1:])]
    assert max(rises) > 1e-6  # the plain descent raises some token's energy: the test can fail
    safe = nrgpt_states(model, idx, 16, accept_lower_energy=True)
    for a, b in zip(safe, safe[1:]):
        # each token's energy with the context where its step was taken never rises ...
        assert bool((blk.energy_in_context(b, a) <= model.energy(a)["total"]).all())
    # ... and token 0 (strict mask: no context) has a non-increasing energy outright
    e0 = torch.stack([model.energy(s)["total"][:, 0] for s in safe])
    assert bool((e0[1:] <= e0[:-1]).all())


def test_nrgpt_monotone_is_the_plain_update_when_every_step_descends():
    model = make("nrgpt", eta_param="c_diag_gamma", c_init=0.01)
    torch.manual_seed(3)
    idx = torch.randint(0, V, (2, N))
    plain = nrgpt_states(model, idx, 6)
    for a, b in zip(plain, plain[1:]):
        assert bool((model.block.energy_in_context(b, a) <= model.energy(a)["total"]).all())  # every step descends
    with torch.no_grad():
        assert torch.equal(model(idx, n_steps=6, accept_lower_energy=True)[0], model(idx, n_steps=6)[0])


@pytest.mark.parametrize("sub", ["attn", "mlp"])
def test_cem_monotone_energy_is_non_increasing_per_token_over_16_steps(sub):
    from energyformer.layers.cem import CEMAttention, CEMGatedMLP

    torch.manual_seed(4)
    layer = CEMAttention(16, 2, n_steps=1, step_size=3.0) if sub == "attn" else CEMGatedMLP(16, 32, 1, step_size=3.0)
    layer = perturbed(layer, 0.3)
    x = torch.randn(2, N, 16, dtype=torch.float64)

    def energies(**kw):
        with torch.no_grad():
            return torch.stack([layer.energy(layer(x, n_steps=k, **kw), x) if k else layer.energy(x, x)
                                for k in range(17)])

    plain = energies()
    assert bool((plain[1:] > plain[:-1] + 1e-9).any())  # η = 3 overshoots: the test can fail
    safe = energies(accept_lower_energy=True)
    assert bool((safe[1:] <= safe[:-1]).all())
    assert float(safe[-1].sum()) < float(safe[0].sum())


def test_cem_monotone_is_the_plain_update_when_every_step_descends(models, idx):
    model = make("cem", attn_step_size=0.05, mlp_step_size=0.05)
    with torch.no_grad():
        assert torch.equal(model(idx, n_steps=4, accept_lower_energy=True)[0], model(idx, n_steps=4)[0])


def test_max_halvings_zero_rejects_every_rising_step():
    model = make("nrgpt")
    with torch.no_grad():
        x0 = model.embed(torch.randint(0, V, (1, N)))
        x1 = model.descend(x0, n_steps=1, accept_lower_energy=True, max_halvings=0)
        full = model.descend(x0, n_steps=1)
    moved = (x1 - x0).abs().sum(-1) > 0
    assert torch.equal(x1[moved], full[moved]) and torch.equal(x1[~moved], x0[~moved])
    assert not math.isnan(float(x1.sum()))


@pytest.mark.parametrize("kind", ["nrgpt", "cem"])
def test_monotone_steps_with_an_exit_are_causal(models, idx, kind):
    model = models[kind]
    other = idx.clone()
    other[:, 6:] = (other[:, 6:] + 5) % V
    kw = dict(exit="rel:0.05", n_steps=12, accept_lower_energy=True)
    with torch.no_grad():
        a, steps_a = model(idx, **kw)[0], model.exit_steps
        b, steps_b = model(other, **kw)[0], model.exit_steps
    torch.testing.assert_close(a[:, :6], b[:, :6], rtol=0, atol=1e-12)
    assert torch.equal(steps_a[:, :6], steps_b[:, :6])


def test_inspect_report_of_a_cem_with_an_exit_has_its_steps_and_the_energy_loss_correlation(models, idx):
    from energyformer.inspect.energy import energy_report

    model = models["cem"]
    report = energy_report(model, idx[:1], exit="rel:0.05", n_steps=8)
    with torch.no_grad():
        model(idx[:1], exit="rel:0.05", n_steps=8)
    assert report["steps_taken"] == model.exit_steps[0].tolist()
    assert len(report["per_token"]["energy"]) == N and report["energy_vs_loss"]["n"] == N - 1


@pytest.mark.parametrize("sub", ["attn", "mlp"])
@pytest.mark.parametrize("name", ["rel", "energy", "grad"])
def test_cem_exit_equals_the_plain_states_at_each_tokens_exit_step(sub, name):
    """A CEM sub-block's context is fixed, so token i's state after an exit is the plain state after
    steps_i steps, and steps_i is the first step where the criterion fires on the plain states."""
    from energyformer.layers.cem import CEMAttention, CEMGatedMLP
    from energyformer.layers.exit import ExitView, parse_exit

    torch.manual_seed(5)
    layer = CEMAttention(16, 2, n_steps=2) if sub == "attn" else CEMGatedMLP(16, 32, 2)
    layer = perturbed(layer, 0.3)
    x = torch.randn(2, N, 16, dtype=torch.float64)
    T = 10
    with torch.no_grad():
        plain = [x] + [layer(x, n_steps=k) for k in range(1, T + 1)]
        h_hat = layer._normalize(x)
        spec = None
        for k in range(-8, 7):  # a threshold at which the tokens' exit steps differ
            spec = f"{name}:{10 ** (k / 2):g}"
            got = layer(x, n_steps=T, exit=spec)
            if layer.exit_steps.min() < layer.exit_steps.max():
                break
        crit, steps = parse_exit(spec), layer.exit_steps
        ctx = layer._context(h_hat)
        want = torch.full(steps.shape, T)
        for t in range(T - 1):  # the first step t whose transition fires: the token got t + 1 steps
            a, b = plain[t], plain[t + 1]
            view = ExitView(t, a, b, energy_prev=layer.energy(a, x), energy_new=layer.energy(b, x),
                            grad_new=layer._grad(layer._normalize(b), h_hat, ctx))
            fired = crit.fires(view) & (want == T)
            want[fired] = t + 1
    assert torch.equal(steps, want)
    for b in range(2):
        for i in range(N):
            torch.testing.assert_close(got[b, i], plain[int(steps[b, i])][b, i], rtol=0, atol=1e-12)


@pytest.mark.parametrize("kind", ["nrgpt", "gpt_rec", "cem"])
def test_a_cache_is_used_with_one_exit(models, idx, kind):
    model = models[kind]
    cache = KVCache()
    with torch.no_grad():
        model(idx[:, :3], cache=cache, exit="rel:0.05", n_steps=4)
        model(idx[:, 3:4], cache=cache, exit="rel:0.05", n_steps=4)  # the same: fine
        with pytest.raises(ValueError, match="start a new cache"):
            model(idx[:, 4:5], cache=cache, exit="rel:0.1", n_steps=4)
        with pytest.raises(ValueError, match="start a new cache"):
            model(idx[:, 4:5], cache=cache, n_steps=4)
