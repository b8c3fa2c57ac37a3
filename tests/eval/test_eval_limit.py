"""`energyformer eval --limit N` needs N >= 1: 0 and negatives are refused naming the option,
before the run is loaded (they used to fail inside lm-eval or report a 1-token val.bin)."""
import pytest

from energyformer.eval.suite import evaluate_run


@pytest.mark.parametrize("limit", [0, -2])
def test_limit_below_one_is_refused(tmp_path, limit):
    with pytest.raises(ValueError, match=rf"^limit={limit} must be >= 1"):
        evaluate_run(tmp_path / "no_run", "val_loss", limit=limit)
