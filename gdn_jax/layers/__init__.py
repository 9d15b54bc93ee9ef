"""Token mixers and small layers (Flax NNX)."""
from .attention import Attention, rope
from .conv import ShortConv
from .gated_deltanet import GatedDeltaNet, inverse_softplus

__all__ = ["Attention", "GatedDeltaNet", "ShortConv", "inverse_softplus", "rope"]
