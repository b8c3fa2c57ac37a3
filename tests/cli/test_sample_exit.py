"""`energyformer sample --exit NAME:THRESHOLD --max-steps K [--monotone]` and `inspect` with an exit
(docs/inference_compute.md): the spec parser's errors name the bad value and the known criteria,
the text equals the library's generate with the same options, the steps are printed, and inspect
reports the energy against the loss."""
import json

import pytest
import torch
from run_helpers import CHARS, make_run

from energyformer.cli import main
from energyformer.data import CharTokenizer
from energyformer.layers.exit import parse_exit
from energyformer.runs.rundir import load_run


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("exit")
    return {arch: make_run(root / arch, {"arch": arch}) for arch in ("nrgpt", "gpt_rec", "cem")}


@pytest.mark.parametrize("args, message", [
    (["--exit", "kl:abc"], "error: --exit='kl:abc': the threshold 'abc' is not a number"),
    (["--exit", "klx:1e-3"], "unknown exit criterion 'klx'; known criteria: abs, rel, kl, energy, grad"),
    (["--exit", "rel:-1"], "the threshold '-1' must be a finite number >= 0"),
    (["--max-steps", "16"], "--max-steps 16 is the most steps a token gets with --exit"),
    (["--exit", "kl", "--max-steps", "0"], "error: --max-steps=0 must be >= 1"),
    (["--exit", "kl", "--max-steps", "8", "--n-steps", "4"], "--max-steps 8 and --n-steps 4 disagree"),
])
def test_sample_exit_spec_errors(runs, capsys, args, message):
    assert main(["sample", str(runs["nrgpt"]), "--max-new-tokens", "2", *args]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err, err


def test_sample_exit_needing_an_energy_on_a_recurrent_gpt(runs, capsys):
    assert main(["sample", str(runs["gpt_rec"]), "--max-new-tokens", "2", "--exit", "energy:1e-3"]) == 2
    assert "'energy' needs ['energy']" in capsys.readouterr().err
    assert main(["sample", str(runs["gpt_rec"]), "--max-new-tokens", "2", "--monotone"]) == 2
    assert "--monotone is not an option of the 'gpt_rec' model" in capsys.readouterr().err


@pytest.mark.parametrize("arch, extra", [("nrgpt", ["--monotone"]), ("gpt_rec", []), ("cem", ["--monotone"])])
def test_sample_with_exit_equals_generate_and_prints_the_steps(runs, capsys, arch, extra):
    spec = "rel:0.03" if arch != "gpt_rec" else "kl:1e-3"
    tok, model = CharTokenizer(CHARS), load_run(runs[arch])[0]
    x = torch.tensor([tok.encode("the ")])
    kw = {"accept_lower_energy": True} if extra else {}
    want = model.generate(x, 8, temperature=0, n_steps=16, exit=spec, **kw)  # KV-cached, CEM's energies too
    steps = model.generated_exit_steps
    assert main(["sample", str(runs[arch]), "--prompt", "the ", "--max-new-tokens", "8", "--temperature", "0",
                 "--exit", spec, "--max-steps", "16", *extra]) == 0
    out, err = capsys.readouterr()
    assert out == tok.decode(want[0].tolist()) + "\n"
    assert f"exit {parse_exit(spec).spec()}, at most 16 steps per token" in err
    assert f"mean {float(steps.float().mean()):.2f} steps per generated token (min {int(steps.min())}, " \
           f"max {int(steps.max())}) over 8 tokens" in err
    assert "decoding without the cache" not in err and model.supports_cached_energy()


def test_sample_decodes_without_the_cache_where_an_interaction_has_no_cached_energy(runs, capsys, monkeypatch):
    """An interaction without ``energy_from_context`` (a plugin's, say): the model says so and
    ``sample --monotone`` decodes without the cache, giving the uncached text."""
    from energyformer.layers.cem_options import Interaction

    model = load_run(runs["cem"])[0]
    cls = type(model.blocks[0].attn.interaction)
    monkeypatch.setattr(cls, "energy_from_context", Interaction.energy_from_context)
    assert not model.supports_cached_energy()
    tok, x = CharTokenizer(CHARS), torch.tensor([CharTokenizer(CHARS).encode("the ")])
    want = model.generate(x, 6, temperature=0, n_steps=4, accept_lower_energy=True, use_cache=False)
    assert main(["sample", str(runs["cem"]), "--prompt", "the ", "--max-new-tokens", "6", "--temperature", "0",
                 "--n-steps", "4", "--monotone"]) == 0
    out, err = capsys.readouterr()
    assert out == tok.decode(want[0].tolist()) + "\n" and "decoding without the cache" in err


def test_inspect_with_exit_reports_steps_and_energy_against_loss(runs, tmp_path, capsys):
    out = tmp_path / "figs"
    assert main(["inspect", str(runs["nrgpt"]), "--prompt", "the cat sat on a mat.", "--out", str(out),
                 "--exit", "rel:0.03", "--max-steps", "12", "--monotone"]) == 0
    said = capsys.readouterr().out
    trace = json.loads((out / "trace.json").read_text())
    steps = trace["steps_taken"]
    assert len(steps) == len(trace["tokens"]) and max(steps) <= 12
    assert f"steps per token: mean {sum(steps) / len(steps):.2f}" in said
    per = trace["per_token"]
    assert len(per["energy"]) == len(per["loss"]) == len(trace["tokens"]) and per["loss"][-1] is None
    corr = trace["energy_vs_loss"]
    assert corr["n"] == len(trace["tokens"]) - 1 and -1 <= corr["pearson"] <= 1 and -1 <= corr["spearman"] <= 1
    assert f"final energy vs next-token loss over {corr['n']} tokens: Pearson {corr['pearson']:+.3f}" in said


def test_eval_val_loss_runs_with_the_exit_and_the_steps(tmp_path, capsys):
    """`eval --exit SPEC --n-steps K` scores val_loss with the same forward options as the other tasks."""
    from helpers import make_data_dir

    from energyformer.eval.suite import val_loss

    data = make_data_dir(tmp_path / "data", chars=CHARS)
    run = make_run(tmp_path / "run", {"arch": "nrgpt"}, data_dir=data)
    out = tmp_path / "r.json"
    assert main(["eval", str(run), "--tasks", "val_loss", "--exit", "rel:0.03", "--n-steps", "8", "--monotone",
                 "--quiet", "--out", str(out)]) == 0
    got = json.loads(out.read_text())["tasks"]["val_loss"]["loss"]
    model = load_run(run)[0]
    bound = type("Bound", (), {"__call__": lambda self, idx, **kw: model(idx, n_steps=8, exit="rel:0.03",
                                                                         accept_lower_energy=True, **kw),
                               "config": model.config, "parameters": lambda self: model.parameters()})()
    want = val_loss(bound, data, CharTokenizer(CHARS), batch_size=8)["loss"]
    plain = val_loss(model, data, CharTokenizer(CHARS), batch_size=8)["loss"]
    assert got == pytest.approx(want, rel=1e-6) and got != pytest.approx(plain, rel=1e-6)
    assert main(["eval", str(run), "--tasks", "val_loss", "--exit", "klx:1", "--quiet"]) == 2
    assert "unknown exit criterion 'klx'" in capsys.readouterr().err
