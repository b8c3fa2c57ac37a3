"""`energyformer eval`: the MMLU-format dev questions (energyformer.eval.mmlu), val_loss and the
JSON + Markdown report (energyformer.eval.suite). Offline (HF_HUB_OFFLINE=1)."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("lm_eval")

from helpers import make_data_dir  # noqa: E402
from run_helpers import CHARS, local_task, make_run  # noqa: E402

from energyformer.cli import main  # noqa: E402
from energyformer.data import CharTokenizer  # noqa: E402
from energyformer.eval import mmlu  # noqa: E402
from energyformer.eval.suite import val_loss  # noqa: E402
from energyformer.runs.rundir import load_run  # noqa: E402


@pytest.fixture(scope="module")
def questions():
    return mmlu.dev_questions()


def test_dev_questions_parse(questions):
    qs, skipped = questions
    assert len(qs) >= 270 and skipped < 15
    assert len({q.subject for q in qs}) == 57
    assert all(len(q.choices) == 4 and 0 <= q.answer < 4 and q.question for q in qs)
    assert not any("\n(A) " in q.question or "\x0c" in q.question for q in qs)


def test_prompt_is_lm_evals_mmlu_format_and_shots_never_hold_the_question(questions):
    qs, _ = questions
    docs = mmlu.build_docs(qs)
    for q, d in zip(qs, docs):
        same = [s for s in qs if s.subject == q.subject and s != q]
        assert d["n_shots"] == min(4, len(same)) and d["subject"] == q.subject
        body = d["prompt"].split("\n\n")
        assert body[0] == f"The following are multiple choice questions (with answers) about " \
                          f"{q.subject.replace('_', ' ')}."
        assert d["prompt"].endswith(mmlu.question_text(q))
        assert d["prompt"].count(q.question) == 1  # the question only as the question, never as a shot
    q = qs[0]
    assert mmlu.question_text(q) == (f"{q.question}\nA. {q.choices[0]}\nB. {q.choices[1]}\nC. {q.choices[2]}\n"
                                     f"D. {q.choices[3]}\nAnswer:")
    shot = qs[1]
    assert f"{mmlu.question_text(shot)} {'ABCD'[shot.answer]}\n\n" in docs[0]["prompt"]
    with pytest.raises(ValueError, match="num_fewshot=5"):
        mmlu.build_docs(qs, num_fewshot=5)


def test_char_vocab_drops_and_counts_questions_it_cannot_spell(questions):
    qs, _ = questions
    kept, dropped = mmlu.select(qs, set(CHARS))
    assert kept and dropped and len(kept) + dropped == len(qs)
    assert all(set(q.question + "".join(q.choices)) <= set(CHARS) for q in kept)
    assert all(c in "".join(d["prompt"] for d in mmlu.build_docs(kept)) for c in "ABCD")
    assert mmlu.select(qs, None) == (qs, 0)
    with pytest.raises(ValueError, match="lacks .*needed by the MMLU answer format"):
        mmlu.select(qs, set("abc"))
    # a vocabulary without parentheses (Shakespeare's): the subject line loses them, nothing else
    no_parens = set(CHARS) - set("()")
    kept, _ = mmlu.select(qs, no_parens)
    first = mmlu.build_docs(kept, vocab=no_parens)[0]["prompt"]
    assert first.startswith("The following are multiple choice questions with answers about ")
    assert set(first) <= no_parens


def test_accuracy_table():
    rows = [{"subject": "a", "correct": True}, {"subject": "a", "correct": False},
            {"subject": "b", "correct": True}, {"subject": "b", "correct": True}]
    t = mmlu.accuracy_table(rows)
    assert t["acc"] == 0.75 and t["chance"] == 0.25 and t["n"] == 4
    assert t["acc_stderr"] == pytest.approx(math.sqrt(0.75 * 0.25 / 3))
    assert t["subjects"]["a"]["acc"] == 0.5 and t["subjects"]["b"]["n"] == 2


def test_val_loss_equals_cross_entropy_by_hand(tmp_path):
    data = make_data_dir(tmp_path / "data", chars=CHARS)
    run = make_run(tmp_path / "run", {"arch": "gpt"}, data_dir=data)
    model = load_run(run)[0]
    got = val_loss(model, data, CharTokenizer(CHARS), batch_size=3)
    ids = torch.from_numpy(np.fromfile(data / "val.bin", dtype=np.uint16).astype(np.int64))
    total, n = 0.0, 0
    with torch.no_grad():
        for s in range(0, len(ids) - 1, 32):
            w = ids[s:s + 33]
            total += float(F.cross_entropy(model(w[None, :-1])[0][0], w[1:], reduction="sum"))
            n += len(w) - 1
    assert got["tokens"] == n == len(ids) - 1
    assert got["loss"] == pytest.approx(total / n, rel=1e-5)
    assert got["perplexity"] == pytest.approx(math.exp(total / n), rel=1e-5)
    assert got["bits_per_byte"] == pytest.approx(got["bits_per_token"])  # one ASCII byte per character


def test_val_loss_reads_a_uint32_corpus_by_its_meta_dtype(tmp_path):
    """``prepare hf`` writes uint32 tokens for big vocabularies: val_loss reads the dtype meta.json
    names (read as uint16, each id would be two tokens and the count double)."""
    data = make_data_dir(tmp_path / "data", chars=CHARS)
    wide = tmp_path / "wide"
    wide.mkdir()
    for split in ("train", "val"):
        np.fromfile(data / f"{split}.bin", dtype=np.uint16).astype(np.uint32).tofile(wide / f"{split}.bin")
    (wide / "meta.json").write_text(json.dumps({**json.loads((data / "meta.json").read_text()), "dtype": "uint32"}))
    model = load_run(make_run(tmp_path / "run", {"arch": "gpt"}, data_dir=data))[0]
    narrow, got = (val_loss(model, d, CharTokenizer(CHARS), batch_size=3) for d in (data, wide))
    assert got == narrow
    (wide / "val.bin").unlink()
    with pytest.raises(FileNotFoundError, match="val_loss needs the run's prepared data .*val.bin not found"):
        val_loss(model, wide, CharTokenizer(CHARS))


def test_eval_command_writes_json_and_markdown(tmp_path, capsys):
    data = make_data_dir(tmp_path / "data", chars=CHARS)
    run = make_run(tmp_path / "run", {"arch": "nrgpt"}, data_dir=data)
    assert main(["eval", str(run), "--tasks", "mmlu_dev,val_loss", "--limit", "12",
                 "--out", str(tmp_path / "r" / "report.json")]) == 0
    shown = capsys.readouterr().out
    report = json.loads((tmp_path / "r" / "report.json").read_text())
    m = report["tasks"]["mmlu_dev"]
    # the run's block_size is far below a 4-shot prompt: the report says what fit, not "4-shot"
    assert m["num_fewshot"] == 4 and m["shots"]["max"] < 4
    assert f"| mmlu_dev ({m['shots']['min']}" in shown and "of 4 shots fit the context" in shown
    assert "| 0.25 |" in shown and "bits_per_byte" in shown
    assert m["n"] == 12 and m["chance"] == 0.25 and m["n_oov_skipped"] > 0 and m["subjects"]
    assert sum(s["n"] for s in m["subjects"].values()) == 12
    assert report["tasks"]["val_loss"]["tokens"] > 0
    assert (tmp_path / "r" / "report.md").read_text().strip() == shown.strip()


def test_eval_shows_a_line_per_task_and_progress_bars_on_stderr(tmp_path, capsys):
    """A line as each task starts and ends (with its time) and tqdm bars over the requests and the
    windows (forced here; by default only on a terminal); --quiet: nothing, lm-eval's bars too."""
    import re

    from energyformer.eval.suite import evaluate_run

    run = make_run(tmp_path / "run", {"arch": "gpt"}, data_dir=make_data_dir(tmp_path / "data", chars=CHARS))
    out = ["--out", str(tmp_path / "r.json")]
    capsys.readouterr()
    evaluate_run(run, "mmlu_dev,val_loss", limit=2, out=tmp_path / "r.json", progress=True)
    err = capsys.readouterr().err
    for i, name in enumerate(("mmlu_dev", "val_loss"), 1):
        assert f"eval {name} ({i}/2): started" in err and re.search(rf"eval {name} \({i}/2\): done in \d+\.\d s", err)
    assert "| 8/8 [" in err and "loglikelihood: 100%" in err and "val_loss: 100%" in err  # 2 questions x 4 choices
    assert err.index("mmlu_dev (1/2): started") < err.index("loglikelihood: 100%") < err.index("mmlu_dev (1/2): done")
    assert err.index("val_loss (2/2): started") < err.index("val_loss: 100%") < err.index("val_loss (2/2): done")
    assert main(["eval", str(run), "--tasks", "mmlu_dev,val_loss", "--limit", "2", *out]) == 0
    err = capsys.readouterr().err  # not a terminal: the lines, not our bars
    assert "eval val_loss (2/2): done in" in err and "loglikelihood:" not in err and "val_loss:" not in err
    assert main(["eval", str(run), "--tasks", "mmlu_dev,val_loss", "--limit", "2", *out, "--quiet"]) == 0
    assert capsys.readouterr().err == ""


def _no_hub(monkeypatch, endpoint="http://127.0.0.1:9"):
    """The hub at ``endpoint`` (default: the closed discard port), ``HF_HUB_OFFLINE`` unset, and
    every dataset load recorded (lm-eval's retries are what the check saves)."""
    import lm_eval.api.task

    from energyformer.eval import harness

    for key in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("HF_ENDPOINT", endpoint)
    harness.hub_reachable.cache_clear()
    loads = []
    real = lm_eval.api.task.datasets.load_dataset
    monkeypatch.setattr(lm_eval.api.task.datasets, "load_dataset", lambda *a, **k: loads.append(a) or real(*a, **k))
    return loads


def test_a_hub_task_fails_at_once_in_one_line_when_the_hub_is_unreachable(tmp_path, monkeypatch, capsys):
    loads = _no_hub(monkeypatch)
    run = make_run(tmp_path / "run", {"arch": "gpt"}, data_dir=make_data_dir(tmp_path / "data", chars=CHARS))
    assert main(["eval", str(run), "--tasks", "val_loss,arc_easy", "--out", str(tmp_path / "r.json")]) == 2
    assert capsys.readouterr().err == (
        "error: task 'arc_easy' needs the Hugging Face hub (http://127.0.0.1:9 unreachable; its data: "
        "'allenai/ai2_arc'); set HF_HUB_OFFLINE=1 with a cached copy or use a bundled task (mmlu_dev, val_loss)\n")
    assert loads == [] and not (tmp_path / "r.json").exists()  # refused before anything ran
    # the bundled tasks and a task of local files run with the hub unreachable
    tasks = local_task(tmp_path / "tasks", [{"q": "the cat", "choices": [" sat", " ran"], "answer": 0}])
    assert main(["eval", str(run), "--tasks", "mmlu_dev,val_loss,tiny_local_mc", "--limit", "2", "--quiet",
                 "--num_fewshot", "0", "--include_path", str(tasks), "--out", str(tmp_path / "r.json")]) == 0
    assert set(json.loads((tmp_path / "r.json").read_text())["tasks"]) == {"mmlu_dev", "val_loss", "tiny_local_mc"}


def test_one_eval_indexes_lm_evals_tasks_once(tmp_path, monkeypatch):
    """The check of the task names and every lm-eval task of one call share one TaskManager (each
    index of lm-eval's task files takes seconds). Defaults are left out here to keep the test fast."""
    import lm_eval.tasks

    real, built = lm_eval.tasks.TaskManager, []

    def counting(*args, **kwargs):
        built.append(kwargs.get("include_path"))
        return real(*args, **{**kwargs, "include_defaults": False})

    monkeypatch.setattr(lm_eval.tasks, "TaskManager", counting)
    run = make_run(tmp_path / "run", {"arch": "gpt"}, data_dir=make_data_dir(tmp_path / "data", chars=CHARS))
    doc = [{"q": "the cat", "choices": [" sat", " ran"], "answer": 0}]
    tasks = local_task(tmp_path / "tasks", doc)
    local_task(tasks, doc, name="tiny_local_mc2")
    assert main(["eval", str(run), "--tasks", "tiny_local_mc,tiny_local_mc2", "--quiet", "--num_fewshot", "0",
                 "--include_path", str(tasks), "--out", str(tmp_path / "r.json")]) == 0
    assert built == [str(tasks)]
    assert set(json.loads((tmp_path / "r.json").read_text())["tasks"]) == {"tiny_local_mc", "tiny_local_mc2"}


def test_hub_datasets_follow_groups_and_tags_and_the_check_needs_only_an_answer(tmp_path, monkeypatch):
    import http.server
    import threading

    from lm_eval.tasks import TaskManager

    from energyformer.eval import harness

    manager = TaskManager(include_path=str(local_task(tmp_path / "tasks", [])))
    found = harness.hub_datasets(manager, ["mmlu", "ai2_arc", "tiny_local_mc", "arc_easy"])
    assert found == {"mmlu": "cais/mmlu", "ai2_arc": "allenai/ai2_arc", "arc_easy": "allenai/ai2_arc"}
    with pytest.raises(ConnectionError, match="task 'mmlu' needs the Hugging Face hub .* use a task whose data are"):
        _no_hub(monkeypatch)
        harness.check_hub(manager, ["tiny_local_mc", "mmlu"])
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # the cache is used: nothing to check
    harness.check_hub(manager, ["mmlu"])
    # any HTTP answer, even 404, means the hub is there
    server = http.server.HTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        _no_hub(monkeypatch, f"http://127.0.0.1:{server.server_port}")
        harness.check_hub(manager, ["mmlu"])
    finally:
        server.shutdown()
        server.server_close()


def test_eval_bad_input_is_one_line_error(tmp_path, capsys):
    run = make_run(tmp_path / "run", {"arch": "gpt"})
    assert main(["eval", str(run), "--tasks", "val_loss,no_such_task_xyz"]) == 2
    err = capsys.readouterr().err.strip()
    assert "unknown task 'no_such_task_xyz'" in err and "\n" not in err
    incomplete = make_run(tmp_path / "inc", {"arch": "gpt"}, complete=False)
    assert main(["eval", str(incomplete), "--tasks", "val_loss"]) == 2
    assert "is incomplete" in capsys.readouterr().err
    assert main(["eval", str(run), "--tasks", "mmlu_dev", "--num_fewshot", "5"]) == 2
    assert "num_fewshot=5" in capsys.readouterr().err


def test_eval_outside_a_git_repository_prints_no_git_error(tmp_path, monkeypatch, capfd):
    """lm-eval records the git commit of the working directory by running git, whose stderr
    ("fatal: not a git repository") reached ours; it is discarded now (file descriptor 2 checked)."""
    from energyformer.eval.harness import git_commit_hash

    monkeypatch.chdir(tmp_path)  # pytest's temporary folders are outside any repository
    run = make_run(tmp_path / "run", {"arch": "gpt"}, data_dir=make_data_dir(tmp_path / "data", chars=CHARS))
    assert main(["eval", str(run), "--tasks", "mmlu_dev", "--limit", "2", "--out", str(tmp_path / "r.json")]) == 0
    err = capfd.readouterr().err
    assert "fatal:" not in err and "not a git repository" not in err, err
    assert git_commit_hash() is None and capfd.readouterr().err == ""


def test_shots_that_do_not_fit_the_context_are_left_out_and_reported(questions):
    """At a short context the prompts keep only the shots that fit (never cut from the left by the
    harness), and the report says how many fit instead of claiming 4-shot."""
    from energyformer.eval.suite import format_report

    qs, _ = questions
    limit = 1200  # characters: room for about one shot of most subjects
    fits = lambda text: len(text) <= limit  # noqa: E731
    docs = mmlu.build_docs(qs, 4, fits=fits)
    full = mmlu.build_docs(qs, 4)
    for d, f in zip(docs, full):
        assert d["n_shots"] < 4 or d["prompt"] == f["prompt"]
        assert fits(d["prompt"] + " A") or d["n_shots"] == 0
        assert f["prompt"].startswith(d["prompt"].split("\n\n")[0])
    assert 0 < sum(d["n_shots"] for d in docs) < sum(d["n_shots"] for d in full)
    shots = {"min": min(d["n_shots"] for d in docs), "max": max(d["n_shots"] for d in docs)}
    res = {"num_fewshot": 4, "shots": shots, "n_truncated": 3, "acc": 0.25, "acc_stderr": 0.1, "chance": 0.25,
           "n": 10, "n_parse_skipped": 0, "n_oov_skipped": 0}
    row = format_report({"run": "r", "tasks": {"mmlu_dev": res}}).splitlines()[-1]
    assert f"mmlu_dev ({shots['min']}–{shots['max']} of 4 shots fit the context, 3 prompts truncated)" in row
    assert "4-shot" not in row
    res["shots"] = {"min": 4, "max": 4}
    assert "mmlu_dev (4-shot)" in format_report({"run": "r", "tasks": {"mmlu_dev": res}})


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the fallback of a machine without CUDA")
def test_eval_on_cuda_without_cuda_falls_back_to_the_cpu_for_every_task(tmp_path, capsys):
    """``--device cuda`` where there is none: the adapter warns and opens the model on the CPU, and
    val_loss scores on that device too (it resolved the device again and failed)."""
    data = make_data_dir(tmp_path / "data", chars=CHARS)
    run = make_run(tmp_path / "run", {"arch": "nrgpt"}, data_dir=data)
    assert main(["eval", str(run), "--tasks", "val_loss", "--limit", "4", "--device", "cuda",
                 "--out", str(tmp_path / "report.json")]) == 0
    assert "evaluating on cpu" in capsys.readouterr().err
    assert json.loads((tmp_path / "report.json").read_text())["tasks"]["val_loss"]["tokens"] > 0
