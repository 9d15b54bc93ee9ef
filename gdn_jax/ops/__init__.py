"""The gated delta rule operator and its backends (scan, chunk, pallas), plus the decode step."""
from .gated_delta_rule import BACKENDS, gated_delta_rule, resolve_backend
from .step import gated_delta_rule_step

__all__ = ["BACKENDS", "gated_delta_rule", "gated_delta_rule_step", "resolve_backend"]
