"""The lm-eval adapter with a per-token adaptive exit (``--model_args run=RUN,exit=kl:1e-3,...``;
docs/inference_compute.md §1): log-likelihoods are our model's with the same exit, by hand."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("lm_eval")

from lm_eval.api.instance import Instance  # noqa: E402
from run_helpers import CHARS, make_run  # noqa: E402

from energyformer.data import CharTokenizer  # noqa: E402
from energyformer.eval.harness import EnergyformerLM  # noqa: E402

TOK = CharTokenizer(CHARS)


def test_loglikelihood_with_exit_and_monotone_is_ours_by_hand(tmp_path):
    run = make_run(tmp_path / "run", {"arch": "nrgpt"})
    lm = EnergyformerLM(run=str(run), batch_size=2, n_steps="8", exit="kl:1e-3", accept_lower_energy="true")
    assert lm.forward_kwargs["exit"].spec() == "kl:0.001" and lm.forward_kwargs["accept_lower_energy"] is True
    pairs = [("the cat sat", " on a mat."), ("a", " dog"), ("so on, 0 to", " 9!")]
    got = lm.loglikelihood([Instance(request_type="loglikelihood", doc={}, arguments=p, idx=0) for p in pairs])
    for (ctx, cont), (score, _) in zip(pairs, got):
        ids = TOK.encode(ctx + cont)
        with torch.no_grad():
            lp = F.log_softmax(lm.model(torch.tensor([ids[:-1]]), n_steps=8, exit="kl:1e-3",
                                        accept_lower_energy=True)[0][0].float(), dim=-1)
        want = sum(float(lp[i - 1, ids[i]]) for i in range(len(ids) - len(cont), len(ids)))
        assert score == pytest.approx(want, abs=1e-4)
    plain = EnergyformerLM(run=str(run), batch_size=2).loglikelihood(
        [Instance(request_type="loglikelihood", doc={}, arguments=pairs[0], idx=0)])
    assert plain[0][0] != pytest.approx(got[0][0], abs=1e-4)  # the options reached the model
    with pytest.raises(ValueError, match="unknown exit criterion 'klx'"):
        EnergyformerLM(run=str(run), exit="klx:1")
