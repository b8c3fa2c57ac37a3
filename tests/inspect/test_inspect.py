"""Energy inspection (energyformer.inspect; docs/architecture.md §4): the report is built on the one
Trace type, its energies equal a direct evaluation of the energy at the recorded states, and
`energyformer inspect` writes the JSON trace and the plots, which stay readable at any prompt length."""
import json

import pytest
import torch

from energyformer import build_model
from energyformer.cli import main
from energyformer.inspect.energy import (
    DPI,
    descent_guarantee,
    energy_report,
    energy_trend,
    format_inspect,
    heatmap_figure,
    plot_report,
    report_from_trace,
    steps_figure,
)

NRGPT = {"arch": "nrgpt", "vocab_size": 11, "d_model": 16, "n_heads": 2, "n_steps": 3, "block_size": 16,
         "eta_param": "c_diag_gamma"}
CEM = {"arch": "cem", "vocab_size": 11, "d_model": 16, "n_layers": 2, "n_heads": 2, "n_steps": 2, "block_size": 16,
       "preconditioner": "diag_lowrank", "preconditioner_rank": 2}


def _traced(cfg, seed, shape):
    """A float64 model of ``cfg`` (seeded), random ids of ``shape`` and the trace of its forward."""
    torch.manual_seed(seed)
    model = build_model(cfg).double().eval()
    idx = torch.randint(0, 11, shape)
    with model.trace() as trace:
        model(idx)
    return model, idx, trace


def test_nrgpt_trace_energies_equal_direct_evaluation():
    model, _, trace = _traced(NRGPT, 0, (2, 9))
    for r in trace.select(0, "block"):
        direct = model.block.energy(r.x)
        assert torch.allclose(r.energies["attn"], direct["attn"], atol=1e-12)
        assert torch.allclose(r.energies["ff"], direct["ff"], atol=1e-12)
        assert torch.allclose(r.energies["total"], direct["attn"] + direct["ff"], atol=1e-12)
    report = report_from_trace(trace, batch_index=1)
    (block,) = report
    x = trace.states(0, "block")[:, 1]
    assert block["steps"] == 3 and len(block["energy"]["total"]) == 4 and len(block["cos"]) == 3
    assert block["step_norm"][0] == pytest.approx((x[1] - x[0]).norm(dim=-1).tolist())
    g = trace.records[0].grad[1]
    assert block["grad_norm"][0] == pytest.approx(g.norm(dim=-1).tolist())


def test_cem_trace_energies_equal_direct_evaluation():
    model, idx, trace = _traced(CEM, 1, (1, 7))
    for layer in trace.layers():
        for sub in ("attn", "mlp"):
            recs = trace.select(layer, sub)
            module = getattr(model.blocks[layer], sub)
            h = recs[0].x  # the sub-block input: its context
            for r in recs:
                assert torch.allclose(r.energies[sub], module.energy(r.x, h), atol=1e-12)
    report = energy_report(model, idx)
    assert [(b["layer"], b["sub"]) for b in report["blocks"]] == [(0, "attn"), (0, "mlp"), (1, "attn"), (1, "mlp")]
    # a plain step is a pure gradient step: cos(Δx, −∇E) = 1 without a preconditioner
    plain = build_model({**CEM, "preconditioner": None, "preconditioner_rank": 8}).double().eval()
    cos = [c for b in energy_report(plain, idx)["blocks"] for row in b["cos"] for c in row]
    assert min(cos) == pytest.approx(1.0, abs=1e-9)


def test_models_without_energies_are_refused():
    with pytest.raises(ValueError, match="no energy layers"):
        energy_report(build_model({"arch": "llama", "vocab_size": 11, "d_model": 16, "n_heads": 2}),
                      torch.zeros(1, 3, dtype=torch.long))
    llama_rope = build_model({**CEM, "rope": "llama", "preconditioner": None})
    with pytest.raises(ValueError, match="recorded no energy"):
        energy_report(llama_rope, torch.zeros(1, 3, dtype=torch.long))


@pytest.mark.parametrize("n", [86, 5])
def test_plots_stay_readable_at_any_prompt_length(tmp_path, n):
    """86 tokens once drew a 2,585-pixel heat map with 86 tick labels and 86 unlabelled lines."""
    pytest.importorskip("matplotlib")
    import matplotlib.image
    import matplotlib.pyplot as plt

    torch.manual_seed(0)
    report = energy_report(build_model({**NRGPT, "block_size": 96}).eval(), torch.randint(0, 11, (1, n)))
    tokens = [chr(97 + i % 26) for i in range(n)]
    steps, heat = steps_figure(report, tokens), heatmap_figure(report, tokens)
    for fig in (steps, heat):
        width, height = fig.get_size_inches() * DPI
        assert width <= 1440 and height <= 1920
    maps = [ax for ax in heat.axes if ax.images]
    assert len(maps) == 3  # attn, ff, total
    for ax in maps:
        labels = [t.get_text() for t in ax.get_yticklabels()]
        assert len(labels) == (29 if n == 86 else 5) and len(ax.get_xticklabels()) <= 30
        assert labels[:2] == (["0 a", "3 d"] if n == 86 else ["0 a", "1 b"])  # every 3rd token of 86
    panels = [ax for ax in steps.axes if ax.get_lines()]
    assert len(panels) == 3 and panels[0].get_legend() is not None
    for ax in panels:
        labelled = [ln.get_label() for ln in ax.get_lines()]
        if n == 86:
            assert labelled == ["mean over 86 tokens"]
            assert [c.get_label() for c in ax.collections] == ["10–90% of tokens"]
        else:
            assert labelled == ["0 a", "1 b", "2 c", "3 d", "4 e"]
    plt.close("all")
    for path in plot_report(report, tokens, tmp_path):
        height, width = matplotlib.image.imread(path).shape[:2]
        assert width <= 1440 and height <= 1920


def test_inspect_command_writes_trace_and_plots(tmp_path, capsys):
    text = tmp_path / "t.txt"
    text.write_text("abcdefghij\n" * 300, encoding="utf-8")
    assert main(["prepare", "text", "--input", str(text), "--out", str(tmp_path / "data")]) == 0
    run = tmp_path / "run"
    assert main(["train", _recipe(tmp_path), "--train.max_steps", "2", "--train.out_dir", str(run)]) == 0
    out = tmp_path / "figs"
    assert main(["inspect", str(run), "--prompt", "abcabc", "--out", str(out), "--n-steps", "4"]) == 0
    trace = json.loads((out / "trace.json").read_text())
    assert trace["arch"] == "nrgpt" and trace["tokens"] == list("abcabc")
    (block,) = trace["blocks"]
    assert block["steps"] == 4 and set(block["energy"]) == {"attn", "ff", "total"}
    assert (out / "energy_steps.png").stat().st_size > 0 and (out / "energy_heatmap.png").stat().st_size > 0
    said = capsys.readouterr().out
    assert "mean cos" in said and "warning" not in said
    # the recipe's η is the default free map: the summary says so in one line, and trace.json keeps it
    assert [ln.strip() for ln in said.splitlines() if "descent" in ln] == [
        "η a free d×d map (eta_param full, norm layernorm): no descent guarantee: the energy may rise "
        "(docs/nrgpt.md §5)"]
    assert trace["descent"]["guaranteed"] is False
    # a prompt longer than block_size (16) is cropped to its last 16 tokens, and the output says so
    assert main(["inspect", str(run), "--prompt", "abcdefghij" * 2, "--out", str(out)]) == 0
    said = capsys.readouterr().out
    assert "warning: the prompt has 20 tokens, more than the model's block_size=16: traced its last 16, " \
           "the first 4 dropped" in said
    trace = json.loads((out / "trace.json").read_text())
    assert trace["dropped_tokens"] == 4 and trace["tokens"] == list("efghijabcdefghij")
    assert main(["inspect", str(run), "--prompt", "xyz", "--out", str(out)]) == 2
    assert "cannot encode the prompt" in capsys.readouterr().err


def _recipe(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text(f"""model: {{arch: nrgpt, d_model: 16, n_heads: 2, n_steps: 2, block_size: 16}}
data: {{data_dir: {tmp_path / 'data'}}}
train: {{batch_size: 2, eval_iters: 1, eval_interval: 2, device: cpu}}
""", encoding="utf-8")
    return str(path)


@pytest.mark.parametrize("model, guaranteed", [
    (NRGPT, True),  # η = c·diag(γ) with a LayerNorm: the default recipe's η
    ({**NRGPT, "norm": "rmsnorm"}, True),
    ({**NRGPT, "eta_param": "full"}, False),
    ({**NRGPT, "eta_param": "c_identity"}, False),  # c·I needs γ ≡ 1 ...
    ({**NRGPT, "eta_param": "c_identity", "norm": "layernorm_frozen"}, True),  # ... which the frozen norm has
    ({**NRGPT, "eta_param": "psd_plus_skew"}, False),  # the PSD + skew condition holds without a norm only
    ({**NRGPT, "eta_param": "psd_plus_skew", "norm": "none"}, True),
    ({**NRGPT, "eta_param": "diag_lowrank"}, False),
    (CEM, False), ({**CEM, "preconditioner": None, "preconditioner_rank": 8}, False),
])
def test_inspect_says_in_one_line_whether_eta_guarantees_descent(model, guaranteed):
    """Issue 27: `inspect` on make run's free-η model showed the energy rising without a remark."""
    torch.manual_seed(0)
    m = build_model(model).eval()
    said = descent_guarantee(m)
    assert said["guaranteed"] is guaranteed
    if guaranteed:
        assert said["summary"].endswith(": descent guaranteed for a small enough step (docs/nrgpt.md §5)")
    else:
        assert ": no descent guarantee: the energy may rise (docs/" in said["summary"]
    report = {"arch": model["arch"], "tokens": list("abcd"), "files": ["trace.json"],
              **energy_report(m, torch.randint(0, 11, (1, 4)))}
    lines = [ln for ln in format_inspect(report).splitlines() if "descent" in ln]
    assert [ln.strip() for ln in lines] == [said["summary"]]


def test_descent_guarantee_needs_positive_per_step_scales():
    model = build_model({**NRGPT, "per_step_scale": True})
    assert descent_guarantee(model)["guaranteed"]
    with torch.no_grad():
        model.step_scales[1] = -0.5
    said = descent_guarantee(model)
    assert not said["guaranteed"] and "κ ≤ 0 at step index 1: no descent guarantee" in said["summary"]


def test_inspect_says_when_the_mean_energy_rises_next_to_the_numbers():
    assert energy_trend([3.0, 2.0, 1.0]) == "falls at every step"
    assert energy_trend([-57.7, -50.0, -40.0, -35.8]) == "RISES over the steps (up at steps 1, 2, 3)"
    assert energy_trend([3.0, 1.0, 2.0]) == "falls overall, rises at step 2"
    rising = {"layer": 0, "sub": "block", "steps": 2, "cos": [[1.0], [1.0]],
              "energy": {"attn": [[-1.0], [-1.0], [-1.0]], "total": [[-57.7], [-40.0], [-35.8]]}}
    falling = {**rising, "energy": {"total": [[-35.8], [-40.0], [-57.7]]}}
    for block, trend in ((rising, "(RISES over the steps (up at steps 1, 2))"), (falling, "(falls at every step)")):
        (line,) = format_inspect({"arch": "nrgpt", "tokens": ["a"], "files": [], "blocks": [block]}).splitlines()[1:]
        total = "total -57.7 → -35.8" if block is rising else "total -35.8 → -57.7"
        assert f"{total} {trend}; mean cos" in line


@pytest.mark.parametrize("model, columns", [
    (NRGPT, ["step 1", "step 2", "step 3"]),
    (CEM, ["L0 s1", "L0 s2", "L1 s1", "L1 s2"]),
])
def test_heatmap_reads_as_steps_in_readable_fonts_without_an_empty_step_0(model, columns):
    """Issue 27: x ticks `0.1 … 0.4` read as decimals, 6-pt fonts, and a step-0 column always 0."""
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt
    import numpy as np

    torch.manual_seed(0)
    tokens = list("abcde")
    report = energy_report(build_model(model).eval(), torch.randint(0, 11, (1, len(tokens))))
    heat, steps = heatmap_figure(report, tokens), steps_figure(report, tokens)
    maps = [ax for ax in heat.axes if ax.images]
    assert maps
    for ax in maps:
        assert [t.get_text() for t in ax.get_xticklabels()] == columns
        data = np.asarray(ax.images[0].get_array())
        assert data.shape == (len(tokens), len(columns))
        assert not np.isnan(data).all(axis=0).any() and (data != 0).any(axis=0).all()  # no empty column
    for fig in (heat, steps):
        texts = [t for ax in fig.axes for t in (*ax.get_xticklabels(), *ax.get_yticklabels(), ax.title,
                                                ax.xaxis.label, ax.yaxis.label) if t.get_text()]
        texts += [t for ax in fig.axes if ax.get_legend() for t in ax.get_legend().get_texts()]
        assert texts and min(t.get_fontsize() for t in texts) >= 9
    plt.close("all")
