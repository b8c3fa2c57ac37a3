"""energyformer: Transformer layers as explicit descent steps on causal energies.

See SPEC.md (CEM §3, NRGPT §4) for the math and README.md for usage.
"""
from energyformer.models.registry import build_model

__version__ = "0.1.0"
__all__ = ["build_model", "__version__"]
