"""`energyformer compare` (energyformer.eval.compare): the table's columns (the options that differ
between the runs, evaluations, tokens seen) and the loss curves (every line labelled, train and
validation told apart, a run with one evaluation drawn, x = tokens seen), on run directories
written by hand: a config.yaml, a metrics.jsonl and a summary.json, no training."""
import json

import pytest

from energyformer.cli import main
from energyformer.eval.compare import compare_runs, curves_figure, format_markdown
from energyformer.models.registry import config_from_dict
from energyformer.runs.config import DataConfig, RunConfig, TrainConfig
from energyformer.runs.rundir import write_run_files

pytest.importorskip("matplotlib")

MODEL = {"arch": "nrgpt", "vocab_size": 11, "d_model": 16, "n_heads": 2, "n_steps": 2, "block_size": 16}


def _run(root, name, model=None, train=None, val=((10, 2.5), (20, 2.3)), world_size=1):
    """A finished run directory: train loss logged every 5 steps, validation at the ``val`` steps."""
    path = root / name
    path.mkdir(parents=True)
    train = {"batch_size": 4, "max_steps": 20, "out_dir": str(path), **(train or {})}
    write_run_files(path, RunConfig(model=config_from_dict({**MODEL, **(model or {})}),
                                    data=DataConfig(data_dir=str(root / "data")), train=TrainConfig(**train)),
                    {"tokenizer": "char"})
    steps = val[-1][0]
    recs = [{"step": s, "train_loss": 3.0 - s / 100} for s in range(5, steps + 1, 5)]
    for s, v in val:
        next(r for r in recs if r["step"] == s).update(val_loss=v)
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    (path / "summary.json").write_text(json.dumps({
        "steps": steps, "best_val_loss": min(v for _, v in val), "final_val_loss": val[-1][1],
        "final_train_loss": 2.8, "params": 1234, "minutes": 0.5, "tokens_per_s": 99.0, "world_size": world_size}))
    return path


def test_columns_are_the_options_that_differ(tmp_path):
    a = _run(tmp_path, "a")
    b = _run(tmp_path, "b", model={"n_steps": 4})
    rows = compare_runs([a, b])
    assert [r["model.n_steps"] for r in rows] == [2, 4]
    assert not {k for r in rows for k in r if k.startswith(("train.", "data."))}  # out_dir differs: run-time
    table = format_markdown(rows)
    assert table.splitlines()[0].startswith("| run | arch | model.n_steps | params |")
    assert "| a | nrgpt | 2 | 1,234 |" in table and "| b | nrgpt | 4 | 1,234 |" in table
    c = _run(tmp_path, "c", train={"seed": 7})
    assert [r["train.seed"] for r in compare_runs([a, c])] == [1337, 7]  # a seed is what was trained
    assert "train.seed" not in compare_runs([a, a])[0] and "model.n_steps" not in compare_runs([a, a])[0]


def test_one_evaluation_runs_are_listed_and_drawn(tmp_path):
    one = _run(tmp_path, "one", val=((10, 2.4),))
    many = _run(tmp_path, "many")
    rows = compare_runs([one, many])
    assert [(r["run"], r["evals"]) for r in rows] == [("one", 1), ("many", 2)]
    assert "| one | nrgpt | 1,234 | 2.4000 | 2.4000 | 2.8000 | 1 | 10 | 640 |" in format_markdown(rows)
    fig = curves_figure([one, many])
    (line,) = [ln for ln in fig.axes[0].get_lines() if ln.get_label() == "one val"]
    assert len(line.get_xdata()) == 1 and line.get_marker() == "o"  # a single point is visible


def test_every_line_is_labelled_and_x_is_tokens_seen(tmp_path):
    small = _run(tmp_path, "small")
    big = _run(tmp_path, "big", train={"batch_size": 8, "grad_accum_steps": 2}, world_size=2)
    fig = curves_figure([small, big])
    ax = fig.axes[0]
    lines = {ln.get_label(): ln for ln in ax.get_lines()}
    assert set(lines) == {"small val", "small train", "big val", "big train"}
    assert lines["small val"].get_linestyle() != lines["small train"].get_linestyle()
    assert lines["small val"].get_color() == lines["small train"].get_color() != lines["big val"].get_color()
    assert list(lines["small val"].get_xdata()) == [10 * 4 * 16, 20 * 4 * 16]  # step × batch × block
    assert list(lines["big val"].get_xdata()) == [10 * 8 * 2 * 16 * 2, 20 * 8 * 2 * 16 * 2]
    assert "tokens seen" in ax.get_xlabel() and "nats/token" in ax.get_ylabel()
    assert {t.get_text() for t in ax.get_legend().get_texts()} == set(lines)
    steps = curves_figure([small, big], x="steps").axes[0]
    assert steps.get_xlabel() == "optimizer step"
    assert [list(ln.get_xdata()) for ln in steps.get_lines()][0] == [10, 20]


def test_the_tokens_column_counts_every_rank(tmp_path):
    """``tokens`` = steps × batch_size × grad_accum_steps × block_size × world_size: a run on two
    ranks saw twice the tokens of the same config on one (the curves' x axis counts the same)."""
    one = _run(tmp_path, "one", train={"batch_size": 8, "grad_accum_steps": 2})
    two = _run(tmp_path, "two", train={"batch_size": 8, "grad_accum_steps": 2}, world_size=2)
    rows = compare_runs([one, two])
    assert [r["tokens"] for r in rows] == [20 * 8 * 2 * 16, 20 * 8 * 2 * 16 * 2]
    lines = {ln.get_label(): ln for ln in curves_figure([two]).axes[0].get_lines()}
    assert lines["two val"].get_xdata()[-1] == rows[1]["tokens"]


def test_a_multi_rank_run_in_progress_counts_every_rank(tmp_path):
    """Before summary.json exists the world size comes from metrics.jsonl (the loop logs it under
    torchrun): the tokens column and the curves' x axis of a 2-rank run in progress count both ranks."""
    going = _run(tmp_path, "going", val=((10, 2.5),), world_size=2)
    (going / "summary.json").unlink()
    metrics = going / "metrics.jsonl"
    recs = [{**json.loads(line), "world_size": 2} for line in metrics.read_text().splitlines()]
    metrics.write_text("".join(json.dumps(r) + "\n" for r in recs))
    assert compare_runs([going])[0]["tokens"] == 10 * 4 * 16 * 2
    lines = {ln.get_label(): ln for ln in curves_figure([going]).axes[0].get_lines()}
    assert list(lines["going val"].get_xdata()) == [10 * 4 * 16 * 2]


def test_many_runs_legend_is_outside_the_axes(tmp_path):
    runs = [_run(tmp_path, f"run{i:02d}") for i in range(12)]
    fig = curves_figure(runs)
    ax = fig.axes[0]
    assert len(ax.get_lines()) == 24 and all(ln.get_label().startswith("run") for ln in ax.get_lines())
    legend = ax.get_legend()
    texts = [t.get_text() for t in legend.get_texts()]
    assert texts == [f"run{i:02d}" for i in range(12)] + ["validation", "train"]
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    assert legend.get_window_extent(renderer).x0 > ax.get_window_extent(renderer).x1  # not over the curves


def test_compare_command_x_and_plot(tmp_path, capsys):
    a, b = _run(tmp_path, "a"), _run(tmp_path, "b", model={"n_steps": 3})
    png = tmp_path / "c.png"
    assert main(["compare", str(a), str(b), "--plot", str(png), "--x", "steps"]) == 0
    assert "model.n_steps" in capsys.readouterr().out and png.read_bytes()[:4] == b"\x89PNG"
    assert main(["compare", str(a), "--plot", str(png), "--x", "epochs"]) == 2
    assert "--x 'epochs' is not valid; expected 'tokens' (tokens seen) or 'steps'" in capsys.readouterr().err


def test_tokens_axis_needs_the_runs_config(tmp_path):
    run = _run(tmp_path, "bare")
    (run / "config.yaml").unlink()
    assert compare_runs([run])[0]["tokens"] is None and compare_runs([run])[0]["arch"] is None
    with pytest.raises(ValueError, match=r"'.*bare' has no config\.yaml to count tokens per step from; use --x steps"):
        curves_figure([run])
    assert [ln.get_label() for ln in curves_figure([run], x="steps").axes[0].get_lines()] == ["bare val", "bare train"]


def test_float_options_print_without_rounding_noise():
    from energyformer.eval.compare import _cell

    assert _cell("train.min_lr", 3e-3 * 0.1) == "0.0003" and _cell("train.learning_rate", 1e-3) == "0.001"
    assert _cell("model.n_steps", 4) == "4" and _cell("model.eta_param", "a|b") == "a\\|b"


def test_the_arch_is_its_own_column_not_a_differing_option():
    from energyformer.eval.compare import differing_options

    opts = [{"model.arch": "gpt", "model.n_layers": 2, "train.seed": 1},
            {"model.arch": "nrgpt", "model.n_steps": 4, "train.seed": 2}]
    assert differing_options(opts) == ["train.seed"]


def test_compare_plot_into_a_folder_or_without_suffix(tmp_path, capsys):
    a = _run(tmp_path, "a")
    folder = tmp_path / "plots"
    folder.mkdir()
    assert main(["compare", str(a), "--plot", str(folder), "--x", "steps"]) == 0
    assert (folder / "curves.png").read_bytes()[:4] == b"\x89PNG"
    assert f"wrote {folder / 'curves.png'}" in capsys.readouterr().err
    assert main(["compare", str(a), "--plot", str(tmp_path / "new") + "/", "--x", "steps"]) == 0
    assert (tmp_path / "new" / "curves.png").is_file()
    assert main(["compare", str(a), "--plot", str(tmp_path / "bare"), "--x", "steps",
                 "--out", str(tmp_path / "t.md")]) == 0
    err = capsys.readouterr().err
    assert (tmp_path / "bare.png").read_bytes()[:4] == b"\x89PNG" and not (tmp_path / "bare").exists()
    assert f"wrote {tmp_path / 't.md'}" in err and f"wrote {tmp_path / 'bare.png'}" in err
    assert main(["compare", str(a), "--plot", str(tmp_path / "c.svg"), "--x", "steps"]) == 0
    assert (tmp_path / "c.svg").read_text().lstrip().startswith("<?xml")
    assert main(["compare", str(a), "--plot", str(tmp_path / "c.txt"), "--x", "steps"]) == 2
    assert "--plot '" in (err := capsys.readouterr().err) and "'.txt' is not an image format" in err
    assert not (tmp_path / "c.txt").exists()


def test_a_run_in_progress_is_compared_on_its_metrics_and_marked(tmp_path, capsys):
    import os

    from energyformer.runs.rundir import lock_run_dir

    done = _run(tmp_path, "done")
    going = _run(tmp_path, "going", val=((10, 2.5),))  # 10 of its 20 steps logged
    (going / "summary.json").unlink()  # a training removes it when it starts and writes it at the end
    row = compare_runs([done, going])[1]
    assert row["run"] == "going (step 10 of 20, unfinished (no training running))"
    assert (row["steps"], row["final_val_loss"], row["best_val_loss"], row["evals"]) == (10, 2.5, 2.5, 1)
    assert row["final_train_loss"] == pytest.approx(2.9) and row["tokens"] == 10 * 4 * 16
    assert row["params"] is None and row["minutes"] is None  # only summary.json has them
    with lock_run_dir(going):  # what a training holds
        assert compare_runs([going])[0]["run"] == f"going (step 10 of 20, in progress (pid {os.getpid()}))"
        assert main(["compare", str(done), str(going), "--plot", str(tmp_path / "c.png")]) == 0
    out = capsys.readouterr().out
    assert f"| going (step 10 of 20, in progress (pid {os.getpid()})) |" in out and "| done |" in out
    (going / "metrics.jsonl").unlink()  # nothing to compare: the summary.json error
    with pytest.raises(FileNotFoundError, match=r"summary\.json not found"):
        compare_runs([going])



def test_a_run_whose_plugin_does_not_import_is_compared_on_its_config_as_written(tmp_path):
    """compare needs options and metrics, not the run's code: a plugin missing here is no error."""
    a = _run(tmp_path, "a")
    b = _run(tmp_path, "b", model={"n_steps": 4})
    cfg = b / "config.yaml"
    cfg.write_text(cfg.read_text() + "imports:\n- energyformer_no_such_plugin_xyz\n")
    with pytest.raises(ValueError, match="energyformer_no_such_plugin_xyz"):  # what train/sample would say
        from energyformer.runs.rundir import read_run_config
        read_run_config(b)
    rows = compare_runs([a, b])
    assert [r["model.n_steps"] for r in rows] == [2, 4] and rows[1]["arch"] == "nrgpt"
    broken = _run(tmp_path, "c")
    (broken / "config.yaml").write_text("model: [unclosed\n")
    with pytest.raises(ValueError):  # any other failure to load is still an error
        compare_runs([a, broken])
