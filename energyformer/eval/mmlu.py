"""MMLU-format multiple choice from the dev questions lm-eval ships, offline (docs/architecture.md §1).

lm-eval's MMLU tasks download their data from a hub, which these machines (and many clusters)
cannot reach. ``lm-eval`` does ship, in ``lm_eval/tasks/mmlu/flan_cot_fewshot/_cot_prompts.json``,
the dev questions of the 57 subjects (5 each; 3 subjects hold 4 there) with a worked rationale,
which we drop. :func:`dev_questions` parses them: with lm-eval 0.4.13, 278 of the 282 parse
cleanly into (subject, question, four choices, answer); the others have five choices or text
broken by unescaped LaTeX in that file, and are skipped and counted.

:func:`build_task` writes them as an lm-eval task on local files (``mmlu_dev``): for each
question the prompt is lm-eval's MMLU prompt — the subject line, the shots, then
``question\\nA. …\\nB. …\\nC. …\\nD. …\\nAnswer:`` — and the choices are scored by the
log-likelihood of `` A`` … `` D``, as lm-eval's ``mmlu`` does. The shots come from the same
subject and never include the question itself; a subject has only 5 dev questions, so a
question gets at most 4 shots (``num_fewshot`` ≤ 4, default 4: "5-shot" is not possible
from the dev set alone without showing a question its own answer).

Character-level vocabularies cannot spell every MMLU question (``$``, ``%``, ``(``, Greek…):
with ``vocab`` given, a question whose question or choices hold a character outside it is
dropped (as a question and as a shot) and counted in the report; no character is mapped to
another. The fixed subject line is lm-eval's, less its characters outside ``vocab`` (the
Shakespeare vocabulary has no parentheses: "…questions with answers about…"); those removed
characters are reported too.

This module reads files only; the lm-eval run is in :mod:`energyformer.eval.harness`.
"""
from __future__ import annotations

import importlib.util
import json
import math
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

COT_PROMPTS = Path("tasks") / "mmlu" / "flan_cot_fewshot" / "_cot_prompts.json"
LETTERS = "ABCD"
MAX_FEWSHOT = 4
TASK_NAME = "mmlu_dev"
_QUESTION = re.compile(
    r"^(?P<question>.*?)\n\(A\) (?P<a>[^\n]*?)[ \n]\(B\) (?P<b>[^\n]*?)[ \n]\(C\) (?P<c>[^\n]*?)[ \n]"
    r"\(D\) (?P<d>[^\n]*?)\nA: .*?The answer is \((?P<answer>[A-D])\)", re.S)
# LaTeX whose backslash the file lost (\f, \r, \b… control characters, or \n inside a $…$ span)
_BROKEN = re.compile(r"[\x00-\x09\x0b-\x1f]|\$[^$]*\n[^$]*\$")


@dataclass(frozen=True)
class Question:
    """One dev question: ``answer`` is the index (0–3) of the right choice."""

    subject: str
    question: str
    choices: tuple[str, str, str, str]
    answer: int


def cot_prompts_path() -> Path:
    """The ``_cot_prompts.json`` of the installed lm-eval (found without importing it).

    Raises:
        FileNotFoundError: lm-eval is not installed (``pip install 'energyformer[eval]'``) or
            ships no such file.
    """
    spec = importlib.util.find_spec("lm_eval")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("lm-eval is not installed; `pip install 'energyformer[eval]'` (lm-eval==0.4.13 "
                                "ships the MMLU dev questions)")
    path = Path(list(spec.submodule_search_locations)[0]) / COT_PROMPTS
    if not path.is_file():
        raise FileNotFoundError(f"{str(path)!r} not found: this lm-eval does not ship the MMLU dev questions "
                                "(lm-eval 0.4.13 does)")
    return path


def parse_prompts(prompts: dict[str, str]) -> tuple[list[Question], int]:
    """``(questions, n_skipped)`` from the ``{subject: prompt text}`` of ``_cot_prompts.json``."""
    questions, skipped = [], 0
    for subject, text in prompts.items():
        for block in text.split("\n\nQ: ")[1:]:
            m = _QUESTION.match(block)
            fields = [m["question"], m["a"], m["b"], m["c"], m["d"]] if m else []
            if not m or any(_BROKEN.search(f) or re.search(r"\([A-E]\) ", f) for f in fields):
                skipped += 1
                continue
            questions.append(Question(subject, fields[0].strip(), tuple(f.strip() for f in fields[1:]),
                                      LETTERS.index(m["answer"])))
    return questions, skipped


def dev_questions(path: str | Path | None = None) -> tuple[list[Question], int]:
    """The parsed MMLU dev questions and how many were skipped (see the module docstring)."""
    path = Path(path) if path is not None else cot_prompts_path()
    return parse_prompts(json.loads(path.read_text(encoding="utf-8")))


def question_text(q: Question) -> str:
    """lm-eval's MMLU ``doc_to_text``: ``question\\nA. …\\nB. …\\nC. …\\nD. …\\nAnswer:``."""
    return q.question + "".join(f"\n{letter}. {c}" for letter, c in zip(LETTERS, q.choices)) + "\nAnswer:"


def subject_line(subject: str, vocab: set[str] | None = None) -> str:
    """lm-eval's MMLU description, without the characters outside ``vocab`` (if given)."""
    text = f"The following are multiple choice questions (with answers) about {subject.replace('_', ' ')}.\n\n"
    return text if vocab is None else "".join(c for c in text if c in vocab)


def prompt(q: Question, shots: Iterable[Question], vocab: set[str] | None = None) -> str:
    """lm-eval's MMLU few-shot context: the subject line, each shot with its answer, then ``q``."""
    return (subject_line(q.subject, vocab) + "".join(f"{question_text(s)} {LETTERS[s.answer]}\n\n" for s in shots)
            + question_text(q))


def select(questions: list[Question], vocab: set[str] | None) -> tuple[list[Question], int]:
    """``(kept, n_dropped)``: the questions whose question and choices are spelled in ``vocab``;
    all of them when ``vocab`` is None.

    Raises:
        ValueError: ``vocab`` lacks a character of the answer format (``A``–``D``, ``.``, ``:``,
            space, newline, ``Answer``).
    """
    if vocab is None:
        return list(questions), 0
    missing = sorted(set(question_text(Question("x", "", ("", "", "", ""), 0)) + " ABCD") - vocab)
    if missing:
        raise ValueError(f"the model's vocabulary lacks {''.join(missing)!r}, needed by the MMLU answer format")
    kept = [q for q in questions if set(q.question + "".join(q.choices)) <= vocab]
    return kept, len(questions) - len(kept)


def build_docs(questions: list[Question], num_fewshot: int = MAX_FEWSHOT, vocab: set[str] | None = None,
               fits: Callable[[str], bool] | None = None) -> list[dict]:
    """One lm-eval doc per question: ``prompt`` (with the first ``num_fewshot`` other questions of
    its subject as shots, in file order), ``answer`` (0–3), ``subject``, ``n_shots``.

    ``fits(text)``: whether a prompt and its answer fit the model's context; shots are dropped
    (the last first) until it does, so that no shot is cut off from the left by the harness, and
    ``n_shots`` is the number that really fit.

    Raises:
        ValueError: ``num_fewshot`` outside ``[0, 4]``.
    """
    if not isinstance(num_fewshot, int) or not 0 <= num_fewshot <= MAX_FEWSHOT:
        raise ValueError(f"num_fewshot={num_fewshot!r} must be an integer in [0, {MAX_FEWSHOT}]: a subject has 5 "
                         "dev questions and a question is never its own shot")
    docs = []
    for q in questions:
        shots = [s for s in questions if s.subject == q.subject and s != q][:num_fewshot]
        while shots and fits is not None and not fits(prompt(q, shots, vocab) + " " + LETTERS[q.answer]):
            shots.pop()
        docs.append({"prompt": prompt(q, shots, vocab), "answer": q.answer, "subject": q.subject,
                     "n_shots": len(shots)})
    return docs


TASK_YAML = """\
task: {task}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{prompt}}}}"
doc_to_choice: ["A", "B", "C", "D"]
doc_to_target: answer
num_fewshot: 0
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
"""


def build_task(out_dir: str | Path, vocab: set[str] | None = None, num_fewshot: int = MAX_FEWSHOT,
               path: str | Path | None = None, fits: Callable[[str], bool] | None = None) -> dict:
    """Write ``out_dir/mmlu_dev.yaml`` + ``mmlu_dev.jsonl`` (an lm-eval task on local files).

    ``fits``: see :func:`build_docs` (the shots that do not fit the context are left out).

    Returns:
        ``{"task": "mmlu_dev", "include_path": out_dir, "n_questions", "n_parse_skipped",
        "n_oov_skipped", "num_fewshot" (requested), "shots" (``{"min", "max", "mean"}`` of the
        shots that fit), "n_truncated" (prompts that do not fit even without shots),
        "subject_line_chars_removed"}``.

    Raises:
        FileNotFoundError: lm-eval's file is missing. ValueError: bad ``num_fewshot``, or no
            question left (every one has a character outside ``vocab``).
    """
    questions, parse_skipped = dev_questions(path)
    kept, oov = select(questions, vocab)
    if not kept:
        raise ValueError(f"none of the {len(questions)} MMLU dev questions can be written with the model's "
                         f"{len(vocab or ())} characters")
    docs = build_docs(kept, num_fewshot, vocab, fits)
    n_shots = [d["n_shots"] for d in docs]
    truncated = sum(1 for d in docs if fits is not None and not fits(d["prompt"] + " " + LETTERS[d["answer"]]))
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    data = out_dir / f"{TASK_NAME}.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in docs), encoding="utf-8")
    (out_dir / f"{TASK_NAME}.yaml").write_text(TASK_YAML.format(task=TASK_NAME, data=json.dumps(str(data.resolve()))),
                                               encoding="utf-8")
    removed = sorted({c for q in kept for c in subject_line(q.subject)} - set(vocab)) if vocab else []
    return {"task": TASK_NAME, "include_path": str(out_dir), "n_questions": len(docs),
            "n_parse_skipped": parse_skipped, "n_oov_skipped": oov, "num_fewshot": num_fewshot,
            "shots": {"min": min(n_shots), "max": max(n_shots), "mean": sum(n_shots) / len(n_shots)},
            "n_truncated": truncated,
            "subject_line_chars_removed": "".join(removed)}


def accuracy_table(samples: list[dict]) -> dict:
    """Accuracy with its standard error, overall and per subject, from per-question results
    ``{"subject", "correct"}``; chance is 0.25 (four choices).

    The standard error is the binomial one, ``sqrt(acc·(1−acc)/(n−1))`` (lm-eval's ``acc_stderr``
    for a mean of 0/1 scores).
    """
    def summary(xs: list[bool]) -> dict:
        n = len(xs)
        acc = sum(xs) / n
        return {"acc": acc, "acc_stderr": math.sqrt(acc * (1 - acc) / (n - 1)) if n > 1 else float("nan"), "n": n}

    subjects = sorted({s["subject"] for s in samples})
    return {**summary([s["correct"] for s in samples]), "chance": 0.25,
            "subjects": {sub: summary([s["correct"] for s in samples if s["subject"] == sub]) for sub in subjects}}




def main(argv: list[str] | None = None) -> int:
    """``python -m energyformer.eval.mmlu DIR [RUN_DIR] [NUM_FEWSHOT]``: write the ``mmlu_dev``
    task into DIR (for lm-eval's ``--include_path DIR``), spelled in RUN_DIR's character vocabulary
    if given."""
    import sys

    args = list(sys.argv[1:] if argv is None else argv)
    if not 1 <= len(args) <= 3:
        print("usage: python -m energyformer.eval.mmlu DIR [RUN_DIR] [NUM_FEWSHOT]", file=sys.stderr)
        return 2
    vocab = None
    if len(args) > 1:
        from energyformer.runs.rundir import read_run_meta

        vocab = set(read_run_meta(args[1]).get("chars") or ()) or None
    info = build_task(args[0], vocab=vocab, num_fewshot=int(args[2]) if len(args) > 2 else MAX_FEWSHOT)
    print(json.dumps(info))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
