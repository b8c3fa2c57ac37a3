"""A prepare never writes into a training run's directory, and replaces a dataset of other
settings only with ``--force`` (``energyformer.data.prepare.check_out_dir``)."""
import hashlib
import json

import pytest

from energyformer.cli import main
from energyformer.data import load_meta
from energyformer.data.meta import RUN_FILES
from energyformer.data.prepare import check_out_dir
from energyformer.data.task_data import prepare_task_data

TEXT = "the cat sat on the mat.\n" * 40
DOCS = [f"document {i}: the cat sat on the mat" for i in range(20)]


def _snapshot(root):
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
            for p in sorted(root.rglob("*"))}


def test_the_run_files_are_the_run_layouts_names():
    from energyformer.runs import layout

    assert set(RUN_FILES) == {layout.CONFIG_FILE, layout.MARKER_FILE, layout.SUMMARY_FILE, layout.METRICS_FILE,
                              layout.STATE_FILE, layout.CHECKPOINTS_DIR}


@pytest.mark.parametrize("kind", ["text", "hf", "text-force", "hf-force"])
def test_prepare_never_writes_into_a_run_directory(tiny_run, tmp_path, capsys, monkeypatch, kind):
    if kind.startswith("hf"):
        pytest.importorskip("datasets")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "corpus.txt").write_text(TEXT)
    (tmp_path / "corpus.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS))
    argv = {"text": ["prepare", "text", "corpus.txt", "--out", str(tiny_run)],
            "hf": ["prepare", "hf", "--dataset", "corpus.jsonl", "--tokenizer", "char", "--num-proc", "1",
                   "--out", str(tiny_run)]}[kind.split("-")[0]]
    argv += ["--force"] if kind.endswith("force") else []
    before = _snapshot(tiny_run)
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: the dataset folder {str(tiny_run)!r} holds a training run "
                                               "(config.yaml, checkpoint.json, summary.json"), err
    assert "never writes into a run directory" in err[0]
    assert _snapshot(tiny_run) == before  # meta.json kept, no train.bin / val.bin / shards
    assert main(["sample", str(tiny_run), "--max-new-tokens", "3", "--device", "cpu"]) == 0


@pytest.mark.parametrize("name,options", [("listops", dict(n_train=50, n_val=10, n_test=10)),
                                          ("gp", dict(n_points=4, n_train=8, n_val=4, n_test=4, x_dim=1))])
def test_generated_datasets_refuse_a_tiny_runectory(tiny_run, name, options):
    before = _snapshot(tiny_run)
    with pytest.raises(ValueError, match="holds a training run"):
        prepare_task_data(name, out_dir=tiny_run, force=True, verbose=False, **options)
    assert _snapshot(tiny_run) == before


def test_a_dataset_of_other_settings_is_replaced_only_with_force(tmp_path, capsys):
    (tmp_path / "a.txt").write_text(TEXT)
    (tmp_path / "b.txt").write_text("another text altogether\n" * 30)
    out = tmp_path / "d"
    assert main(["prepare", "text", str(tmp_path / "a.txt"), "--out", str(out)]) == 0
    first = _snapshot(out)
    assert main(["prepare", "text", str(tmp_path / "a.txt"), "--out", str(out)]) == 0  # up to date: nothing to do
    capsys.readouterr()
    assert main(["prepare", "text", str(tmp_path / "b.txt"), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "already holds a dataset of other settings or another source (source.sha256: " in err[0]
    assert err[0].endswith("pass --force to replace it, or write the dataset elsewhere (--out DIR)")
    assert _snapshot(out) == first
    assert main(["prepare", "text", str(tmp_path / "b.txt"), "--out", str(out), "--force"]) == 0
    assert load_meta(out)["vocab_size"] == len(set("another text altogether\n"))


def test_a_damaged_dataset_or_an_interrupted_prepare_is_rebuilt_without_force(tmp_path):
    (tmp_path / "a.txt").write_text(TEXT)
    out = tmp_path / "d"
    out.mkdir()
    (out / "train.bin").write_bytes(b"\x00\x01")  # an interrupted prepare left no meta.json
    check_out_dir(out, {"dataset": "d"})
    (out / "meta.json").write_text("{oops")  # corrupt: nothing to keep
    check_out_dir(out, {"dataset": "d"})
    (tmp_path / "afile").write_text("x")
    with pytest.raises(NotADirectoryError, match=r"dataset folder '.*afile' is a file; expected a folder"):
        check_out_dir(tmp_path / "afile", {})
