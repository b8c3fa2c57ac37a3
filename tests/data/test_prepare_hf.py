"""``energyformer prepare hf`` on local fixture files (jsonl, parquet, text), resuming, uint32 token files."""
import json

import numpy as np
import pytest

pytest.importorskip("datasets")

from energyformer.cli import main  # noqa: E402
from energyformer.data import (  # noqa: E402
    get_batch,
    hf_corpus,  # noqa: E402
    load_meta,
    load_split,
    load_tokenizer,
)
from energyformer.data.hf_corpus import HFSettings, prepare_hf  # noqa: E402

DOCS = [f"Document {i}: the cat sat on the mat, {'and ran ' * (i % 4)}away.\nThe end {i}." for i in range(23)]


def _jsonl(path, docs=DOCS, field="text"):
    path.write_text("".join(json.dumps({field: d, "id": i}) + "\n" for i, d in enumerate(docs)), encoding="utf-8")
    return path


def _stream(docs=DOCS) -> str:
    return "".join(d + "\n" for d in docs)  # char: "\n" after every document


def _prep(tmp_path, dataset, name, force=False, **kw):
    kw = {"tokenizer": "char", "val_fraction": 0.1, "shard_documents": 100, "num_proc": 1, **kw}
    return prepare_hf(HFSettings(dataset=str(dataset), **kw), out_dir=tmp_path / name, force=force, progress=False,
                      verbose=False)


def _all_text(out):
    tok = load_tokenizer(out)
    return tok.decode(load_split(out, "train")) + tok.decode(load_split(out, "val"))


def test_jsonl_parquet_and_text_files_give_the_documents_in_order(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    jsonl = _jsonl(tmp_path / "c.jsonl")
    pq.write_table(pa.table({"text": DOCS}), tmp_path / "c.parquet")
    folder = tmp_path / "texts"
    folder.mkdir()
    for i, d in enumerate(DOCS):  # a text file is one document; files are read in sorted order
        (folder / f"{i:03d}.txt").write_text(d, encoding="utf-8")
    outs = [_prep(tmp_path, src, name) for src, name in ((jsonl, "j"), (tmp_path / "c.parquet", "p"), (folder, "t"))]
    for out in outs:
        meta = load_meta(out)
        assert _all_text(out) == _stream()
        assert meta["dtype"] == "uint16" and meta["n_documents"] == len(DOCS) and meta["tokenizer"] == "char"
        n = meta["n_train"] + meta["n_val"]
        assert meta["n_train"] == int(n * 0.9)  # one shard: nanoGPT's positional split
    assert (outs[0] / "train.bin").read_bytes() == (outs[1] / "train.bin").read_bytes()
    assert not (outs[0] / "shards").exists()  # removed once train.bin / val.bin are written


def test_shards_split_each_by_position_and_processes_do_not_change_the_ids(tmp_path):
    src = _jsonl(tmp_path / "c.jsonl")
    one = _prep(tmp_path, src, "one", shard_documents=5)
    two = _prep(tmp_path, src, "two", shard_documents=5, num_proc=2)
    for split in ("train", "val"):
        assert np.array_equal(load_split(one, split), load_split(two, split))
    tok = load_tokenizer(one)
    train = tok.decode(load_split(one, "train"))
    first = _stream(DOCS[:5])
    assert train.startswith(first[:int(len(first) * 0.9)])  # shard 0's train part comes first
    assert load_meta(one)["n_train"] + load_meta(one)["n_val"] == len(_stream())


def _same_files(a, b) -> bool:
    return all((a / n).read_bytes() == (b / n).read_bytes() for n in ("train.bin", "val.bin"))


def _interrupted(tmp_path, monkeypatch, src, name, shard_documents):
    """A prepare killed after its first shard; the monkeypatch is undone."""
    real_write = hf_corpus.write_shard

    def crash(shards, state, n, ids):
        if state["shards"]:
            raise KeyboardInterrupt("killed")
        real_write(shards, state, n, ids)

    monkeypatch.setattr(hf_corpus, "write_shard", crash)
    with pytest.raises(KeyboardInterrupt):
        _prep(tmp_path, src, name, shard_documents=shard_documents)
    monkeypatch.undo()


def test_an_interrupted_prepare_resumes_after_its_finished_shards(tmp_path, monkeypatch):
    src = _jsonl(tmp_path / "c.jsonl")
    whole = _prep(tmp_path, src, "whole", shard_documents=5)
    _interrupted(tmp_path, monkeypatch, src, "part", 5)
    progress = json.loads((tmp_path / "part" / "shards" / "progress.json").read_text())
    assert [s["n_documents"] for s in progress["shards"]] == [5]
    assert not (tmp_path / "part" / "meta.json").exists()
    encoded = []
    real_encode = hf_corpus._encode_documents
    monkeypatch.setattr(hf_corpus, "_encode_documents", lambda texts: encoded.extend(texts) or real_encode(texts))
    part = _prep(tmp_path, src, "part", shard_documents=5)
    assert encoded == DOCS[5:]  # the finished shard is not tokenized again
    assert _same_files(part, whole)
    encoded.clear()
    _prep(tmp_path, src, "part", shard_documents=5)  # up to date: nothing is read
    assert encoded == []
    with pytest.raises(ValueError, match=r"already holds a dataset of other settings .*val_fraction: 0\.1 there, "
                                         r"0\.2 now.*--force"):
        _prep(tmp_path, src, "part", shard_documents=5, val_fraction=0.2)  # another split: only with force
    assert encoded == []
    _prep(tmp_path, src, "part", shard_documents=5, val_fraction=0.2, force=True)  # rebuilt
    assert encoded == DOCS and load_meta(part)["val_fraction"] == 0.2


def test_a_finished_shard_changed_in_place_is_not_reused(tmp_path, monkeypatch):
    """A resumed prepare checks each finished shard's sha256, not only that it exists: a shard of the
    same size with other bytes is tokenized again (as is a missing one)."""
    src = _jsonl(tmp_path / "c.jsonl")
    whole = _prep(tmp_path, src, "whole", shard_documents=5)
    for damage in ("same size, other bytes", "missing"):
        _interrupted(tmp_path, monkeypatch, src, damage, 5)
        shard = tmp_path / damage / "shards" / "00000.bin"
        if damage == "missing":
            shard.unlink()
        else:
            ids = np.fromfile(shard, dtype=np.uint16)
            shard.write_bytes(ids[::-1].copy().tobytes())  # the same size, the tokens reversed
        encoded = []
        real_encode = hf_corpus._encode_documents
        monkeypatch.setattr(hf_corpus, "_encode_documents", lambda texts: encoded.extend(texts) or real_encode(texts))
        out = _prep(tmp_path, src, damage, shard_documents=5)
        monkeypatch.undo()
        assert encoded == DOCS, damage  # started over
        assert _same_files(out, whole), damage


def test_shards_of_other_settings_are_not_reused(tmp_path, monkeypatch):
    src = _jsonl(tmp_path / "c.jsonl")
    fresh = _prep(tmp_path, src, "fresh", shard_documents=7)
    _interrupted(tmp_path, monkeypatch, src, "x", 5)
    out = _prep(tmp_path, src, "x", shard_documents=7)  # a 5-document shard would split differently
    assert _same_files(out, fresh)


def test_a_vocabulary_over_65535_ids_is_written_as_uint32(tmp_path):
    rng = np.random.default_rng(0)
    points = [c for c in range(0x4E00, 0x4E00 + 70_000) if not 0xD800 <= c < 0xE000]  # no surrogates
    docs = ["".join(map(chr, points[i::4])) for i in range(4)]
    docs = [d + "".join(chr(c) for c in rng.choice(points, 3000)) for d in docs]
    out = _prep(tmp_path, _jsonl(tmp_path / "big.jsonl", docs), "big", val_fraction=0.05)
    meta = load_meta(out)
    assert meta["dtype"] == "uint32" and meta["vocab_size"] > 65535
    train = load_split(out, "train")
    assert train.dtype == np.uint32 and int(train.max()) > 65535
    assert _all_text(out) == _stream(docs)
    import torch

    x, y = get_batch(train, 2, 8, torch.Generator().manual_seed(0))
    assert int(x.max()) < meta["vocab_size"] and torch.equal(x[:, 1:], y[:, :-1])


def test_the_loader_refuses_an_unknown_dtype_and_a_uint32_file_of_the_wrong_size(tmp_path):
    out = _prep(tmp_path, _jsonl(tmp_path / "c.jsonl"), "c")
    meta = load_meta(out)
    (out / "meta.json").write_text(json.dumps({**meta, "dtype": "int8"}))
    with pytest.raises(ValueError, match="dtype='int8'.*uint16"):
        load_split(out, "train")
    (out / "meta.json").write_text(json.dumps({**meta, "dtype": "uint32"}))  # the files hold uint16
    with pytest.raises(ValueError, match="uint32 tokens"):
        load_split(out, "train")


def test_bpe_marks_document_ends_and_a_bad_text_field_is_named(tmp_path):
    pytest.importorskip("tokenizers")
    src = _jsonl(tmp_path / "c.jsonl", field="body")
    with pytest.raises(ValueError, match="text_field='text' is not a column.*'body'"):
        _prep(tmp_path, src, "bad")
    out = _prep(tmp_path, src, "bpe", tokenizer="bpe", vocab_size=300, text_field="body")
    meta = load_meta(out)
    tok = load_tokenizer(out)
    assert meta["tokenizer"] == "bpe" and tok.vocab_size <= 300
    eot = tok.tokenizer.token_to_id(hf_corpus.EOT)
    ids = np.concatenate([load_split(out, "train"), load_split(out, "val")])
    assert int((ids == eot).sum()) == len(DOCS)
    assert tok.decode(ids) == "".join(d + hf_corpus.EOT for d in DOCS)


def test_bad_settings_are_one_line_errors(tmp_path, capsys):
    with pytest.raises(ValueError, match="tokenizer='wordpiece'"):
        HFSettings(dataset="x", tokenizer="wordpiece")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="holds no"):
        _prep(tmp_path, tmp_path / "empty", "e")
    assert main(["prepare", "hf", "--tokenizer", "char"]) == 2
    assert "dataset" in capsys.readouterr().err


def test_cli_prepare_hf_then_a_three_step_train(tmp_path, monkeypatch, capsys):
    from pathlib import Path

    monkeypatch.chdir(tmp_path)
    _jsonl(tmp_path / "corpus.jsonl", DOCS * 4)
    assert main(["prepare", "hf", "--dataset", "corpus.jsonl", "--tokenizer", "char", "--val-fraction", "0.1",
                 "--shard-documents", "30", "--num-proc", "1"]) == 0
    assert load_meta("data/corpus")["n_documents"] == 4 * len(DOCS)
    recipe = Path(__file__).resolve().parents[2] / "configs" / "shakespeare_char" / "gpt.yaml"
    assert main(["train", str(recipe), "--data.data_dir", "data/corpus", "--train.max_steps", "3",
                 "--train.out_dir", "out/c", "--train.device", "cpu", "--model.d_model", "32",
                 "--model.n_layers", "1", "--model.block_size", "16", "--train.batch_size", "2",
                 "--train.eval_interval", "3", "--train.eval_iters", "1", "--train.warmup_steps", "1",
                 "--train.compile", "false"]) == 0
    assert "done: 3 steps" in capsys.readouterr().out


@pytest.mark.parametrize("tokenizer", ["char", "bpe", "gpt2"])
def test_an_empty_file_is_one_error_line_naming_it(tmp_path, monkeypatch, capsys, tokenizer):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "e.jsonl").write_bytes(b"")  # `: > e.jsonl`
    assert main(["prepare", "hf", "--dataset", "e.jsonl", "--tokenizer", tokenizer, "--num-proc", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: 'e.jsonl' is empty; expected one JSON object per line with the document's text in "
                   "'text' (--text-field)"]
    assert not (tmp_path / "data").exists()  # nothing written


def test_files_without_documents_are_named(tmp_path):
    folder = tmp_path / "parts"
    folder.mkdir()
    for name in ("a.jsonl", "b.jsonl"):
        (folder / name).write_bytes(b"")
    with pytest.raises(ValueError, match=r"^every file in '.*parts' is empty \('a\.jsonl', 'b\.jsonl'\); expected one "
                                         r"JSON object per line"):
        _prep(tmp_path, folder, "p")
    (tmp_path / "blank.jsonl").write_text("\n\n  \n")
    with pytest.raises(ValueError, match=r"blank\.jsonl' holds no documents; expected one JSON object per line"):
        _prep(tmp_path, tmp_path / "blank.jsonl", "b")


@pytest.mark.parametrize("name,content,message", [
    ("latin1.jsonl", b'{"text": "ok"}\n{"text": "caf\xe9"}\n',
     r"^error: 'latin1\.jsonl' is not valid UTF-8: byte b'\\xe9' at offset 28 \(line 2\); convert it first, "
     r"e\.g\. `iconv -f latin1 -t utf-8 latin1\.jsonl`$"),
    ("broken.jsonl", b'{"text": "ok"}\n{"text": "no comma" "id": 1}\n',
     r"^error: 'broken\.jsonl' line 2 is not valid JSON \(Expecting ',' delimiter at column 21\); expected one "
     r"JSON object per line with the document's text in 'text' \(--text-field\)$"),
    ("latin1.txt", b"caf\xe9\n", r"^error: 'latin1\.txt' is not valid UTF-8: byte b'\\xe9' at offset 3 \(line 1\)"),
])
@pytest.mark.parametrize("tokenizer", ["char", "gpt2"])
def test_an_unreadable_file_is_one_error_line_naming_it(tmp_path, monkeypatch, capfd, name, content, message,
                                                        tokenizer):
    """Bytes that are not UTF-8 or a line that is not JSON: one line naming the file and where (datasets
    itself logs a second line, "Failed to load JSON from file ...", and names no file in its error)."""
    import re

    from datasets.utils import logging as datasets_logging

    if tokenizer == "gpt2":  # the tokenizer is built before the documents are read: fail there, not offline
        monkeypatch.setattr(hf_corpus, "build_tokenizer", lambda s, say: {"tokenizer": "char", "chars": ["\n"],
                                                                          "vocab_size": 1})
    monkeypatch.chdir(tmp_path)
    (tmp_path / name).write_bytes(content)
    level = datasets_logging.get_verbosity()
    capfd.readouterr()
    assert main(["prepare", "hf", "--dataset", name, "--tokenizer", tokenizer, "--num-proc", "1"]) == 2
    err = [line for line in capfd.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and re.search(message, err[0]), err
    assert datasets_logging.get_verbosity() == level  # datasets' own log is quiet only while reading
