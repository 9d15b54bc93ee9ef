"""Small language models around the token mixers."""
from .lm import LM, LMConfig, MIXERS, register_mixer

__all__ = ["LM", "LMConfig", "MIXERS", "register_mixer"]
