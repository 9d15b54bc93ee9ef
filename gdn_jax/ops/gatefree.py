"""The gate-free form of the chunked gated delta rule in plain JAX (XLA): the inverse T0, the
decay mask D and a forward that applies the decay as an elementwise mask, T = T0 * D.

Within a chunk of C tokens (REFERENCE §2 and §10), with gamma the in-chunk cumulative log decay
(one decay per head), E = diag(e^gamma) and D_ij = e^{gamma_i - gamma_j} for i >= j, 0 above::

    A0 = strictly_lower(diag(beta) K K^T)          no decay
    A  = A0 * D = E A0 E^-1                        the gated matrix of backend="chunk"
    T  = (I + A)^-1 = E (I + A0)^-1 E^-1 = T0 * D  T0 = (I + A0)^-1 depends on k and beta only

so the forward of :func:`gdn_jax.ops.chunk.chunk_forward` can be written with T0 and masks whose
every factor is <= 1 (what a fused state-pass kernel does in its chunk loop), per chunk with S
the state entering it and q already scaled::

    v_new = (T0 * D) diag(beta) (V - E K S)        = U - W S of the WY form
    o     = E Q S + P v_new,   P = (Q K^T) * D
    S    <- e^{gamma_C} S + (e^{gamma_C - gamma} K)^T v_new

:func:`gatefree_chunk_forward` is that forward (a ``lax.scan`` over chunks, T0 computed once per
chunk beforehand or taken from :func:`gdn_jax.ops.pallas.inverse_gatefree.gatefree_inverse`); it
documents the algebra the fused kernel follows and is tested against the float64 reference.
T0 is bounded only for unit-norm keys and beta in [0, 2] (see
:func:`gdn_jax.ops.pallas.inverse_gatefree.gatefree_covers`); the identity itself is exact for
any keys.

Source: REFERENCE §10 (the fastest Hopper implementations' gate-free inverse and fused
forward); GDN paper §3.3 and DeltaNet paper §3 for the chunked form.
"""
from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from ._common import (acc_dtype, check_flags, check_inputs, clamp_log_decay, finish_outputs, prepare,
                      repeat_key_heads, value_group)
from .chunk import decay_factors, from_chunks, mm, to_chunks, unit_lower_inverse
from .packing import chunk_resets, n_seq, scan_with_resets

__all__ = ["gatefree_t0", "decay_mask", "gatefree_chunk_forward", "gatefree_gated_delta_rule"]


def _mask(gam):
    """D [..., C, C] from in-chunk cumulative log decays gam [..., C]: e^{gam_i - gam_j} below the
    diagonal (exponent masked BEFORE the exp), the constant 1 on it, 0 above."""
    C = gam.shape[-1]
    i = jnp.arange(C)[:, None]
    j = jnp.arange(C)[None, :]
    strict = i > j
    diff = gam[..., :, None] - gam[..., None, :]
    return jnp.where(strict, jnp.exp(jnp.where(strict, diff, 0.0)), jnp.eye(C, dtype=gam.dtype))


def _t0_chunks(kc, bc):
    """T0 [..., C, C] from chunked keys kc [..., C, K] and beta bc [..., C] (plain JAX)."""
    C = kc.shape[-2]
    strict = jnp.arange(C)[:, None] > jnp.arange(C)[None, :]
    A0 = jnp.where(strict, bc[..., :, None] * mm(kc, jnp.swapaxes(kc, -1, -2)), 0.0)
    return unit_lower_inverse(A0)


def _check_kb(k, beta):
    for name, x in (("k", k), ("beta", beta)):
        if not hasattr(x, "shape") or not hasattr(x, "dtype") or not jnp.issubdtype(x.dtype, jnp.floating):
            raise TypeError(f"{name} must be a floating array, got {type(x).__name__} {getattr(x, 'dtype', '')}")
    if k.ndim != 4:
        raise ValueError(f"k must have shape [B, T, Hk, K] (rank 4), got shape {tuple(k.shape)}")
    if beta.ndim != 3 or tuple(beta.shape[:2]) != tuple(k.shape[:2]) or beta.shape[2] % k.shape[2]:
        raise ValueError(f"beta must have shape [B, T, H] with (B, T) = {tuple(k.shape[:2])} of k and H a multiple "
                         f"of k's {k.shape[2]} heads, got shape {tuple(beta.shape)}")


def gatefree_t0(k, beta, *, chunk_size: int = 64, cu_seqlens=None):
    """T0 = (I + strictly_lower(diag(beta) K K^T))^-1 of every chunk, in plain JAX.

    Args:
      k: [B, T, Hk, K]; beta: [B, T, H] (H a multiple of Hk: value head h reads key head
        h // (H // Hk)); computed in their promoted dtype (float32, or float64 under x64).
      chunk_size: C, a positive int (16 * 2^m uses blocked substitution, see
        :func:`gdn_jax.ops.chunk.unit_lower_inverse`).
      cu_seqlens: packed-sequence boundaries [N + 1] (B = 1) or None: chunks as laid out by
        :func:`gdn_jax.ops.packing.to_chunk_layout` (every sequence on chunk boundaries).

    Returns: T0 [B, H, NT, C, C] (the layout of
      :func:`gdn_jax.ops.pallas.inverse_gatefree.gatefree_inverse`).

    Raises: TypeError for non-floating arrays, ValueError for shapes off the layout above.
    """
    _check_kb(k, beta)
    dt = jnp.promote_types(jnp.promote_types(k.dtype, beta.dtype), jnp.float32)
    k = repeat_key_heads(k.astype(dt), beta.shape[2] // k.shape[2])
    (kc, bc), _, _, _ = to_chunks((k, beta.astype(dt)), cu_seqlens, int(chunk_size))
    return _t0_chunks(kc, bc)


def decay_mask(g, *, chunk_size: int = 64, cu_seqlens=None):
    """D [B, H, NT, C, C], D_ij = exp(gamma_i - gamma_j) for i >= j (1 on the diagonal), 0 above,
    with gamma the in-chunk cumulative sum of the per-head log decay g [B, T, H] (chunks as in
    :func:`gatefree_t0`). Every entry is in [0, 1] for g <= 0. Raises ValueError unless g has
    rank 3."""
    if not hasattr(g, "ndim") or g.ndim != 3:
        raise ValueError(f"g must have shape [B, T, H] (one decay per head), got shape {getattr(g, 'shape', g)}")
    (gc,), _, _, _ = to_chunks((g,), cu_seqlens, int(chunk_size))
    return _mask(jnp.cumsum(gc, axis=3))


def gatefree_chunk_forward(q, k, v, g, beta, initial_state, cu_seqlens, *, chunk_size: int, t0=None):
    """The chunked forward in the gate-free form (module docstring): v_new = (T0 * D) diag(beta)
    (V - E K S), o = E Q S + ((Q K^T) * D) v_new, S <- e^{gamma_C} S + (e^{gamma_C - gamma} K)^T
    v_new, one ``lax.scan`` step per chunk.

    Args: as :func:`gdn_jax.ops.chunk.chunk_forward` with per-head g and beta: q, k [B, T, H, K]
      (q scaled, heads already repeated to the value heads), v [B, T, H, V], g, beta [B, T, H],
      all in the accumulation dtype; initial_state [B | N, H, K, V] or None; ``t0`` [B, H, NT, C, C]
      (e.g. from the Pallas kernel on the same chunking) or None to compute it here.

    Returns: (o [B, T, H, V], final_state [B | N, H, K, V], valid flag of ``cu_seqlens``).
    """
    B, T, H, K = q.shape
    V = v.shape[-1]
    C = int(chunk_size)
    dt = q.dtype
    (qc, kc, vc, gc, bc), _, packing, valid = to_chunks((q, k, v, g, beta), cu_seqlens, C)
    gam, eg, ekd, dec = decay_factors(gc, False)
    if t0 is None:
        t0 = _t0_chunks(kc, bc)
    elif tuple(t0.shape) != tuple(kc.shape[:3]) + (C, C):
        raise ValueError(f"t0 must have shape [B, H, NT, C, C] = {tuple(kc.shape[:3]) + (C, C)}, got {tuple(t0.shape)}")
    t0 = t0.astype(dt)

    tm = lambda x: jnp.moveaxis(x, 2, 0)  # chunk axis first for the scan
    xs = tuple(map(tm, (qc, kc, vc, bc[..., None], gam, eg, ekd, dec, t0)))

    def chunk_step(S, x):
        q, k, v, b, gam, eg, ekd, dec, t0 = x
        D = _mask(gam)  # every factor <= 1: strong gates cannot overflow
        vn = mm(t0 * D, b * (v - eg * mm(k, S)))
        o = mm(q * eg, S) + mm(mm(q, jnp.swapaxes(k, -1, -2)) * D, vn)
        S = dec * S + mm(jnp.swapaxes(k * ekd, -1, -2), vn)
        return S, o

    fin, o = scan_with_resets(chunk_step, xs, initial_state, state_shape=(B, H, K, V), dtype=dt,
                              resets=chunk_resets(packing), n_seq=n_seq(cu_seqlens))
    return from_chunks(jnp.moveaxis(o, 0, 2), T, packing), fin, valid


def gatefree_gated_delta_rule(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state: bool = False,
                              cu_seqlens=None, use_qk_l2norm: bool = False, chunk_size: int = 64, t0=None):
    """``gated_delta_rule`` (decay first, REFERENCE §1) through :func:`gatefree_chunk_forward`:
    plain JAX, differentiable by autodiff, a reference of the gate-free algebra (not a backend).

    Args: as :func:`gdn_jax.ops.gated_delta_rule`: q, k [B, T, Hk, K], v [B, T, H, V], g and beta
      [B, T, H] (per head only), initial_state, output_final_state, cu_seqlens, use_qk_l2norm,
      chunk_size (any positive int); ``t0``: a precomputed T0 [B, H, NT, C, C] of the keys as the
      op uses them (normalised where ``use_qk_l2norm``), or None.

    Returns: (o [B, T, H, V] in v's dtype, final_state [B | N, H, K, V] or None).

    Raises: the op's TypeError / ValueError for arguments off its layout (:func:`gdn_jax.ops.
      _common.check_inputs`), NotImplementedError for per-key-channel g or per-value-channel beta
      (T0 * D needs one decay and one beta per head), ValueError for a ``t0`` of the wrong shape.
    """
    check_flags(use_qk_l2norm=use_qk_l2norm, output_final_state=output_final_state)
    forms = check_inputs(q, k, v, g, beta, initial_state, cu_seqlens, chunk_size, scale)
    if forms.g_per_channel or forms.beta_per_channel:
        raise NotImplementedError("the gate-free form needs per-head g and beta [B, T, H]: a per-key-channel decay "
                                  "does not factor out of A, a per-value-channel beta needs one inverse per column")
    if cu_seqlens is not None:
        cu_seqlens = jnp.asarray(cu_seqlens)
    dt = acc_dtype(q, k, v, g, beta, initial_state)
    group = value_group(q, v)
    q, k = repeat_key_heads(q, group), repeat_key_heads(k, group)
    g = clamp_log_decay(g, dt)
    qs, ks, vs, gs, bs = prepare(q, k, v, g, beta, scale, use_qk_l2norm, dt)
    h0 = None if initial_state is None else initial_state.astype(dt)
    o, fin, valid = gatefree_chunk_forward(qs, ks, vs, gs, bs, h0, cu_seqlens, chunk_size=chunk_size, t0=t0)
    return finish_outputs(o, fin, v.dtype, guard_finish=None, valid=valid, packed=cu_seqlens is not None,
                          output_final_state=output_final_state)
