"""Token mixers and small layers (Flax NNX), with the decode caches they own."""
from .attention import Attention, KVCache, rope
from .conv import ShortConv
from .gated_deltanet import GatedDeltaNet, inverse_softplus
from .linear_attention import GatedLinearAttention
from .recurrent import GDNCache

__all__ = ["Attention", "GDNCache", "GatedDeltaNet", "GatedLinearAttention", "KVCache", "ShortConv",
           "inverse_softplus", "rope"]
