"""Parameter accounting (energyformer/models/accounting.py): docs/cem.md §8, docs/testing.md §10."""
from __future__ import annotations

import pytest

from energyformer.models.accounting import parameter_counts, parameter_report
from energyformer.models.cem import CEMConfig, CEMLlama
from energyformer.models.gpt import GPTConfig
from energyformer.models.llama import LlamaConfig

D, H, DFF, L, V = 64, 4, 96, 3, 50


def _cem(**kw):
    return CEMConfig(**{"vocab_size": V, "d_model": D, "n_heads": H, "d_ff": DFF, "n_layers": L, **kw})


def test_tied_attention_is_half_and_tied_mlp_two_thirds_of_llama():
    c = parameter_counts(_cem())
    pl, bl = c["per_layer"], c["baseline"]["per_layer"]
    assert pl["attn"]["projections"] == 2 * D * D and bl["attn"]["projections"] == 4 * D * D
    assert pl["mlp"]["projections"] == 2 * D * DFF and bl["mlp"]["projections"] == 3 * D * DFF
    assert c["ratios"]["attn_projections"] == 0.5
    assert c["ratios"]["mlp_projections"] == pytest.approx(2 / 3, abs=0)
    # docs/cem.md §8: CEM = 2 d·H d_h + 2 d d_ff + 2d + [η: 2]; Llama = 4 d·H d_h + 3 d d_ff + 2d
    assert pl["total"] == 2 * D * D + 2 * D * DFF + 2 * D + 2
    assert bl["total"] == 4 * D * D + 3 * D * DFF + 2 * D


def test_head_dim_not_d_over_h():
    c = parameter_counts(_cem(head_dim=10))
    assert c["per_layer"]["attn"]["projections"] == 2 * D * H * 10
    assert c["baseline"]["per_layer"]["attn"]["projections"] == 4 * D * H * 10


@pytest.mark.parametrize("interaction,extra", [("lowrank", 0), ("diag_shared", D), ("diag_per_head", H * D)])
def test_dlr_extra(interaction, extra):
    c = parameter_counts(_cem(interaction=interaction))
    assert c["per_layer"]["attn"]["diag"] == extra
    assert c["per_layer"]["total"] == parameter_counts(_cem())["per_layer"]["total"] + extra


@pytest.mark.parametrize("rank", [2, 8])
def test_preconditioner_extra(rank):
    """docs/cem.md §8: two diag+low-rank preconditioners add 2·(d + 2dr) per layer (and remove the 2 η)."""
    plain = parameter_counts(_cem())["per_layer"]["total"]
    c = parameter_counts(_cem(preconditioner="diag_lowrank", preconditioner_rank=rank))
    pl = c["per_layer"]
    assert pl["attn"]["preconditioner"] + pl["mlp"]["preconditioner"] == 2 * (D + 2 * D * rank)
    assert pl["attn"]["step_size"] == pl["mlp"]["step_size"] == 0  # η ≡ 1 with P (docs/cem.md §6)
    assert pl["total"] == plain - 2 + 2 * (D + 2 * D * rank)
    psd = parameter_counts(_cem(preconditioner="diag_lowrank_psd", preconditioner_rank=rank))["per_layer"]
    assert psd["attn"]["preconditioner"] == D + D * rank
    diag = parameter_counts(_cem(preconditioner="diag"))["per_layer"]
    assert diag["mlp"]["preconditioner"] == D


def test_per_step_scales_and_recursion_add_no_matrices():
    base = parameter_counts(_cem())["per_layer"]["total"]
    assert parameter_counts(_cem(n_steps=4))["per_layer"]["total"] == base
    assert parameter_counts(_cem(n_steps=4, per_step_scale=True))["per_layer"]["total"] == base + 2 * 4


def test_totals_match_a_real_model_and_spec_example():
    cfg = _cem(interaction="diag_shared", preconditioner="diag_lowrank", preconditioner_rank=4, tie_embeddings=True)
    c = parameter_counts(cfg)
    model = CEMLlama(cfg)
    assert c["total"] == model.num_params() and c["non_embedding"] == model.num_params(non_embedding=True)
    assert c["total"] == c["non_embedding"] + V * D
    # docs/cem.md §8 example (d=768, L=12, H=12, d_ff=2048): Llama 84.95M, CEM-tied 51.92M non-embedding,
    # counting the norms but not the (untied) LM head.
    big = parameter_counts(CEMConfig(vocab_size=32000, d_model=768, n_layers=12, n_heads=12, d_ff=2048))
    head = 32000 * 768
    assert round((big["baseline"]["non_embedding"] - head) / 1e6, 2) == 84.95
    assert round((big["non_embedding"] - head - 24) / 1e6, 2) == 51.92  # 24 = the η scalars


def test_counts_are_built_on_meta_device(monkeypatch):
    seen = []
    orig = CEMLlama.__init__

    def spy(self, cfg):
        orig(self, cfg)
        seen.append(self.embed.weight.device.type)

    monkeypatch.setattr(CEMLlama, "__init__", spy)
    parameter_counts(CEMConfig(vocab_size=50000, d_model=1024, n_layers=24, n_heads=16))
    assert seen == ["meta"]


def test_report_is_readable_for_cem_llama_and_gpt():
    rep = parameter_report(_cem(interaction="diag_shared"))
    assert "attention projections" in rep and "0.500" in rep and "0.667" in rep and "llama" in rep
    assert f"{2 * D * D:,}" in rep
    llama = parameter_report(LlamaConfig(vocab_size=V, d_model=D, n_heads=H, d_ff=DFF, n_layers=L))
    assert "per layer: attention" in llama and "total" in llama
    gpt = parameter_report(GPTConfig(vocab_size=V))
    assert "total" in gpt and "arch='gpt'" in gpt
    assert parameter_counts(GPTConfig(vocab_size=V))["total"] > 0


def test_groups_come_from_the_entries():
    """A new entry with a new kind of parameter gets its own accounting row with no change here."""
    import torch
    import torch.nn as nn

    from energyformer.layers.cem_options import INTERACTIONS, LowRankInteraction

    @INTERACTIONS.register("toy_with_temperature")
    class ToyWithTemperature(LowRankInteraction):
        """Low rank plus a learned per-head temperature (a toy for the accounting)."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.log_temp = nn.Parameter(torch.zeros(self.n_heads))

        def param_groups(self):
            return {**super().param_groups(), "temperature": [self.log_temp]}

    try:
        c = parameter_counts(_cem(interaction="toy_with_temperature"))
        assert c["per_layer"]["attn"]["temperature"] == H and "temperature" not in c["per_layer"]["mlp"]
        assert "per layer: attention temperature" in parameter_report(_cem(interaction="toy_with_temperature"))
    finally:
        INTERACTIONS.unregister("toy_with_temperature")
