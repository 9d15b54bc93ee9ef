"""gdn_jax: Gated DeltaNet in JAX/Flax (Yang, Kautz & Hatamizadeh, ICLR 2025)."""
from .ops import gated_delta_rule

__version__ = "0.1.0"
__all__ = ["gated_delta_rule", "__version__"]
