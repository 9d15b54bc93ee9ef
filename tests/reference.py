"""Independent float64 reference for the gated delta rule (test-only).

Written from the operator spec only (not from ``gdn_jax.ops``). Recurrence per
(batch, head), state ``S`` in R^{K x V}, DECAY FIRST (GDN paper eq. 10, FLA,
Qwen3-Next)::

    S   = diag(exp(g_t)) S                  # g_t scalar per head, or [K] per key channel
    S   = S + k_t (beta_t * (v_t - S^T k_t))^T   # beta_t scalar per head, or [V]
    o_t = S^T (scale * q_t)                 # scale defaults to K ** -0.5

Everything runs in float64 with ``jax.numpy`` inside ``jax.enable_x64(True)``
(so the global x64 flag is never touched), with a ``lax.scan`` over tokens, so
the reference is differentiable with ``jax.grad`` in float64.

Inputs of any floating dtype (numpy or jax, bf16/fp16 included) are upcast to
float64 first, i.e. for low-precision inputs the reference runs on the ROUNDED
values. All results are returned as float64 numpy arrays.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["reference", "reference_grads", "reference_boxed", "rel_rms", "to_f64"]

L2_EPS = 1e-6


def to_f64(x):
    """numpy/jax array of any float dtype -> float64 numpy array (exact upcast)."""
    if x is None:
        return None
    return np.asarray(x).astype(np.float64)


def rel_rms(x, ref):
    """rms(x - ref) / rms(ref), computed in float64."""
    x = to_f64(x)
    ref = to_f64(ref)
    assert x.shape == ref.shape, (x.shape, ref.shape)
    den = np.sqrt(np.mean(ref**2))
    num = np.sqrt(np.mean((x - ref) ** 2))
    if den == 0.0:
        return 0.0 if num == 0.0 else float("inf")
    return float(num / den)


# ---------------------------------------------------------------------------
# core (float64, must be called inside jax.enable_x64(True))
# ---------------------------------------------------------------------------


def _l2norm(x):
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + L2_EPS)


def _one_sequence(q, k, v, g, beta, S0, *, boxed):
    """q,k [T,H,K] (q already scaled/normalised), v [T,H,V], g [T,H] or [T,H,K],
    beta [T,H] or [T,H,V], S0 [H,K,V]. Returns o [T,H,V], S_T [H,K,V]."""

    def step(S, xs):
        qt, kt, vt, gt, bt = xs
        a = jnp.exp(gt)
        a = a[:, None, None] if a.ndim == 1 else a[:, :, None]  # [H,1,1] or [H,K,1]
        b = bt[:, None] if bt.ndim == 1 else bt  # [H,1] or [H,V]
        if boxed:
            # seed's boxed formula: prediction from S_{t-1} BEFORE the decay
            pred = jnp.einsum("hkv,hk->hv", S, kt)
            S = a * S + jnp.einsum("hk,hv->hkv", kt, b * (vt - pred))
        else:
            S = a * S
            pred = jnp.einsum("hkv,hk->hv", S, kt)
            S = S + jnp.einsum("hk,hv->hkv", kt, b * (vt - pred))
        o = jnp.einsum("hkv,hk->hv", S, qt)
        return S, o

    S, o = jax.lax.scan(step, S0, (q, k, v, g, beta))
    return o, S


def _forward(q, k, v, g, beta, S0, *, scale, use_qk_l2norm, cu, boxed):
    """Full-batch float64 forward. S0 is [B,H,K,V] or [N,H,K,V] (with cu)."""
    if use_qk_l2norm:
        q = _l2norm(q)
        k = _l2norm(k)
    q = q * scale
    seq = functools.partial(_one_sequence, boxed=boxed)
    if cu is None:
        o, S = jax.vmap(seq)(q, k, v, g, beta, S0)
        return o, S
    # packed sequences (B == 1): python loop over (static) boundaries
    os, Ss = [], []
    for n in range(len(cu) - 1):
        s, e = cu[n], cu[n + 1]
        if e == s:  # empty sequence: state passes through
            Ss.append(S0[n])
            continue
        o_n, S_n = seq(q[0, s:e], k[0, s:e], v[0, s:e], g[0, s:e], beta[0, s:e], S0[n])
        os.append(o_n)
        Ss.append(S_n)
    o = jnp.concatenate(os, axis=0)[None]
    return o, jnp.stack(Ss, axis=0)


@functools.partial(jax.jit, static_argnames=("scale", "use_qk_l2norm", "cu", "boxed"))
def _forward_jit(q, k, v, g, beta, S0, *, scale, use_qk_l2norm, cu, boxed):
    return _forward(q, k, v, g, beta, S0, scale=scale, use_qk_l2norm=use_qk_l2norm, cu=cu, boxed=boxed)


@functools.partial(jax.jit, static_argnames=("scale", "use_qk_l2norm", "cu"))
def _grads_jit(q, k, v, g, beta, S0, do, dS, *, scale, use_qk_l2norm, cu):
    def loss(q, k, v, g, beta, S0):
        o, S = _forward(q, k, v, g, beta, S0, scale=scale, use_qk_l2norm=use_qk_l2norm, cu=cu, boxed=False)
        return jnp.sum(o * do) + jnp.sum(S * dS)

    return jax.grad(loss, argnums=(0, 1, 2, 3, 4, 5))(q, k, v, g, beta, S0)


def _group(q, v):
    """Grouped value heads: value heads per key head (v [B,T,H,V], q [B,T,Hk,K])."""
    assert v.shape[2] % q.shape[2] == 0, (q.shape, v.shape)
    return v.shape[2] // q.shape[2]


def _prep(q, k, v, g, beta, scale, initial_state, cu_seqlens):
    q, k, v, g, beta = (to_f64(x) for x in (q, k, v, g, beta))
    G = _group(q, v)
    # grouped value heads: value head j reads key head j // G (numpy's repeat, HF's repeat_interleave)
    q, k = np.repeat(q, G, axis=2), np.repeat(k, G, axis=2)
    B, T, H, K = q.shape
    V = v.shape[-1]
    if cu_seqlens is not None:
        cu = tuple(int(c) for c in np.asarray(cu_seqlens).reshape(-1))
        assert B == 1 and cu[0] == 0 and cu[-1] == T, (B, cu, T)
        assert all(b >= a for a, b in zip(cu[:-1], cu[1:])), cu
        N = len(cu) - 1
    else:
        cu = None
        N = B
    S0 = np.zeros((N, H, K, V)) if initial_state is None else to_f64(initial_state)
    assert S0.shape == (N, H, K, V), (S0.shape, (N, H, K, V))
    scale = float(K**-0.5) if scale is None else float(scale)
    return (q, k, v, g, beta, S0), scale, cu


def reference(q, k, v, g, beta, *, scale=None, initial_state=None, cu_seqlens=None, use_qk_l2norm=False):
    """Decay-first gated delta rule in float64. Returns (o [B,T,H,V], S [B|N,H,K,V]) numpy f64.
    q, k may have fewer heads than v (grouped value heads: value head j reads key head j // G)."""
    args, scale, cu = _prep(q, k, v, g, beta, scale, initial_state, cu_seqlens)
    with jax.enable_x64(True):
        args = [jnp.asarray(a, jnp.float64) for a in args]
        o, S = _forward_jit(*args, scale=scale, use_qk_l2norm=bool(use_qk_l2norm), cu=cu, boxed=False)
        return np.asarray(o, np.float64), np.asarray(S, np.float64)


def reference_boxed(q, k, v, g, beta, *, scale=None, initial_state=None, cu_seqlens=None, use_qk_l2norm=False):
    """The boxed variant of the source notes: S_t = a S_{t-1} + k [beta * (v - S_{t-1}^T k)]^T
    (prediction from the state BEFORE decay). Only used to show the suite can
    tell it apart from decay-first with strong gates."""
    args, scale, cu = _prep(q, k, v, g, beta, scale, initial_state, cu_seqlens)
    with jax.enable_x64(True):
        args = [jnp.asarray(a, jnp.float64) for a in args]
        o, S = _forward_jit(*args, scale=scale, use_qk_l2norm=bool(use_qk_l2norm), cu=cu, boxed=True)
        return np.asarray(o, np.float64), np.asarray(S, np.float64)


def reference_grads(
    q, k, v, g, beta, *, scale=None, initial_state=None, cu_seqlens=None, use_qk_l2norm=False, do=None, dS=None
):
    """float64 grads of  L = sum(o * do) + sum(S_final * dS)  w.r.t. q, k, v, g,
    beta, initial_state (the latter w.r.t. zeros when initial_state is None).
    ``do``/``dS`` default to zeros. Returns dict of float64 numpy arrays."""
    G = _group(np.asarray(q), np.asarray(v))
    args, scale, cu = _prep(q, k, v, g, beta, scale, initial_state, cu_seqlens)
    v64, S064 = args[2], args[5]
    do = np.zeros(v64.shape) if do is None else to_f64(do)
    dS = np.zeros(S064.shape) if dS is None else to_f64(dS)
    assert do.shape == v64.shape and dS.shape == S064.shape, (do.shape, dS.shape)
    with jax.enable_x64(True):
        args = [jnp.asarray(a, jnp.float64) for a in args]
        grads = _grads_jit(
            *args,
            jnp.asarray(do, jnp.float64),
            jnp.asarray(dS, jnp.float64),
            scale=scale,
            use_qk_l2norm=bool(use_qk_l2norm),
            cu=cu,
        )
        names = ("q", "k", "v", "g", "beta", "initial_state")
        out = {n: np.asarray(gr, np.float64) for n, gr in zip(names, grads)}
    for n in ("q", "k"):  # a key head's gradient is the sum over the value heads that read it
        B, T, H, K = out[n].shape
        out[n] = out[n].reshape(B, T, H // G, G, K).sum(3)
    return out
