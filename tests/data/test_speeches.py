"""The same-play speech split (energyformer.data.speeches): held-out speeches of the training plays,
with the source's vocabulary so the source's cross-play validation split scores the same model."""
import json

import numpy as np
import pytest

from energyformer.data import load_split
from energyformer.data.meta import load_meta
from energyformer.data.prepare import prepare_text
from energyformer.data.speeches import prepare_speech_split, split_speeches
from energyformer.data.tokenizers import CharTokenizer


def _play(n):
    return "".join(f"SPEAKER {i}:\nline {i} of the play\n\n" for i in range(n))


def test_split_speeches_holds_out_every_kth_speech():
    text = _play(25)
    train, held = split_speeches(text, every=10)
    assert held == "SPEAKER 0:\nline 0 of the play\n\nSPEAKER 10:\nline 10 of the play\n\nSPEAKER 20:\nline 20 of the play\n\n"
    assert "SPEAKER 1:\n" in train and "SPEAKER 10:" not in train
    assert sorted((train + held).split("\n\n")) == sorted(text.split("\n\n"))  # nothing lost, nothing doubled
    with pytest.raises(ValueError, match="the text has 3 speeches; holding out every 10th needs at least 10"):
        split_speeches(_play(3), every=10)
    with pytest.raises(ValueError, match="every=1 must be >= 2"):
        split_speeches(text, every=1)


def test_prepare_speech_split_keeps_the_source_vocabulary(tmp_path):
    src = tmp_path / "corpus.txt"
    src.write_text(_play(60) + "ZQ: only in the last plays\n\n", encoding="utf-8")  # Z and Q only in val
    source = prepare_text(src, out_dir=tmp_path / "corpus", verbose=False)
    out = prepare_speech_split(source, tmp_path / "corpus_speeches", every=10)
    meta, src_meta = load_meta(out), load_meta(source)
    assert meta["chars"] == src_meta["chars"] and "Z" in meta["chars"]  # the cross-play split encodes the same
    tok = CharTokenizer.from_meta(src_meta)
    train_text = tok.decode(np.asarray(load_split(source, "train")).tolist())
    want_train, want_val = split_speeches(train_text, every=10)
    assert tok.decode(np.asarray(load_split(out, "train")).tolist()) == want_train
    assert tok.decode(np.asarray(load_split(out, "val")).tolist()) == want_val
    assert meta["n_train"] + meta["n_val"] == src_meta["n_train"]
    before = (out / "meta.json").stat().st_mtime_ns
    assert prepare_speech_split(source, out, every=10) == out and (out / "meta.json").stat().st_mtime_ns == before
    prepare_speech_split(source, out, every=5)  # another split: rebuilt
    assert json.loads((out / "meta.json").read_text())["source"]["every"] == 5


def test_prepare_speech_split_errors(tmp_path):
    src = tmp_path / "corpus.txt"
    src.write_text(_play(60), encoding="utf-8")
    source = prepare_text(src, out_dir=tmp_path / "corpus", verbose=False)
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("model: {}\n")
    with pytest.raises(ValueError, match="holds a training run"):
        prepare_speech_split(source, run)
    assert sorted(p.name for p in run.iterdir()) == ["config.yaml"]
    with pytest.raises(FileNotFoundError):
        prepare_speech_split(tmp_path / "none", tmp_path / "out")
    d = tmp_path / "bpe"
    d.mkdir()
    (d / "meta.json").write_text(json.dumps({"format_version": 1, "tokenizer": "gpt2", "vocab_size": 50257,
                                             "n_train": 4, "n_val": 4}))
    (d / "train.bin").write_bytes(np.zeros(4, np.uint16).tobytes())
    (d / "val.bin").write_bytes(np.zeros(4, np.uint16).tobytes())
    with pytest.raises(ValueError, match="uses the 'gpt2' tokenizer; a speech split needs a character dataset"):
        prepare_speech_split(d, tmp_path / "out")
