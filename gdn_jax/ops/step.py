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

import functools
from typing import Optional, Tuple

import jax
import jax.numpy as jnp

from ._common import acc_dtype, check_flags, check_scale, check_step_inputs, prepare, repeat_key_heads, value_group
from .scan import _step

STEP_BACKENDS = ("auto", "scan", "pallas")


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
    backend: str = "auto",
    state_dtype=None,
) -> Tuple[jax.Array, jax.Array]:
    """One decode step of the gated delta rule (every gate form; jit-able).

    Args:
      q, k: ``[B, Hk, K]`` query and key of the new token, any float dtype.
      v: ``[B, H, V]`` value; ``o`` is returned in ``v.dtype``. H may be a multiple of Hk (grouped
        value heads: value head j reads key head ``j // (H // Hk)``, as in ``gated_delta_rule``).
      g: log decay (<= 0), ``[B, H]`` (per head) or ``[B, H, K]`` (per key channel, KDA); a
        positive entry of a concrete g is a ``ValueError`` (a traced one is not checked).
      beta: ``[B, H]`` (per head) or ``[B, H, V]`` (per value channel).
      state: ``[B, H, K, V]`` recurrent state (any float dtype; computed in float32, float64 if
        any input is float64).
      scale: query scale, ``None`` means ``K ** -0.5``.
      use_qk_l2norm: L2-normalise q and k (eps 1e-6) before the scale, as the op does.
      backend: ``"scan"`` (one step of the scan backend, plain XLA ops), ``"pallas"`` (one fused
        kernel, :mod:`gdn_jax.ops.pallas.decode`: normalisation, decay, write and read in one pass
        over the state; GPU via Triton, TPU via Mosaic (lowering checked on CPU, not run on a TPU),
        CPU in interpret mode; K and V powers of two from 16 to 256, float32 / bfloat16 / float16) or ``"auto"`` (the fused kernel on a GPU for the calls
        it takes, scan elsewhere: on an H200, B x 16 heads x 128, per step inside a jitted scan,
        the kernel took 14.6 / 23.3 / 60.1 us at B = 1 / 16 / 64 against scan's 15.2 / 39.6 / 114).
      state_dtype: dtype of the new state, float32 (default; float64 for float64 inputs) or
        bfloat16 (half the bytes per step; accumulation stays float32, the state is rounded once
        per step).

    Returns:
      ``(o, new_state)``: o ``[B, H, V]`` in ``v.dtype``; new_state ``[B, H, K, V]`` in
      ``state_dtype``.

    Differentiable in reverse mode with every backend (the Pallas step's VJP is the scan step's at
    the same inputs).

    Raises:
      TypeError: non-floating arguments, a ``scale`` that is not a real scalar, a non-bool
      ``use_qk_l2norm``. ValueError: shapes that do not fit the layout above, a non-finite
      ``scale``, a concrete g with a positive finite entry, an unknown backend or state_dtype. NotImplementedError: ``backend="pallas"`` for a
      call it does not cover (naming why).
    """
    forms = check_step_inputs(q, k, v, g, beta, state)
    check_scale(scale)
    check_flags(use_qk_l2norm=use_qk_l2norm)
    if backend not in STEP_BACKENDS:
        raise ValueError(f"backend must be one of {STEP_BACKENDS}, got {backend!r}")
    dt0 = acc_dtype(q, k, v, g, beta, state)
    try:
        sdt = jnp.dtype(dt0 if state_dtype is None else state_dtype)
    except TypeError:
        raise ValueError(f"state_dtype must be float32 or bfloat16 (float64 for float64 inputs), got "
                         f"{state_dtype!r}") from None
    if sdt not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float64)):
        raise ValueError(f"state_dtype must be float32 or bfloat16 (float64 for float64 inputs), got {sdt}")
    if backend != "scan" and q.shape[0] > 0:  # an empty batch: nothing to compute, no kernel to launch
        from .pallas import decode as _decode

        reason = _decode.covers(q.shape[-1], v.shape[-1], dt0, sdt)
        if backend == "auto":
            from .pallas.platform import default_platform

            traced = isinstance(scale, jax.core.Tracer) and use_qk_l2norm
            backend = "pallas" if reason is None and not traced and default_platform() == "gpu" else "scan"
        if backend == "pallas" and reason is not None:
            raise NotImplementedError(f"backend='pallas' (decode step) does not take {reason}; use backend='scan'")
        if backend == "pallas":
            sc = q.shape[-1] ** -0.5 if scale is None else scale
            if isinstance(sc, jax.core.Tracer):  # a traced scale: folded into q by XLA, the kernel scales by 1
                if use_qk_l2norm:
                    raise NotImplementedError("backend='pallas' (decode step) with a traced scale and "
                                              "use_qk_l2norm; use backend='scan'")
                q, sc = q.astype(jnp.float32) * sc, 1.0
            return _pallas_step(q, k, v, g, beta, state, float(sc), use_qk_l2norm, sdt, forms.g_per_channel,
                                forms.beta_per_channel)
    return _scan_step(q, k, v, g, beta, state, scale, use_qk_l2norm, sdt, forms.g_per_channel,
                      forms.beta_per_channel)


def _scan_step(q, k, v, g, beta, state, scale, use_qk_l2norm, sdt, g_pc, b_pc):
    """The step in plain XLA ops (the scan backend's step): ``(o in v.dtype, S in sdt)``."""
    group = value_group(q, v)
    q, k = repeat_key_heads(q, group), repeat_key_heads(k, group)
    dt = acc_dtype(q, k, v, g, beta, state)
    qs, ks, vs, gs, bs = prepare(q, k, v, g, beta, scale, use_qk_l2norm, dt)
    S, o = _step(state.astype(dt), qs, ks, vs, gs, bs, g_pc, b_pc)
    return o.astype(v.dtype), S.astype(sdt)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8, 9, 10))
def _pallas_step(q, k, v, g, beta, state, scale, use_qk_l2norm, sdt, g_pc, b_pc):
    """The fused Pallas step; differentiable (reverse mode) through :func:`_scan_step`'s VJP at the
    same inputs (the kernel aliases its state buffer, which Pallas cannot differentiate)."""
    from .pallas import decode as _decode

    return _decode.decode_step(q, k, v, g, beta, state, scale=scale, use_qk_l2norm=use_qk_l2norm,
                               state_dtype=sdt, g_per_channel=g_pc, beta_per_channel=b_pc)


def _pallas_step_fwd(q, k, v, g, beta, state, scale, use_qk_l2norm, sdt, g_pc, b_pc):
    out = _pallas_step(q, k, v, g, beta, state, scale, use_qk_l2norm, sdt, g_pc, b_pc)
    return out, (q, k, v, g, beta, state)


def _pallas_step_bwd(scale, use_qk_l2norm, sdt, g_pc, b_pc, res, ct):
    _, vjp = jax.vjp(lambda *a: _scan_step(*a, scale, use_qk_l2norm, sdt, g_pc, b_pc), *res)
    return vjp(ct)


_pallas_step.defvjp(_pallas_step_fwd, _pallas_step_bwd)
