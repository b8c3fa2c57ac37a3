"""Validation of prepared data with same-size changes (issue 28 item 5: a size check alone misses
them): ``check_prepared`` (is a dataset up to date?) and ``data_identity`` / ``identity_change``
(is it the data a run trained on?), for each split and in both directions."""
import hashlib
import json

import numpy as np
import pytest
from helpers import make_data_dir

from energyformer.data import data_identity
from energyformer.data.identity import identity_change
from energyformer.data.prepare import check_prepared


def _prepared(path):
    """A tiny dataset whose meta.json records both splits' sha256, as a real prepare writes it."""
    data = make_data_dir(path)
    meta = json.loads((data / "meta.json").read_text())
    for split in ("train", "val"):
        meta[f"{split}_sha256"] = hashlib.sha256((data / f"{split}.bin").read_bytes()).hexdigest()
    meta["format_version"] = 1
    (data / "meta.json").write_text(json.dumps(meta))
    return data


def _same_size_change(path):
    """Swap the first two different tokens of ``path``: the same size, the same ids, other bytes."""
    ids = np.fromfile(path, dtype=np.uint16)
    j = int(np.flatnonzero(ids != ids[0])[0])
    ids[[0, j]] = ids[[j, 0]]
    ids.tofile(path)


@pytest.mark.parametrize("split", ["train", "val"])
def test_a_split_changed_at_the_same_size_is_not_up_to_date(tmp_path, split):
    data = _prepared(tmp_path / "tiny")
    assert check_prepared(data, {}) is None
    size = (data / f"{split}.bin").stat().st_size
    _same_size_change(data / f"{split}.bin")
    assert (data / f"{split}.bin").stat().st_size == size
    assert check_prepared(data, {}) == f"{split}.bin does not match its sha256 in meta.json (corrupt?)"
    (data / f"{split}.bin").write_bytes((data / f"{split}.bin").read_bytes()[:-2])
    assert check_prepared(data, {}) == f"{split}.bin has the wrong size (truncated?)"


@pytest.mark.parametrize("split", ["train", "val"])
def test_a_split_changed_at_the_same_size_is_other_data(tmp_path, split):
    data = _prepared(tmp_path / "tiny")
    before = data_identity(data)
    _same_size_change(data / f"{split}.bin")
    after = data_identity(data)
    other = "val" if split == "train" else "train"
    assert after[f"{other}_sha256"] == before[f"{other}_sha256"]
    for recorded, current in ((before, after), (after, before)):  # both directions
        change = identity_change(recorded, current)
        assert change.startswith(f"{split}.bin changed (sha256 ") and f"{other}.bin" not in change
    assert identity_change(before, dict(before)) is None


def test_a_vocabulary_with_a_character_more_or_less_is_named_both_ways(tmp_path):
    data = _prepared(tmp_path / "tiny")
    meta = json.loads((data / "meta.json").read_text())
    grown = {**meta, "chars": meta["chars"] + ["~"], "vocab_size": meta["vocab_size"] + 1}
    a, b = data_identity(data, meta), data_identity(data, grown)
    assert identity_change(a, b, meta, grown).startswith("the vocabulary changed (char tokenizer: ")
    assert "added '~'" in identity_change(a, b, meta, grown)
    assert "removed '~'" in identity_change(b, a, grown, meta)
    old = {k: v for k, v in a.items() if k != "train_sha256"}  # an older run recorded less: not compared
    assert identity_change(old, {**a, "train_sha256": "0" * 64}) is None
