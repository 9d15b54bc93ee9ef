"""The gated delta rule operator and its backends (scan, chunk, pallas), plus the decode step;
the no-delta-rule baselines (linear attention, per-head / per-channel decay) as ``gated_linear_attention``."""
from ._common import GateForms
from ._warnings import HeadFirstLayoutWarning, PallasInterpreterWarning
from .gated_delta_rule import BACKENDS, gated_delta_rule, resolve_backend
from .pallas.config import KernelConfig, Precision
from .pallas.hopper.tuning import HopperTuning
from .pallas.tuning import TritonTuning
from .linear_attention import LA_BACKENDS, gated_linear_attention
from .step import gated_delta_rule_step

__all__ = ["BACKENDS", "GateForms", "HeadFirstLayoutWarning", "HopperTuning", "KernelConfig", "PallasInterpreterWarning", "Precision", "TritonTuning", "LA_BACKENDS", "gated_delta_rule", "gated_delta_rule_step", "gated_linear_attention", "resolve_backend"]
