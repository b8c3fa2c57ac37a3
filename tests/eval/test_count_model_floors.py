"""Count-model losses of a corpus (energyformer.eval.floors): hand-computed values, the cache
beside the data and its key (the splits' sizes and sha256: data re-prepared at the same size is
recomputed), the ListOps generator floor in that cache, and multiple-choice chance."""
import hashlib
import json
import math
from fractions import Fraction

import numpy as np
import pytest
from helpers import make_data_dir

from energyformer.data.listops import ListOpsSettings
from energyformer.data.task_data import prepare_task_data
from energyformer.eval.floors import FLOORS_FILE, count_model_losses, dataset_floors, multiple_choice_chance
from energyformer.tasks.listops_floor import generator_entropy

# ---------------------------------------------------------------------------------------------
# count models
# ---------------------------------------------------------------------------------------------

TRAIN, VOCAB = [0, 1, 0, 1, 1], 3  # unigram counts (2, 3, 0); pairs 01 ×2, 10, 11


def test_count_models_hand_computed():
    # add-one unigram: (c + 1) / (N + V) = (3/8, 4/8, 1/8)
    uni = [Fraction(3, 8), Fraction(4, 8), Fraction(1, 8)]
    res = count_model_losses(TRAIN, [1, 0, 2], VOCAB)
    assert res["unigram"] == pytest.approx(-sum(math.log(uni[t]) for t in (1, 0, 2)) / 3, rel=1e-12)
    # Witten-Bell: c(1)=2, T(1)=2 (followers 0, 1); c(0)=2, T(0)=1 (follower 1)
    p_1_0 = (1 + 2 * uni[0]) / (2 + 2)  # seen pair 1→0: 7/16
    p_0_2 = (0 + 1 * uni[2]) / (2 + 1)  # unseen pair 0→2: 1/24, finite
    assert p_1_0 == Fraction(7, 16) and p_0_2 == Fraction(1, 24)
    assert res["bigram"] == pytest.approx(-(math.log(p_1_0) + math.log(p_0_2)) / 2, rel=1e-12)
    # a context never seen in training falls back to the unigram
    assert count_model_losses(TRAIN, [2, 0], VOCAB)["bigram"] == pytest.approx(-math.log(3 / 8))


def test_bigram_rows_are_distributions():
    rng = np.random.default_rng(0)
    train, v = rng.integers(0, 6, size=200), 7  # id 6 never appears
    for a in range(v):
        total = sum(math.exp(-count_model_losses(train, [a, b], v)["bigram"]) for b in range(v))
        assert total == pytest.approx(1.0, abs=1e-12)


def test_count_models_bad_input():
    with pytest.raises(ValueError, match="token id 3"):
        count_model_losses(TRAIN, [3], VOCAB)
    with pytest.raises(ValueError, match="val_ids is empty"):
        count_model_losses(TRAIN, [], VOCAB)
    with pytest.raises(ValueError, match="vocab_size=0"):
        count_model_losses(TRAIN, [0], 0)


def test_dataset_floors_cached_beside_the_data(tmp_path):
    data = make_data_dir(tmp_path / "tiny")
    res = dataset_floors(data)
    assert res["bigram"] < res["unigram"] < math.log(json.loads((data / "meta.json").read_text())["vocab_size"])
    assert res["bigram_bpt"] == pytest.approx(res["bigram"] / math.log(2))
    saved = json.loads((data / FLOORS_FILE).read_text())
    assert saved["identity"]["n_val"] == res["identity"]["n_val"]
    saved["bigram"] = -1.0  # a cache of the same data is read back as it is
    (data / FLOORS_FILE).write_text(json.dumps(saved))
    assert dataset_floors(data)["bigram"] == -1.0
    saved["identity"]["n_val"] += 1  # a stale cache (other data) is recomputed
    (data / FLOORS_FILE).write_text(json.dumps(saved))
    assert dataset_floors(data)["bigram"] == pytest.approx(res["bigram"])
    # max_tokens fits and scores on the first tokens only (and is part of the cache key)
    train, val = (np.fromfile(data / f"{s}.bin", dtype=np.uint16) for s in ("train", "val"))
    vocab = json.loads((data / "meta.json").read_text())["vocab_size"]
    capped = dataset_floors(data, max_tokens=100)
    assert capped["bigram"] == pytest.approx(count_model_losses(train[:100], val[:100], vocab)["bigram"])
    assert dataset_floors(data)["bigram"] == pytest.approx(res["bigram"])


@pytest.mark.parametrize("split", ["train", "val"])
def test_dataset_floors_recomputed_for_other_data_of_the_same_size(tmp_path, split):
    """Re-prepared data with the same split sizes but other tokens in either split (a new sha256 in
    meta.json) is not served the cached floors of the old data (issue 28 item 5: only a changed
    length was tested)."""
    data = make_data_dir(tmp_path / "tiny")
    before = dataset_floors(data)
    ids = np.fromfile(data / f"{split}.bin", dtype=np.uint16)
    other = ids[::-1].copy()  # the same size, other tokens
    (data / f"{split}.bin").write_bytes(other.tobytes())
    meta = json.loads((data / "meta.json").read_text())
    meta[f"{split}_sha256"] = hashlib.sha256(other.tobytes()).hexdigest()
    (data / "meta.json").write_text(json.dumps(meta))
    after = dataset_floors(data)
    train, val = (np.fromfile(data / f"{s}.bin", dtype=np.uint16) for s in ("train", "val"))
    assert after["bigram"] == pytest.approx(count_model_losses(train, val, meta["vocab_size"])["bigram"])
    assert after["bigram"] != pytest.approx(before["bigram"])


def test_dataset_floors_of_listops_hold_the_generator_floor(tmp_path):
    out = prepare_task_data("listops", out_root=tmp_path, n_train=400, n_val=200, n_test=20)
    res = dataset_floors(out)["listops"]
    settings = json.loads((out / "meta.json").read_text())["settings"]
    assert res["generator"] == generator_entropy(ListOpsSettings(**settings))
    assert res["generator_on_val"]["n_examples"] == 200
    assert res["generator_on_val"]["all_tokens"] == pytest.approx(res["generator"]["all_tokens"], rel=0.1)


def test_multiple_choice_chance():
    assert multiple_choice_chance(4) == 0.25 and multiple_choice_chance(1) == 1.0
    for bad in (0, 2.5, True):
        with pytest.raises(ValueError, match="n_choices"):
            multiple_choice_chance(bad)
