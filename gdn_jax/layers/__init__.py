"""Token mixers and small layers (Flax NNX), with the decode caches they own."""
from .attention import Attention, KVCache, rope
from .conv import ShortConv
from .gated_deltanet import GatedDeltaNet, inverse_softplus
from .kda import KimiDeltaAttention
from .linear_attention import GatedLinearAttention
from .norm import ZeroCenteredRMSNorm
from .recurrent import GDNCache

__all__ = ["Attention", "GDNCache", "GatedDeltaNet", "GatedLinearAttention", "KVCache", "KimiDeltaAttention",
           "ShortConv", "ZeroCenteredRMSNorm", "inverse_softplus", "rope"]
