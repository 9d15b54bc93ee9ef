"""Single-token (decode) update of the gated delta rule on a float32 state.

Per batch element and head, with state S ``[K, V]``::

    S   <- exp(g) * S                             # decay first (per head, or per key row)
    S   <- S + k (beta * (v - S^T k))^T            # delta-rule write, prediction from the decayed state
    o    = S^T (scale * q)

This is exactly one step of :func:`gdn_jax.ops.gated_delta_rule` (same order, same L2
normalisation, same default scale), so ``gated_delta_rule_step`` on token t agrees with the full
op on T = 1 (and, iterated, with any backend up to accumulation-order round-off).
"""
from __future__ import annotations

from typing import Optional, Tuple

import jax

from ._common import acc_dtype, check_step_inputs, prepare, repeat_key_heads, value_group
from .scan import _step


def gated_delta_rule_step(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    state: jax.Array,
    *,
    scale: Optional[float] = None,
    use_qk_l2norm: bool = False,
) -> Tuple[jax.Array, jax.Array]:
    """One decode step of the gated delta rule (every gate form; jit-able).

    Args:
      q, k: ``[B, Hk, K]`` query and key of the new token, any float dtype.
      v: ``[B, H, V]`` value; ``o`` is returned in ``v.dtype``. H may be a multiple of Hk (grouped
        value heads: value head j reads key head ``j // (H // Hk)``, as in ``gated_delta_rule``).
      g: log decay, ``[B, H]`` (per head) or ``[B, H, K]`` (per key channel, KDA).
      beta: ``[B, H]`` (per head) or ``[B, H, V]`` (per value channel).
      state: ``[B, H, K, V]`` recurrent state (any float dtype; computed in float32, float64 if
        any input is float64).
      scale: query scale, ``None`` means ``K ** -0.5``.
      use_qk_l2norm: L2-normalise q and k (eps 1e-6) before the scale, as the op does.

    Returns:
      ``(o, new_state)``: o ``[B, H, V]`` in ``v.dtype``; new_state ``[B, H, K, V]`` float32
      (float64 for float64 inputs).

    Raises:
      TypeError: non-floating arguments. ValueError: shapes that do not fit the layout above.
    """
    forms = check_step_inputs(q, k, v, g, beta, state)
    group = value_group(q, v)
    q, k = repeat_key_heads(q, group), repeat_key_heads(k, group)
    dt = acc_dtype(q, k, v, g, beta, state)
    qs, ks, vs, gs, bs = prepare(q, k, v, g, beta, scale, use_qk_l2norm, dt)
    S, o = _step(state.astype(dt), qs, ks, vs, gs, bs, forms.g_per_channel, forms.beta_per_channel)
    return o.astype(v.dtype), S
