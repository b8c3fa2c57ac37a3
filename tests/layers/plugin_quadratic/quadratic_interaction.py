"""The registry-entry file of the two-file plugin: registers interaction="quadratic"
(tests/layers/test_plugin_energy.py)."""
from quadratic_energy import quadratic_energy, quadratic_grad

from energyformer.layers.cem_options import INTERACTIONS, Interaction


@INTERACTIONS.register("quadratic")
class QuadraticInteraction(Interaction):
    """Toy: ε_i = −Σ_k Σ_{j≤i} (q_i·k_j)² / (2τ(i+1)), keys W_K ĥ (no RoPE)."""

    @classmethod
    def check_options(cls, *, d_model, n_heads, head_dim, rope):
        super().check_options(d_model=d_model, n_heads=n_heads, head_dim=head_dim, rope=rope)
        if rope is not None:
            raise ValueError(f"interaction='quadratic' has no RoPE form; got rope={rope!r}, expected None")

    def grad(self, g, h_hat, ctx):
        return quadratic_grad(g, ctx.k, self.q_proj.weight, self.n_heads, self.tau)

    def energy(self, g, h_hat):
        return quadratic_energy(g, h_hat, self.q_proj.weight, self.k_proj.weight, self.n_heads, self.tau)
