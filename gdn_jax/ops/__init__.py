"""The gated delta rule operator and its backends (scan, chunk, pallas)."""
from .gated_delta_rule import BACKENDS, gated_delta_rule, resolve_backend

__all__ = ["BACKENDS", "gated_delta_rule", "resolve_backend"]
