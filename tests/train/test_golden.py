"""Golden loss curves (tests/golden/, torchtitan's practice): each family's first 50 training steps
on a tiny CPU config, through the real training loop, equal the committed curve within a tolerance
for CPU determinism. A failure names the steps that moved; a change meant to move them rewrites
them with ``python -m tests.golden.update --rewrite`` (and says why in its commit)."""
import pytest
from golden import update
from helpers import TINY_MODELS


def test_every_family_has_a_golden_curve_of_its_tiny_config():
    from energyformer.models.registry import ARCH_SPECS

    # every built-in family (a plugin's, registered by another test, is not ours to keep a curve of):
    # the language models' tiny configs and the regressor
    built_in = {arch for arch, spec in ARCH_SPECS.items() if spec.module.startswith("energyformer.")}
    assert built_in <= {m["arch"] for m in update.MODELS.values()} and set(TINY_MODELS) <= set(update.MODELS)
    for family in update.MODELS:
        assert update.golden_path(family).is_file(), f"{family}: python -m tests.golden.update --rewrite {family}"
        g = update.load(family)
        assert g["model"] == update.MODELS[family] and g["train"] == update.train_of(family) \
            and g["data"] == update.data_of(family), \
            f"{family}: its tiny config changed since the curve; python -m tests.golden.update --rewrite {family}"
        assert len(g["train_loss"]) == update.STEPS


@pytest.mark.parametrize("family", sorted(update.MODELS))
def test_the_first_50_steps_follow_the_golden_curve(family, tmp_path):
    diff = update.compare(family, tmp_path)
    assert not diff, (f"{family} trains differently from tests/golden/{family}.json:\n  " + "\n  ".join(diff[:10])
                      + f"\nif the change is meant to: python -m tests.golden.update --rewrite {family}")


def test_a_moved_curve_is_reported_by_step():
    golden = [2.0, 1.5, 1.2]
    assert update.differences(golden, [2.0, 1.5 + 1e-6, 1.2]) == []  # within the CPU tolerance
    assert update.differences(golden, [2.0, 1.51, 1.2]) == ["step 2: golden 1.500000, now 1.510000 (|Δ| 1.00e-02)"]
    assert update.differences(golden, golden[:2]) == ["2 steps logged, the golden curve has 3"]
