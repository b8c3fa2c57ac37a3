"""`energyformer train ... --train.max_steps 0` is a valid value: its summary has no speed."""
from energyformer.cli import format_summary


def test_summary_without_speed_prints():
    s = {"steps": 0, "steps_this_run": 0, "resumed_from": None, "best_val_loss": 4.3,
         "final_val_loss": 4.3, "final_train_loss": 4.3, "tokens_per_s": None, "mfu": None,
         "minutes": 0.04, "params": 10, "params_non_embedding": 5, "device": "cpu",
         "world_size": 1, "out_dir": "out/x"}
    text = format_summary(s)
    assert "speed: n/a tokens/s" in text
