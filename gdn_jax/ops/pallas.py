"""``backend="pallas"``: the chunked gated delta rule as Pallas kernels, forward and backward.

Same semantics as ``backend="chunk"`` (decay first; GDN paper §3.3, DeltaNet paper
§3): see ``chunk.py`` for the math and ``pallas_kernels.py`` for the kernels.

What runs where
---------------
Plain JAX (differentiated by autodiff): upcast / optional q,k L2 normalisation;
padding of T to a multiple of the chunk C (g = 0, beta = 0, q = k = v = 0, which
leaves the state exact); for ``cu_seqlens`` the re-layout of ``chunk.py`` that
starts every sequence on a chunk boundary; the in-chunk cumulative log decay
gamma and the factors e^gamma, e^{gamma_C - gamma}, e^{gamma_C} (TPU Pallas has
no in-kernel cumsum; the reverse cumsum of the gradient also happens here).

Pallas (one ``jax.custom_vjp``, :func:`_core2`, whose forward and backward each run
:func:`_core`'s kernels at their own chunk size -- the backward recomputes everything from
the inputs, so on GPU the forward runs at C=64 and the backward at C=32 for D <= 128; the
gamma terms of each chunking are built in plain JAX by :func:`gates` and their cotangents
pulled back to g with ``jax.vjp``): forward = intra-chunk kernel
(A, T = (I+A)^-1, W, U, Aqk) -> state pass that also writes o (fori_loop over
chunks, S on chip; no h_n in HBM). Backward = intra kernel again (W, U, and
dVl = Aqk^T dO) -> forward state pass again (h_n, Vn) -> reverse state pass (dS on
chip; dVn, dh_n, d h0) -> per-chunk gradient kernel (dq, dk, dv, dbeta, d gamma
terms). Six ``pallas_call``s for forward + backward.

Coverage (:func:`supports`): per-head g and beta, initial/final state,
``cu_seqlens``, any T, K and V multiples of 16 up to 256 (non powers of two are
zero-padded to the next power of two), chunk_size 16/32/64/128, float32 / bfloat16
/ float16 inputs with float32 accumulation. Declined with a reason:
per-key-channel g, per-value-channel beta, float64.

Precision: kernels read q, k, v, dO in the input dtype and accumulate in float32.
With bf16 inputs and max(K, V) >= 64 (:data:`BF16_MID_MIN_DIM`; smaller heads keep float32) the
intermediates written to HBM (W, U, Vn, h_n, dVl, dVn, dh_n) are
bf16 and the state/output dots take bf16 operands (rel. rms of o vs the float32 chunk
backend 3.8e-3 at the REFERENCE §5 shapes; ``Tuning(u_dtype="f32", state_dot="f32",
out_dot="f32")`` keeps U and the state dots in float32, 2.6e-3, ~5-11% slower on an
H200: Vn = U - W S is a small difference of O(|v|) terms; see ``pallas_kernels.Tuning``).
Float32 inputs keep everything float32. The in-chunk triangular inverse (float32 in every
case) is the recursive block formula (stable; the doubling product is not). e^{gamma_C - gamma} is built from a
reverse cumsum of g, not as a difference of large cumulative sums, which keeps gate
gradients accurate under very strong decay.

Platforms: see ``_pallas_platform.py`` (GPU: Triton lowering; TPU: Mosaic;
CPU: interpret mode). The TPU variant is checked by interpretation and by lowering
(``jax.export``) only; its state passes hold whole sequences in VMEM (the limit is
raised up to 100 MiB), so very long sequences need a chunk-streaming variant there.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from . import _pallas_platform as _plat
from . import pallas_kernels as _k
from ._common import L2NORM_EPS, GateForms, l2norm, seq_info
from .pallas_kernels import Tuning

__all__ = ["supports", "pallas_gated_delta_rule", "prepare", "Tuning", "tuning", "SUPPORTED_CHUNK_SIZES", "MAX_DIM"]

SUPPORTED_CHUNK_SIZES = _k.SUPPORTED_CHUNK_SIZES
MAX_DIM = 256
F32 = jnp.float32

_TUNING = Tuning()


@contextlib.contextmanager
def tuning(**kw):
    """Temporarily change kernel settings (:class:`pallas_kernels.Tuning` fields), e.g.
    ``with tuning(bv_state=64, warps_grad=4): jax.jit(f)(...)``. Settings are read when a
    function is traced, so trace (jit) inside the ``with`` -- and use a fresh function object:
    ``jax.jit`` caches traces per function and does not see these settings (nor
    ``_pallas_platform.force_platform``) as part of its key."""
    global _TUNING
    old = _TUNING
    _TUNING = dataclasses.replace(old, **kw)
    try:
        yield _TUNING
    finally:
        _TUNING = old


def supports(forms: GateForms, *, chunk_size: int, K: int, V: int, dtype) -> Optional[str]:
    """None when ``backend="pallas"`` covers a call, else the reason (names the option)."""
    if forms.beta_per_channel:
        return "does not take per-value-channel beta [B,T,H,V] (use backend='scan')"
    if forms.g_per_channel:
        return "does not take per-key-channel g [B,T,H,K] (Kimi Delta Attention; use backend='chunk')"
    if chunk_size not in SUPPORTED_CHUNK_SIZES:
        return (f"does not take chunk_size={chunk_size} (supported: {', '.join(map(str, SUPPORTED_CHUNK_SIZES))}; "
                f"backend='chunk' takes any chunk_size)")
    for name, d in (("K", K), ("V", V)):
        if d % 16 or d < 16 or d > MAX_DIM:
            return (f"does not take head dim {name}={d} (needs a multiple of 16 from 16 to {MAX_DIM}; "
                    f"use backend='chunk')")
    dt = jnp.dtype(dtype)
    if dt == jnp.float64:
        return "does not take float64 inputs (kernels accumulate in float32; use backend='chunk')"
    if dt not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return f"does not take dtype {dt}"
    return None


# ---------------------------------------------------------------------------
# the differentiable core
# ---------------------------------------------------------------------------


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _core(cfg, q, k, v, beta, gc, gr, eg, ekd, dec, h0, info):
    """Chunked gated delta rule in Pallas kernels; returns (o, final_state f32).

    Args (already laid out; see ``pallas_kernels`` for the layouts):
      q, k [.., T, .., K], v [.., T, .., V] in ``cfg.in_dt`` (q NOT scaled: ``cfg.scale``
      is applied in-kernel); beta, gc, eg, ekd [BH, T, 1] f32; gr [BH, n, 1, C] f32 (gamma
      as a row); dec [BH, n, 1, 1] f32; h0 [G, nseq, K, V] f32; info int32 chunk flags
      (``cu_seqlens`` only).

    Custom VJP: the forward saves only its inputs (q, k, v, beta, gamma and its
    exponentials, h0, flags): O(T (K + V)) per head. W, U, Vn and the per-chunk states
    h_n (n K V per head: at B4 T4096 H16 D128 that is 134 MB in bf16, 268 MB in f32) are
    recomputed in the backward, which costs one intra-chunk kernel and one state pass of
    matmul work (cheap next to the gradient kernels) instead of that memory.
    """
    o, fin, _ = _core_fwd_impl(cfg, q, k, v, beta, gc, gr, eg, ekd, dec, h0, info)
    return o, fin


def _has_chunks(cfg, info):
    """[nseq] bool: sequence has at least one chunk (empty sequences pass h0 through)."""
    first = (info & 1) != 0
    return jnp.zeros((cfg.nseq,), jnp.int32).at[info >> 2].max(first.astype(jnp.int32)) > 0


def _core_fwd_impl(cfg, q, k, v, beta, gc, gr, eg, ekd, dec, h0, info):
    if cfg.tuning.fuse_output:
        w, u, aqk = _k.intra(cfg, k, v, beta, gc, gr, eg, q=q)
        o, fin = _k.state_out(cfg, w, u, k, ekd, dec, h0, info, q, eg, aqk)
    else:
        w, u = _k.intra(cfg, k, v, beta, gc, gr, eg)
        vn, h, fin = _k.state_fwd(cfg, w, u, k, ekd, dec, h0, info)
        o = _k.output(cfg, q, k, gc, gr, eg, h, vn)
    if cfg.packed:
        fin = jnp.where(_has_chunks(cfg, info)[None, :, None, None], fin, h0)
    return o, fin, None


def _core_fwd(cfg, q, k, v, beta, gc, gr, eg, ekd, dec, h0, info):
    o, fin, _ = _core_fwd_impl(cfg, q, k, v, beta, gc, gr, eg, ekd, dec, h0, info)
    return (o, fin), (q, k, v, beta, gc, gr, eg, ekd, dec, h0, info)


def _core_bwd(cfg, res, cts):
    q, k, v, beta, gc, gr, eg, ekd, dec, h0, info = res
    do, dfin = cts
    do = do.astype(cfg.in_dt)
    dfin = dfin.astype(F32)
    w, u, dvl, *t = _k.intra(cfg, k, v, beta, gc, gr, eg, q=q, do=do)
    if cfg.merge_state:
        vn, h, dh, dvn, dh0 = _k.state_both(cfg, w, u, k, ekd, dec, h0, q, dvl, do, eg, dfin, info)
    else:
        vn, h, _ = _k.state_fwd(cfg, w, u, k, ekd, dec, h0, info)
        dh, dvn, dh0 = _k.state_bwd(cfg, q, k, w, dvl, do, eg, ekd, dec, dfin, info)
    dq, dk, dv, dbeta, dgc, dgr, deg, dekd, ddec = _k.grads(cfg, q, k, v, do, beta, gc, gr, eg, ekd, h, dh, vn,
                                                            dvn, *t)
    if cfg.packed:
        dh0 = jnp.where(_has_chunks(cfg, info)[None, :, None, None], dh0, dfin)
    return dq, dk, dv, dbeta, dgc, dgr, deg, dekd, ddec, dh0, None


_core.defvjp(_core_fwd, _core_bwd)


def gates(cfg, bhm, ghm):
    """Per-token kernel scalars of a chunking (plain JAX; differentiable): beta column, gamma
    column, gamma row, e^gamma, e^{gamma_C - gamma}, e^{gamma_C} (see :func:`_core`), from
    head-major beta and log decay g [BH, Tp] f32."""
    BH, n, C = cfg.BH, cfg.n, cfg.C
    gh = ghm.reshape(BH, n, C)
    gam = jnp.cumsum(gh, axis=-1)  # in-chunk cumulative log decay gamma
    gc = gam.reshape(BH, n * C, 1)
    gr = gam.reshape(BH, n, 1, C)
    eg = jnp.exp(gc)
    # gamma_C - gamma_i = sum_{j>i} g_j, summed directly (a reverse cumsum of g shifted by one)
    # rather than as a difference of two large cumulative sums (|gamma| reaches thousands under
    # strong decay, and f32 differences of such numbers lose ~1e-4 absolute).
    gnext = jnp.concatenate([gh[..., 1:], jnp.zeros_like(gh[..., :1])], axis=-1)
    ekd = jnp.exp(jnp.flip(jnp.cumsum(jnp.flip(gnext, -1), axis=-1), -1)).reshape(BH, n * C, 1)
    dec = jnp.exp(gam[..., -1:]).reshape(BH, n, 1, 1)
    return bhm.reshape(BH, n * C, 1), gc, gr, eg, ekd, dec


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _core2(cfgs, q, k, v, bhm, ghm, h0, info_f, info_b):
    """:func:`_core` with the forward and the backward at their own chunk sizes: ``cfgs`` =
    (forward Cfg, backward Cfg); beta and g head-major [BH, Tp] f32; ``info_f`` / ``info_b``
    the chunk flags of each chunking. The gamma terms of each chunking are plain JAX
    (:func:`gates`); the backward pulls their cotangents back to g with ``jax.vjp``. Saves
    only the inputs, like :func:`_core`."""
    return _core2_fwd(cfgs, q, k, v, bhm, ghm, h0, info_f, info_b)[0]


def _core2_fwd(cfgs, q, k, v, bhm, ghm, h0, info_f, info_b):
    o, fin, _ = _core_fwd_impl(cfgs[0], q, k, v, *gates(cfgs[0], bhm, ghm), h0, info_f)
    return (o, fin), (q, k, v, bhm, ghm, h0, info_f, info_b)


def _core2_bwd(cfgs, res, cts):
    q, k, v, bhm, ghm, h0, info_f, info_b = res
    cb = cfgs[1]
    gts, gvjp = jax.vjp(lambda b, g: gates(cb, b, g), bhm, ghm)
    dq, dk, dv, *dgts, dh0, _ = _core_bwd(cb, (q, k, v, *gts, h0, info_b), cts)
    dbhm, dghm = gvjp(tuple(dgts))
    return dq, dk, dv, dbhm, dghm, dh0, None, None


_core2.defvjp(_core2_fwd, _core2_bwd)


# ---------------------------------------------------------------------------
# public entry point
# ---------------------------------------------------------------------------


def _pow2(d):
    return 1 << (int(d) - 1).bit_length()


def _in_dtype(*xs):
    dts = {jnp.dtype(x.dtype) for x in xs}
    if len(dts) == 1:
        (dt,) = dts
        if dt in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32)):
            return dt
    return jnp.dtype(F32)


def _static_scale(scale, K):
    """(static float folded into the kernels, or None when scale is traced)."""
    if scale is None:
        return float(K) ** -0.5
    if isinstance(scale, jax.core.Tracer):
        return None
    return float(np.asarray(scale))


def pallas_gated_delta_rule(q, k, v, g, beta, *, scale, initial_state, cu_seqlens, use_qk_l2norm, chunk_size,
                            forms):
    """The ``backend="pallas"`` implementation behind ``gated_delta_rule`` (which validates
    arguments and calls :func:`supports` first).

    Returns (o [B,T,H,V] in the inputs' dtype (float32 for mixed dtypes), final_state
    [B,H,K,V] or [N,H,K,V] float32, valid: bool scalar, False for a malformed traced
    ``cu_seqlens``).
    """
    reason = supports(forms, chunk_size=chunk_size, K=q.shape[-1], V=v.shape[-1], dtype=v.dtype)
    if reason is not None:
        raise NotImplementedError(f"backend='pallas' {reason}")
    prep = prepare(q, k, v, g, beta, scale=scale, initial_state=initial_state, cu_seqlens=cu_seqlens,
                   use_qk_l2norm=use_qk_l2norm, chunk_size=chunk_size)
    o, fin = _core2((prep.cfg, prep.cfg_bwd), *prep.args)
    o, fin = prep.finish(o, fin)
    return o, fin, prep.valid


@dataclasses.dataclass
class Prepared:
    """Kernel-ready inputs of one call: ``cfg`` / ``cfg_bwd`` (static; the forward's and the
    backward's chunking), ``args`` for :func:`_core2` (q, k, v, head-major beta and g, h0,
    the chunk flags of each chunking), ``valid`` and ``finish(o, fin)`` mapping the core's
    outputs back to [B,T,H,V] / [B|N,H,K,V]. (Also used by benchmarks/bench_pallas.py to time
    kernels: :meth:`kernel_args`.)"""

    cfg: _k.Cfg
    cfg_bwd: _k.Cfg
    args: tuple
    valid: jax.Array
    finish: object

    def kernel_args(self, which="fwd"):
        """(cfg, (q, k, v, beta col, gamma col, gamma row, e^gamma, e^{gamma_C-gamma},
        e^{gamma_C}, h0, flags)) of the forward or the backward chunking, as :func:`_core` takes."""
        cfg = self.cfg if which == "fwd" else self.cfg_bwd
        q, k, v, bhm, ghm, h0, info_f, info_b = self.args
        return cfg, (q, k, v, *gates(cfg, bhm, ghm), h0, info_f if which == "fwd" else info_b)


# Smallest max(K, V) at which bf16 inputs get bf16 intermediates ("auto" mid_dtype). Below it the
# bf16 rounding of W, U, Vn and the state dots is not averaged over enough channels: measured on CPU
# (interpret, B2 T200 H2, chunk 64, vs the float64 reference) at g = 0, beta = 1.9, K = V = 16 /
# 32: o 1.2e-2 / 9.2e-3, dg 2.7e-2 with bf16 intermediates, 1.7e-3 with float32 ones. Small head
# dims are cheap either way (the kernels are bound by reading q, k, v there).
BF16_MID_MIN_DIM = 64


def auto_mid_dtype(in_dt, K: int, V: int):
    """The intermediates' dtype of ``Tuning(mid_dtype="auto")``: bfloat16 for bfloat16 inputs
    with max(K, V) >= :data:`BF16_MID_MIN_DIM`, else float32."""
    if jnp.dtype(in_dt) == jnp.bfloat16 and max(K, V) >= BF16_MID_MIN_DIM:
        return jnp.bfloat16
    return F32


def _split_flags(info, r):
    """Chunk flags (seq id * 4 + first + 2 * last) of a chunking split r ways: seq ids repeat,
    ``first`` stays on the first piece, ``last`` on the last."""
    if r == 1:
        return info
    sub = jnp.arange(r, dtype=jnp.int32)[None, :]
    i = info[:, None]
    out = (i >> 2) * 4 + (i & 1) * (sub == 0) + (i & 2) * (sub == r - 1)
    return out.reshape(-1).astype(jnp.int32)


def prepare(q, k, v, g, beta, *, scale=None, initial_state=None, cu_seqlens=None, use_qk_l2norm=False,
            chunk_size=64) -> Prepared:
    """Plain-JAX preprocessing (differentiable): normalisation, padding / packing re-layout,
    head-major per-token scalars, gamma and its exponentials."""
    p = _plat.platform()
    if p == "gpu":
        _plat.silence_triton_deprecation_at_lowering()
    B, T, H, K0 = q.shape
    V0 = v.shape[-1]
    tun = _TUNING
    in_dt = _in_dtype(q, k, v)
    # backward chunk (GPU: at most 32, see _pallas_platform.MAX_KERNEL_CHUNK) and forward chunk
    Cb = _plat.kernel_chunk(p, chunk_size, max(K0, V0), "bwd")
    # the forward's own cap was measured with 16-bit inputs; float32 (3-pass TF32 dots on GPU) keeps
    # the backward's chunk
    fdir = "bwd" if in_dt == jnp.dtype(F32) else "fwd"
    Cf = tun.fwd_chunk if tun.fwd_chunk is not None else _plat.kernel_chunk(p, chunk_size, max(K0, V0), fdir)
    C = max(Cf, Cb)  # the time layout is built for the larger chunk (the smaller one divides it)
    if tun.mid_dtype == "auto":
        mid_dt = jnp.dtype(auto_mid_dtype(in_dt, K0, V0))
    else:
        mid_dt = jnp.dtype({"f32": F32, "bf16": jnp.bfloat16}[tun.mid_dtype])

    # --- q, k, v: normalise / scale in plain JAX only where needed; kernels read in_dt.
    if use_qk_l2norm:
        q = l2norm(q.astype(F32), L2NORM_EPS)
        k = l2norm(k.astype(F32), L2NORM_EPS)
    sc = _static_scale(scale, K0)
    if sc is None:  # traced scale: apply outside, in f32
        q = q.astype(F32) * jnp.asarray(scale, F32)
        sc = 1.0
    q, k, v = (x.astype(in_dt) for x in (q, k, v))
    g = g.astype(F32)
    beta = beta.astype(F32)

    # --- head dims: zero-pad to a power of two (exact: zero channels never mix in)
    K, V = max(16, _pow2(K0)), max(16, _pow2(V0))
    if K != K0:
        q, k = (jnp.pad(x, [(0, 0)] * 3 + [(0, K - K0)]) for x in (q, k))
    if V != V0:
        v = jnp.pad(v, [(0, 0)] * 3 + [(0, V - V0)])

    # --- time layout: pad / re-lay packed sequences onto chunk boundaries
    packed = cu_seqlens is not None
    valid = jnp.asarray(True)
    if packed:
        from .chunk import _chunk_layout

        N = cu_seqlens.shape[0] - 1
        valid = seq_info(cu_seqlens, T)[3]
        Tp, pos, cseq, cfirst, clast = _chunk_layout(cu_seqlens, T, C)
        scat = lambda x: jnp.zeros((B, Tp) + x.shape[2:], x.dtype).at[:, pos].set(x)
        q, k, v, g, beta = map(scat, (q, k, v, g, beta))
        info = (cseq * 4 + cfirst.astype(jnp.int32) + 2 * clast.astype(jnp.int32)).astype(jnp.int32)
        nseq = N
    else:
        Tp = -(-T // C) * C
        if Tp != T:
            padt = lambda x: jnp.pad(x, [(0, 0), (0, Tp - T)] + [(0, 0)] * (x.ndim - 2))
            q, k, v, g, beta = map(padt, (q, k, v, g, beta))
        info = jnp.zeros((1,), jnp.int32)
        nseq = 1
    BH = B * H
    layout = "hm" if _plat.is_tpu_layout(p) else "bthd"
    hm = lambda x: jnp.moveaxis(x, 2, 1).reshape(BH, Tp)  # [B,Tp,H] -> [BH,Tp]
    ghm, bhm = hm(g), hm(beta)  # per-token scalars, head-major (tiny arrays; XLA)
    info_f, info_b = (_split_flags(info, C // Cf), _split_flags(info, C // Cb)) if packed else (info, info)

    if layout == "hm":
        tok = lambda x: jnp.moveaxis(x, 2, 1).reshape(BH, Tp, x.shape[-1])
        q, k, v = map(tok, (q, k, v))

    # --- states: [G, nseq, K, V] with G the kernel's bh axis
    if initial_state is None:
        h0 = jnp.zeros((BH, 1, K, V) if not packed else (H, N, K, V), F32)
    else:
        h0 = initial_state.astype(F32)
        if K != K0 or V != V0:
            h0 = jnp.pad(h0, [(0, 0), (0, 0), (0, K - K0), (0, V - V0)])
        h0 = h0.reshape(BH, 1, K, V) if not packed else jnp.swapaxes(h0, 0, 1)

    mk = lambda c: _k.Cfg(p=p, layout=layout, BH=BH, H=H, n=Tp // c, C=c, K=K, V=V, scale=float(sc),
                          in_dt=in_dt.name, mid_dt=mid_dt.name, packed=packed, nseq=nseq, tuning=tun)
    cfg, cfg_b = mk(Cf), mk(Cb)

    def finish(o, fin):
        if layout == "hm":
            o = jnp.moveaxis(o.reshape(B, H, Tp, V), 1, 2)
        o = o[:, pos] if packed else o[:, :T]
        if V != V0:
            o = o[..., :V0]
        fin = fin.reshape(B, H, K, V) if not packed else jnp.swapaxes(fin, 0, 1)
        if K != K0 or V != V0:
            fin = fin[:, :, :K0, :V0]
        return o, fin

    return Prepared(cfg, cfg_b, (q, k, v, bhm, ghm, h0, info_f, info_b), valid, finish)
