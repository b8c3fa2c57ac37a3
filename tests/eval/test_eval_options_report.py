"""`energyformer eval` with inference options records them and, with an exit, the steps each token
used (the number an adaptive-exit study reads), in the JSON report and in its Markdown header."""
import json

from helpers import tiny_config

from energyformer.eval.suite import evaluate_run, format_report
from energyformer.train import train


def test_eval_records_its_options_and_the_steps_used(data_dir, tmp_path):
    run = tmp_path / "nrgpt"
    train(tiny_config(data_dir, run, "nrgpt", max_steps=4))
    plain = evaluate_run(run, "val_loss", out=tmp_path / "plain.json", limit=2, progress=False)
    assert "options" not in plain and "steps_per_token" not in plain["tasks"]["val_loss"]
    got = evaluate_run(run, "val_loss", out=tmp_path / "exit.json", limit=2, progress=False, n_steps=6,
                       exit="abs:0")  # never fires: every token takes all 6 steps
    assert got["options"] == {"n_steps": 6, "exit": "abs:0"}
    assert got["tasks"]["val_loss"]["steps_per_token"] == {"mean": 6.0, "min": 6.0, "max": 6.0}
    assert json.loads((tmp_path / "exit.json").read_text())["options"]["exit"] == "abs:0"
    from energyformer.layers.exit import parse_exit

    parsed = evaluate_run(run, "val_loss", out=tmp_path / "parsed.json", limit=1, progress=False,
                          exit=parse_exit("rel:0.03"), accept_lower_energy=True)  # as the CLI passes it
    assert parsed["options"] == {"exit": "rel:0.03", "accept_lower_energy": True}
    text = format_report(got)
    assert text.splitlines()[0].endswith("(n_steps=6, exit=abs:0)") and "steps per token" in text
