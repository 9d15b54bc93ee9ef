"""Pallas kernels of the chunked gated delta rule (``backend="pallas"``).

Math: the WY/UT chunked form of DeltaNet (Yang et al. 2024, §3) with the gate of
Gated DeltaNet (Yang, Kautz & Hatamizadeh, ICLR 2025, §3.3); see ``chunk.py``
for the pure-JAX version these kernels mirror. Per (batch*head, chunk of C
tokens), with gamma the in-chunk cumulative log decay, q already multiplied by
``scale``::

    Gamma_ij = exp(gamma_i - gamma_j) (i >= j; exponent masked BEFORE exp), else 0
    A   = strictly_lower((beta K) K^T * Gamma);   T = (I + A)^-1
    W   = T ((beta K) * e^gamma);                 U = T (beta V)
    with S the state entering the chunk:
    Vn  = U - W S
    O   = (Q * e^gamma) S + tril(Q K^T * Gamma) Vn
    S'  = e^{gamma_C} S + (K * e^{gamma_C - gamma})^T Vn

Kernels (all ``pl.pallas_call`` with a grid and BlockSpecs; fp32 accumulation):

* :func:`intra` — grid (B*H, chunks): A, T, W, U; in the forward also
  Aqk = tril(Q K^T * Gamma), in the backward instead ``dVl = Aqk^T dO``.
* :func:`state_out` (forward, default) — grid (B*H, V/BV): ``fori_loop`` over
  chunks with S[K, BV] held on chip; per chunk Vn = U - W S, o = (Q e^gamma) S +
  Aqk Vn, S <- e^{gamma_C} S + Kd^T Vn; writes o and the final state only.
* :func:`state_fwd` (backward recompute; forward with ``fuse_output=False``) —
  same loop, writes Vn and the entering states h_n instead of o.
* :func:`output` (``fuse_output=False`` only) — grid (B*H, chunks, V/BV):
  O = (Q e^gamma) h_n + tril(Q K^T Gamma) Vn.
* :func:`state_bwd` — grid (B*H, V/BV): reverse ``fori_loop`` with dS[K, BV] on
  chip: dVn = dVl + Kd dS'; dS = e^{gamma_C} dS' + (Q e^gamma)^T dO - W^T dVn;
  writes dVn, dh_n (gradient w.r.t. the state leaving each chunk) and d h0.
* :func:`grads` — grid (B*H, chunks): recomputes A, T, Aqk and produces dq, dk,
  dv, dbeta and the gradients w.r.t. gamma (as row/column sums of the decay-matrix
  terms) and w.r.t. e^gamma, e^{gamma_C-gamma}, e^{gamma_C}; the chain rule from
  those to g runs outside in plain JAX.

The triangular inverse uses the recursive block formula: with T_s the inverse of
the block-diagonal part of I + A in blocks of s (T_1 = I),
``T_2s = T_s - T_s L_s T_s`` where L_s keeps the entries of A in the sub-diagonal
s-blocks of each 2s-block. 2 log2(C) - 2 matmuls of C x C, matmul only, and
numerically as stable as forward substitution. (The "doubling product"
(I+A)^-1 = prod_k (I + (-A)^(2^k)) uses as many matmuls but sums a Neumann series
with huge cancelling terms: measured 6e2 relative error at C=64 in *float64-exact
float32* arithmetic for weakly gated, correlated keys; the recursive form stays
at 3e-7.)

Layouts: token arrays (q, k, v, o, do, dq, dk, dv) are read in the caller's
layout: ``"bthd"`` = [B, T, H, D] with the head axis squeezed out of the block
(GPU / CPU interpret; no transposes in HBM) or ``"hm"`` = head-major [B*H, T, D]
(TPU, where a block must have its last two dims divisible by (8, 128) or equal
to the array's). Internal arrays are head-major: W [BH,T,K], U/Vn/dVl/dVn
[BH,T,V], h/dh [BH,n,K,V]; per-token scalars as columns [BH,T,1] and gamma also
as a row [BH,n,1,C]; per-chunk e^{gamma_C} as [BH,n,1,1].
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from . import _pallas_platform as _plat

F32 = jnp.float32
SUPPORTED_CHUNK_SIZES = (16, 32, 64, 128)  # chunk sizes the kernels take (forward and backward)


@dataclasses.dataclass(frozen=True)
class Tuning:
    """Kernel settings that do not change results beyond rounding.

    ``bv_state``/``bv_out``/``bv_grad``: value-channel block of the state passes, of the
    output kernel and of the V loop inside the gradient kernel (None: automatic).
    ``warps_*``: Triton ``num_warps`` per kernel; ``num_stages``: Triton pipelining depth.
    ``gpu_f32_inv``/``gpu_f32_mm``: Triton precision of f32 x f32 dots (inverse / others):
    "tf32", "tf32x3" or "ieee"; None: "tf32" when intermediates are bf16, else "tf32x3".
    ``mid_dtype``: dtype of intermediates written to HBM (W, Vn, h, dVl, dVn, dh) and of
    the operands of most in-kernel dots: "auto" (bf16 for bf16 inputs with max(K, V) >= 64,
    else f32: ``pallas.auto_mid_dtype``), "f32"
    or "bf16". ``u_dtype``: dtype of U in HBM ("f32" or "mid"). ``state_dot`` /
    ``out_dot``: operand dtype of the dots of the two state passes / of the output kernel
    ("f32": TF32-class on GPU, no rounding of S, Vn, h to bf16 before the dot; "mid").
    Defaults "mid" (with bf16 inputs: bf16 U and bf16 operands for the state/output dots,
    f32 accumulation; with f32 inputs nothing changes). On an H200 (2026-11-30) "mid" made
    fwd+bwd 5-11% faster at every REFERENCE §5 shape (B1 T16384 H16 D128 5.85 -> 5.21 ms,
    D=256 6.93 -> 6.18 ms) for rel. rms of o vs the f32 chunk backend 3.8e-3 instead of
    2.6e-3 (FLA's bf16 o differs from ours by 4.2e-3); the gradients barely move (dq 3.2 ->
    3.5e-3, dg 2.3 -> 2.8e-3). "f32" keeps U and S wider where U = W S + Vn cancels (Vn is a
    small residual of two O(|v|) terms): rel. rms of o 2.8e-3 vs 4.2e-3, final state 0.9e-3 vs
    3.5e-3 at T=300, weak gates, D=128, against the all-bf16 variant.
    ``fuse_output``: forward as intra (W, U, Aqk) + a state pass that also writes o (saves
    the h_n and Vn round trips: ~0.4 GB at B4 T4096 H16 D128) instead of intra + state pass
    + output kernel. ``save_t``: the backward intra kernel writes T = (I+A)^-1 (f32, C^2 per
    chunk: 67 MB at B4 T4096 H16 C64) for the gradient kernel instead of a second inverse
    (2 log2(C) - 2 C^3 matmuls per chunk, ~20% of that kernel's FLOPs); None: on for the
    whole-K gradient kernel, off for the K-split one (see ``Cfg.save_t``). ``fwd_chunk``: chunk
    of the forward kernels (None: ``_pallas_platform.FWD_MAX_KERNEL_CHUNK``); the backward runs
    at the chunk of ``_pallas_platform.MAX_KERNEL_CHUNK`` and recomputes what it needs from the
    inputs, so the two may differ (one must divide the other). ``merge_state``
    (GPU / CPU interpret; ignored on TPU): run the two backward state passes (forward
    recompute and reverse), which are independent, in one launch with twice the programs;
    None: on GPU when the state passes have at most 128 programs (B*H*V/bv_state; an H200 has
    132 SMs), else off (B1 T16384 H16 D128, 128 programs: fwd+bwd 5.85 -> 5.11 ms merged;
    B4 T4096 H16 D128, 256 programs: 3.89 -> 3.96 ms).
    ``bk_grad``: key-channel block of the gradient kernel (None: K up to K = 128, 128 above,
    on GPU / CPU interpret; K on TPU). Below K the gradient kernel runs on the grid
    (B*H, chunks, K/bk_grad): each program reads only its K rows of h_n and dh_n and holds
    [C, bk] accumulators (at D = 256 the whole-K kernel spills registers at C = 32: B2 T8192 H8
    on an H200, backward ~20 ms with it, 5.1 ms split in two K blocks); the C x C terms are recomputed per program and the per-token scalar
    gradients are summed over the K blocks outside. ``num_stages`` None: 2.
    """

    bv_state: Optional[int] = None
    bv_out: Optional[int] = None
    bv_grad: Optional[int] = None
    bk_grad: Optional[int] = None
    warps_intra: int = 4
    warps_state: int = 4
    warps_out: int = 4
    warps_grad: Optional[int] = None
    num_stages: Optional[int] = None
    gpu_f32_inv: Optional[str] = None
    gpu_f32_mm: Optional[str] = None
    mid_dtype: str = "auto"
    u_dtype: str = "mid"
    state_dot: str = "mid"
    out_dot: str = "mid"
    fuse_output: bool = True
    save_t: Optional[bool] = None
    merge_state: Optional[bool] = None
    fwd_chunk: Optional[int] = None

    def __post_init__(self):
        """Reject bad settings when they are made (``tuning(...)``), not deep inside a trace."""
        choices = {"mid_dtype": ("auto", "f32", "bf16"), "u_dtype": ("f32", "mid"), "state_dot": ("f32", "mid"),
                   "out_dot": ("f32", "mid"), "gpu_f32_inv": (None, "tf32", "tf32x3", "ieee"),
                   "gpu_f32_mm": (None, "tf32", "tf32x3", "ieee")}
        for name, ok in choices.items():
            if getattr(self, name) not in ok:
                raise ValueError(f"Tuning.{name} must be one of {ok}, got {getattr(self, name)!r}")
        for name in ("fuse_output", "save_t", "merge_state"):
            val = getattr(self, name)
            if not (isinstance(val, bool) or (val is None and name != "fuse_output")):
                raise TypeError(f"Tuning.{name} must be {'True/False' if name == 'fuse_output' else 'None, True or False'}"
                                f", got {val!r}")
        pos = ("bv_state", "bv_out", "bv_grad", "bk_grad", "warps_intra", "warps_state", "warps_out", "warps_grad",
               "num_stages", "fwd_chunk")
        for name in pos:
            val = getattr(self, name)
            if val is None and name not in ("warps_intra", "warps_state", "warps_out"):
                continue
            if isinstance(val, bool) or not isinstance(val, int) or val < 1:
                raise ValueError(f"Tuning.{name} must be a positive int{'' if name.startswith('warps_') else ' or None'}"
                                 f", got {val!r}")
        if self.fwd_chunk is not None and self.fwd_chunk not in SUPPORTED_CHUNK_SIZES:
            raise ValueError(f"Tuning.fwd_chunk must be one of {SUPPORTED_CHUNK_SIZES} or None, got {self.fwd_chunk!r}")


@dataclasses.dataclass(frozen=True)
class Cfg:
    """Static description of one call (hashable: it keys the custom_vjp and the jit cache)."""

    p: str  # platform (see _pallas_platform.PLATFORMS)
    layout: str  # "bthd" or "hm"
    BH: int
    H: int
    n: int  # chunks
    C: int
    K: int
    V: int
    scale: float
    in_dt: str  # dtype of q, k, v, do as read (and of o, dq, dk, dv as written)
    mid_dt: str  # dtype of intermediates in HBM
    packed: bool  # cu_seqlens: per-chunk reset/readout flags
    nseq: int  # states per (b)h program: 1, or N with cu_seqlens
    tuning: Tuning

    @property
    def Tp(self):
        return self.n * self.C

    @property
    def mm_dt(self):
        return jnp.dtype(self.mid_dt)

    @property
    def u_dt(self):
        return jnp.dtype(F32) if self.tuning.u_dtype == "f32" else self.mm_dt

    @property
    def state_dt(self):
        return jnp.dtype(F32) if self.tuning.state_dot == "f32" else self.mm_dt

    @property
    def out_dt(self):
        return jnp.dtype(F32) if self.tuning.out_dot == "f32" else self.mm_dt

    def prec(self, dt, role):
        t = self.tuning
        auto = "tf32" if jnp.dtype(self.mid_dt) != F32 else "tf32x3"
        t = dataclasses.replace(t, gpu_f32_inv=t.gpu_f32_inv or auto, gpu_f32_mm=t.gpu_f32_mm or auto)
        return _plat.dot_precision(self.p, dt, role, t)

    def _bv_default(self, kind):
        V = self.V
        if _plat.is_tpu_layout(self.p):
            return V if V <= 128 or V % 128 else 128
        if kind == "state":  # sequential chains: want >= ~2 programs per SM (H200: 132 SMs)
            bv = min(V, 64)
            # V > 128 at C = 16: at most halve to 32 (B2 T8192 H8 D256 C16 on an H200: bv 16 -> 32
            # cut the forward from ~3.0 to 2.0 ms; every program re-reads the whole K-wide W, k, q)
            # (at C = 32 with f32 state dots the other way round: bv 16 forward 2.2 ms, bv 32 ~2.95 ms;
            # with bf16 state dots bv 32 wins: fwd+bwd 5.37 ms vs 6.24 ms, 2026-11-30)
            lo = 32 if (V > 128 and (self.C <= 16 or self.state_dt != F32)) else 16
            while bv > lo and self.BH * (V // bv) < 256:
                bv //= 2
            return bv
        if kind == "out":
            return min(V, 128)
        return min(V, 64)

    @property
    def merge_state(self):
        """``tuning.merge_state``; None: on GPU when the state passes have <= 128 programs."""
        m = self.tuning.merge_state
        if _plat.is_tpu_layout(self.p):
            return False
        if m is None:
            return self.p == "gpu" and self.BH * (self.V // self.bv("state")) <= 128
        return bool(m)

    @property
    def save_t(self):
        """``tuning.save_t``; None: True for the whole-K gradient kernel, False for the K-split
        one (B2 T8192 H8 D256 C32 on an H200: backward 4.54 ms recomputing T vs 5.09 ms reading it)."""
        s = self.tuning.save_t
        return (self.grad_nk() == 1) if s is None else bool(s)

    def grad_nk(self):
        """Number of key-channel blocks of the gradient kernel (1: the whole-K kernel)."""
        bk = self.tuning.bk_grad
        if bk is None:
            bk = self.K if (_plat.is_tpu_layout(self.p) or self.K <= 128) else 128
        bk = min(bk, self.K)
        if self.K % bk:
            raise ValueError(f"bk_grad={bk} must divide K={self.K}")
        nk = self.K // bk
        if self.V % nk or self.V // nk < 16:  # the dv share of each program: >= 16 columns
            return 1
        return nk

    def bv(self, kind):
        v = getattr(self.tuning, "bv_" + kind) or self._bv_default(kind)
        v = min(v, self.V)
        if self.V % v:
            raise ValueError(f"bv_{kind}={v} must divide V={self.V}")
        return v

    def kw(self, kind, n_grid, sequential_last=False, blocks=None):
        """pallas_call kwargs; ``blocks`` = [(BlockSpec, dtype)] sizes the TPU VMEM limit."""
        t = self.tuning
        warps = {
            "intra": t.warps_intra,
            "state": t.warps_state,
            "out": t.warps_out,
            "grad": t.warps_grad or (8 if max(self.K, self.V) >= 128 else 4),
        }[kind]
        vmem = _plat.tpu_vmem_bytes(blocks) if (blocks and self.p == "tpu") else None
        stages = 2 if t.num_stages is None else t.num_stages
        return _plat.pallas_call_kwargs(self.p, num_warps=warps, num_stages=stages, n_grid=n_grid,
                                        sequential_last=sequential_last, vmem_bytes=vmem)


# ---------------------------------------------------------------------------
# BlockSpec helpers. `f(*grid_idx) -> (bh, row_block, col_block)`.
# ---------------------------------------------------------------------------


def _tok_spec(cfg: Cfg, rows, cols, f):
    """Token array in the caller's layout, block [rows, cols] seen by the kernel."""
    if cfg.layout == "bthd":
        H = cfg.H

        def im(*g):
            bh, r, c = f(*g)
            return (bh // H, r, bh % H, c)

        return pl.BlockSpec((None, rows, None, cols), im)
    return pl.BlockSpec((None, rows, cols), lambda *g: f(*g))


def _hm_spec(rows, cols, f):
    """Head-major internal array [BH, T, D] (or scalar column [BH, T, 1])."""
    return pl.BlockSpec((None, rows, cols), lambda *g: f(*g))


def _tok_shape(cfg: Cfg, D):
    if cfg.layout == "bthd":
        return (cfg.BH // cfg.H, cfg.Tp, cfg.H, D)
    return (cfg.BH, cfg.Tp, D)


# ---------------------------------------------------------------------------
# in-kernel helpers
# ---------------------------------------------------------------------------


def _mm(cfg: Cfg, a, b, ta=False, tb=False, dt=None, role="mm"):
    """2-D dot with f32 accumulation; operands cast to `dt` (default: the intermediates' dtype)."""
    dt = jnp.dtype(dt or cfg.mm_dt)
    a = a.astype(dt)
    b = b.astype(dt)
    dims = (((0 if ta else 1,), (1 if tb else 0,)), ((), ()))
    return lax.dot_general(a, b, dims, precision=cfg.prec(dt, role), preferred_element_type=F32)


def _iotas(C):
    return lax.broadcasted_iota(jnp.int32, (C, C), 0), lax.broadcasted_iota(jnp.int32, (C, C), 1)


def _decay(gc, gr, incl):
    """Gamma_ij = exp(gc_i - gr_j) on i >= j (i > j if not incl), 0 elsewhere; masked before exp."""
    C = gc.shape[0]
    i, j = _iotas(C)
    m = (i >= j) if incl else (i > j)
    return jnp.where(m, jnp.exp(jnp.where(m, gc - gr, 0.0)), 0.0)


def _inv_unit_lower(cfg: Cfg, A):
    """(I + A)^-1 for strictly lower A [C, C] f32 by the recursive block formula (matmul only)."""
    C = A.shape[0]
    i, j = _iotas(C)
    # s = 1: T_2 = I - L_1 (the inverse of a unit 2x2 lower block is exact without matmuls)
    T = jnp.where(i == j, 1.0, 0.0).astype(F32) - jnp.where(((i & 1) == 1) & (j == i - 1), A, 0.0)
    s = 2
    while s < C:
        lg = s.bit_length() - 1  # s == 1 << lg
        bi = i >> lg
        L = jnp.where(((bi & 1) == 1) & ((j >> lg) == bi - 1), A, 0.0)
        TL = _mm(cfg, T, L, dt=F32, role="inv")
        T = T - _mm(cfg, TL, T, dt=F32, role="inv")
        s *= 2
    return T


def _rowsum(x):
    return jnp.sum(x, axis=1, keepdims=True)


def _colsum(x):
    return jnp.sum(x, axis=0, keepdims=True)


def _f32(ref, *idx):
    return (ref[idx] if idx else ref[...]).astype(F32)


# ---------------------------------------------------------------------------
# kernel bodies
# ---------------------------------------------------------------------------


def _intra_kernel(cfg: Cfg, mode: str, *refs):
    """mode "wu": W, U.  "fwd": W, U, Aqk (for the fused state pass).  "bwd": W, U, dVl = Aqk^T dO."""
    t_ref = None
    if mode == "bwd":
        if cfg.save_t:
            q_ref, k_ref, v_ref, do_ref, b_ref, gc_ref, gr_ref, eg_ref, w_ref, u_ref, x_ref, t_ref = refs
        else:
            q_ref, k_ref, v_ref, do_ref, b_ref, gc_ref, gr_ref, eg_ref, w_ref, u_ref, x_ref = refs
    elif mode == "fwd":
        q_ref, k_ref, v_ref, b_ref, gc_ref, gr_ref, eg_ref, w_ref, u_ref, x_ref = refs
    else:
        k_ref, v_ref, b_ref, gc_ref, gr_ref, eg_ref, w_ref, u_ref = refs
    k = _f32(k_ref)
    beta = b_ref[...]
    gc, gr = gc_ref[...], gr_ref[...]
    kb = k * beta
    A = _mm(cfg, kb, k, tb=True) * _decay(gc, gr, incl=False)
    T = _inv_unit_lower(cfg, A)
    if t_ref is not None:
        t_ref[...] = T
    w_ref[...] = _mm(cfg, T, kb * eg_ref[...], dt=F32).astype(w_ref.dtype)
    u_ref[...] = _mm(cfg, T, _f32(v_ref) * beta, dt=F32).astype(u_ref.dtype)
    if mode != "wu":
        q = _f32(q_ref) * cfg.scale
        Aqk = _mm(cfg, q, k, tb=True) * _decay(gc, gr, incl=True)
        if mode == "fwd":
            x_ref[...] = Aqk.astype(x_ref.dtype)
        else:
            x_ref[...] = _mm(cfg, Aqk, do_ref[...], ta=True).astype(x_ref.dtype)


def _flags(info_ref, i):
    info = info_ref[i]
    return info >> 2, (info & 1) != 0, (info & 2) != 0  # seq id, first chunk of it, last chunk of it


def _state_fwd_kernel(cfg: Cfg, *refs):
    if cfg.packed:
        w_ref, u_ref, k_ref, ekd_ref, dec_ref, h0_ref, info_ref, vn_ref, h_ref, fin_ref = refs
    else:
        (w_ref, u_ref, k_ref, ekd_ref, dec_ref, h0_ref, vn_ref, h_ref, fin_ref), info_ref = refs, None
    _state_fwd_loop(cfg, w_ref, u_ref, k_ref, ekd_ref, dec_ref, h0_ref, info_ref, vn_ref, h_ref, fin_ref)


def _state_fwd_loop(cfg, w_ref, u_ref, k_ref, ekd_ref, dec_ref, h0_ref, info_ref, vn_ref, h_ref, fin_ref):
    """Forward state pass: writes Vn, h_n (entering states) and, unless fin_ref is None, the final state."""
    C = cfg.C

    def body(i, S):
        t0 = pl.multiple_of(i * C, C)
        if cfg.packed:
            sid, first, last = _flags(info_ref, i)
            S = lax.cond(first, lambda: _f32(h0_ref, sid), lambda: S)
        h_ref[i] = S.astype(h_ref.dtype)
        rows = pl.ds(t0, C)
        sdt = cfg.state_dt
        vn = _f32(u_ref, rows, slice(None)) - _mm(cfg, w_ref[rows, :], S, dt=sdt)
        vn_ref[rows, :] = vn.astype(vn_ref.dtype)
        kd = _f32(k_ref, rows, slice(None)) * ekd_ref[rows, :]
        S = dec_ref[i] * S + _mm(cfg, kd, vn, ta=True, dt=sdt)
        if cfg.packed and fin_ref is not None:

            @pl.when(last)
            def _():
                fin_ref[sid] = S.astype(fin_ref.dtype)

        return S

    S0 = jnp.zeros(h0_ref.shape[1:], F32) if cfg.packed else _f32(h0_ref, 0)
    S = lax.fori_loop(0, cfg.n, body, S0)
    if not cfg.packed and fin_ref is not None:
        fin_ref[0] = S.astype(fin_ref.dtype)


def _state_out_kernel(cfg: Cfg, *refs):
    """Fused forward: the state pass that also writes o (no h_n / Vn round trip through HBM).
    Per chunk: Vn = U - W S; o = (Q e^gamma) S + Aqk Vn; S <- e^{gamma_C} S + Kd^T Vn.
    Only the first and last dots sit on the S -> S' dependency chain."""
    if cfg.packed:
        w_ref, u_ref, k_ref, ekd_ref, dec_ref, h0_ref, q_ref, eg_ref, aqk_ref, info_ref, o_ref, fin_ref = refs
    else:
        w_ref, u_ref, k_ref, ekd_ref, dec_ref, h0_ref, q_ref, eg_ref, aqk_ref, o_ref, fin_ref = refs
    C = cfg.C

    def body(i, S):
        t0 = pl.multiple_of(i * C, C)
        if cfg.packed:
            sid, first, last = _flags(info_ref, i)
            S = lax.cond(first, lambda: _f32(h0_ref, sid), lambda: S)
        rows = pl.ds(t0, C)
        sdt = cfg.state_dt
        vn = _f32(u_ref, rows, slice(None)) - _mm(cfg, w_ref[rows, :], S, dt=sdt)
        qg = _f32(q_ref, rows, slice(None)) * (eg_ref[rows, :] * cfg.scale)
        o = _mm(cfg, qg, S, dt=cfg.out_dt) + _mm(cfg, aqk_ref[i], vn, dt=cfg.out_dt)
        o_ref[rows, :] = o.astype(o_ref.dtype)
        kd = _f32(k_ref, rows, slice(None)) * ekd_ref[rows, :]
        S = dec_ref[i] * S + _mm(cfg, kd, vn, ta=True, dt=sdt)
        if cfg.packed:

            @pl.when(last)
            def _():
                fin_ref[sid] = S.astype(fin_ref.dtype)

        return S

    S0 = jnp.zeros(h0_ref.shape[1:], F32) if cfg.packed else _f32(h0_ref, 0)
    S = lax.fori_loop(0, cfg.n, body, S0)
    if not cfg.packed:
        fin_ref[0] = S.astype(fin_ref.dtype)


def _output_kernel(cfg: Cfg, q_ref, k_ref, gc_ref, gr_ref, eg_ref, h_ref, vn_ref, o_ref):
    q = _f32(q_ref) * cfg.scale
    Aqk = _mm(cfg, q, k_ref[...], tb=True) * _decay(gc_ref[...], gr_ref[...], incl=True)
    o = _mm(cfg, q * eg_ref[...], h_ref[...], dt=cfg.out_dt) + _mm(cfg, Aqk, vn_ref[...], dt=cfg.out_dt)
    o_ref[...] = o.astype(o_ref.dtype)


def _state_bwd_kernel(cfg: Cfg, *refs):
    if cfg.packed:
        (q_ref, k_ref, w_ref, dvl_ref, do_ref, eg_ref, ekd_ref, dec_ref, dfin_ref, info_ref,
         dh_ref, dvn_ref, dh0_ref) = refs
    else:
        (q_ref, k_ref, w_ref, dvl_ref, do_ref, eg_ref, ekd_ref, dec_ref, dfin_ref, dh_ref, dvn_ref, dh0_ref) = refs
        info_ref = None
    _state_bwd_loop(cfg, q_ref, k_ref, w_ref, dvl_ref, do_ref, eg_ref, ekd_ref, dec_ref, dfin_ref, info_ref,
                    dh_ref, dvn_ref, dh0_ref)


def _state_bwd_loop(cfg, q_ref, k_ref, w_ref, dvl_ref, do_ref, eg_ref, ekd_ref, dec_ref, dfin_ref, info_ref,
                    dh_ref, dvn_ref, dh0_ref):
    """Reverse state pass: writes dh_n (gradient w.r.t. the state leaving chunk n), dVn, d h0."""
    C, n = cfg.C, cfg.n

    def body(jj, dS):
        i = n - 1 - jj
        t0 = pl.multiple_of(i * C, C)
        if cfg.packed:
            sid, first, last = _flags(info_ref, i)
            dS = lax.cond(last, lambda: _f32(dfin_ref, sid), lambda: dS)
        dh_ref[i] = dS.astype(dh_ref.dtype)
        rows = pl.ds(t0, C)
        kd = _f32(k_ref, rows, slice(None)) * ekd_ref[rows, :]
        sdt = cfg.state_dt
        dvn = _f32(dvl_ref, rows, slice(None)) + _mm(cfg, kd, dS, dt=sdt)
        dvn_ref[rows, :] = dvn.astype(dvn_ref.dtype)
        qg = _f32(q_ref, rows, slice(None)) * (eg_ref[rows, :] * cfg.scale)
        dS = (dec_ref[i] * dS + _mm(cfg, qg, do_ref[rows, :], ta=True, dt=sdt)
              - _mm(cfg, w_ref[rows, :], dvn, ta=True, dt=sdt))
        if cfg.packed:

            @pl.when(first)
            def _():
                dh0_ref[sid] = dS.astype(dh0_ref.dtype)

        return dS

    dS0 = jnp.zeros(dfin_ref.shape[1:], F32) if cfg.packed else _f32(dfin_ref, 0)
    dS = lax.fori_loop(0, n, body, dS0)
    if not cfg.packed:
        dh0_ref[0] = dS.astype(dh0_ref.dtype)


def _state_both_kernel(cfg: Cfg, *refs):
    """Both backward state passes in one launch, grid (BH, V/BV, 2): direction 0 recomputes
    the forward pass (Vn, h_n), direction 1 runs the reverse pass (dh_n, dVn, d h0). They are
    independent, so this doubles the number of concurrent sequential chains (GPU only: each
    program writes only its own outputs, which the TPU pipeline would not allow)."""
    if cfg.packed:
        (w_ref, u_ref, k_ref, ekd_ref, dec_ref, h0_ref, q_ref, dvl_ref, do_ref, eg_ref, dfin_ref, info_ref,
         vn_ref, h_ref, dh_ref, dvn_ref, dh0_ref) = refs
    else:
        (w_ref, u_ref, k_ref, ekd_ref, dec_ref, h0_ref, q_ref, dvl_ref, do_ref, eg_ref, dfin_ref,
         vn_ref, h_ref, dh_ref, dvn_ref, dh0_ref) = refs
        info_ref = None
    d = pl.program_id(2)

    @pl.when(d == 0)
    def _():
        _state_fwd_loop(cfg, w_ref, u_ref, k_ref, ekd_ref, dec_ref, h0_ref, info_ref, vn_ref, h_ref, None)

    @pl.when(d == 1)
    def _():
        _state_bwd_loop(cfg, q_ref, k_ref, w_ref, dvl_ref, do_ref, eg_ref, ekd_ref, dec_ref, dfin_ref, info_ref,
                        dh_ref, dvn_ref, dh0_ref)


def _grad_kernel(cfg: Cfg, *refs):
    """Local gradients of one chunk. Ordered to keep few [C, K] / [C, C] f32 values live at
    once (register pressure on GPU): the V loop, then the T/A path, then the Q K^T path.
    T comes from the backward intra kernel (``tuning.save_t``) or is recomputed."""
    if cfg.save_t:
        (q_ref, k_ref, v_ref, do_ref, b_ref, gc_ref, gr_ref, eg_ref, ekd_ref, h_ref, dh_ref, vn_ref, dvn_ref,
         t_ref, dq_ref, dk_ref, dv_ref, db_ref, dgc_ref, dgr_ref, deg_ref, dekd_ref, ddec_ref) = refs
    else:
        (q_ref, k_ref, v_ref, do_ref, b_ref, gc_ref, gr_ref, eg_ref, ekd_ref, h_ref, dh_ref, vn_ref, dvn_ref,
         dq_ref, dk_ref, dv_ref, db_ref, dgc_ref, dgr_ref, deg_ref, dekd_ref, ddec_ref) = refs
    k = _f32(k_ref)
    beta, gc, gr, eg = b_ref[...], gc_ref[...], gr_ref[...], eg_ref[...]
    strict = _strict_mask(cfg.C)
    kb = k * beta
    Gs = _decay(gc, gr, incl=False)
    A = _mm(cfg, kb, k, tb=True) * Gs
    T = t_ref[...] if cfg.save_t else _inv_unit_lower(cfg, A)

    # --- value-channel blocks: everything that contracts or runs over V
    bv = cfg.bv("grad")
    dQg = dW = dKd = dAqk = dT = ddec = dbeta = None
    acc = lambda a, b: b if a is None else a + b
    for jb in range(cfg.V // bv):  # static loop
        sl = slice(jb * bv, (jb + 1) * bv)
        S, dS = h_ref[:, sl], dh_ref[:, sl]
        vn, dvn, do = vn_ref[:, sl], dvn_ref[:, sl], do_ref[:, sl]
        v = _f32(v_ref, slice(None), sl)
        dQg = acc(dQg, _mm(cfg, do, S, tb=True))  # o = Qg S + Aqk vn
        dAqk = acc(dAqk, _mm(cfg, do, vn, tb=True))
        dW = acc(dW, -_mm(cfg, dvn, S, tb=True))  # vn = U - W S
        dKd = acc(dKd, _mm(cfg, vn, dS, tb=True))  # S' = dec S + Kd^T vn
        ddec = acc(ddec, _colsum(_rowsum(S.astype(F32) * dS.astype(F32))))
        dT = acc(dT, _mm(cfg, dvn, v * beta, tb=True, dt=F32))  # U = T (beta V)
        dvb = _mm(cfg, T, dvn, ta=True, dt=F32)
        dv_ref[:, sl] = (dvb * beta).astype(dv_ref.dtype)
        dbeta = acc(dbeta, _rowsum(dvb * v))
    ddec_ref[...] = ddec
    dekd_ref[...] = _rowsum(dKd * k)  # Kd = K e^{gamma_C - gamma}
    dk = dKd * ekd_ref[...]

    # --- W = T X with X = beta K e^gamma; T = (I + A)^-1; A = strict((beta K) K^T * Gamma)
    X = kb * eg
    dT = dT + _mm(cfg, dW, X, tb=True, dt=F32)
    dX = _mm(cfg, T, dW, ta=True, dt=F32)
    dA = -_mm(cfg, _mm(cfg, T, dT, ta=True, dt=F32, role="inv"), T, tb=True, dt=F32, role="inv") * strict
    # gamma enters A and Aqk through Gamma_ij = exp(gamma_i - gamma_j): +M_ij to gamma_i, -M_ij to
    # gamma_j. The diagonal (Gamma_ii = 1) does not depend on gamma: leaving it out of M avoids a
    # large +x/-x pair whose f32 rounding would dominate tiny gate gradients under strong decay.
    M = dA * A
    dKK = dA * Gs
    dkb = _mm(cfg, dKK, k) + dX * eg
    dk = dk + _mm(cfg, dKK, kb, ta=True) + dkb * beta
    dbeta = dbeta + _rowsum(dkb * k)
    deg = _rowsum(dX * kb)

    q = _f32(q_ref) * cfg.scale
    _qk_grads_and_write(cfg, q, k, q, k, gc, gr, eg, dAqk, dQg, M, strict, dk, dbeta, deg,
                        dq_ref, dk_ref, db_ref, dgc_ref, dgr_ref, deg_ref)


def _qk_grads_and_write(cfg: Cfg, q, k, qs, ks, gc, gr, eg, dAqk, dQg, M, strict, dk, dbeta, deg,
                        dq_ref, dk_ref, db_ref, dgc_ref, dgr_ref, deg_ref):
    """The gradient kernels' last step, o = (Q e^gamma) S + tril(Q K^T * Gamma) vn (Q scaled), and
    their output writes. ``q, k``: all K channels (Aqk contracts over K); ``qs, ks``: the program's
    K columns (the same arrays in the whole-K kernel); ``q``, ``qs`` already scaled."""
    Gi = _decay(gc, gr, incl=True)
    Aqk = _mm(cfg, q, k, tb=True) * Gi
    M = M + dAqk * Aqk * strict
    dQK = dAqk * Gi
    dqs = _mm(cfg, dQK, ks) + dQg * eg
    dk = dk + _mm(cfg, dQK, qs, ta=True)
    deg = deg + _rowsum(dQg * qs)

    dq_ref[...] = (dqs * cfg.scale).astype(dq_ref.dtype)
    dk_ref[...] = dk.astype(dk_ref.dtype)
    db_ref[...] = dbeta
    dgc_ref[...] = _rowsum(M)
    dgr_ref[...] = -_colsum(M)
    deg_ref[...] = deg


def _grad_kernel_ksplit(cfg: Cfg, *refs):
    """:func:`_grad_kernel` for one block of bk key channels (grid (B*H, chunks, K/bk)).

    Each program reads the chunk's q, k (all K: A and Aqk contract over K), its K rows of h_n
    and dh_n, and vn, dvn, dO (all V); it writes dq, dk for its K columns, dv for its share of
    the V columns (V/nk of them) and partial per-token scalar gradients (summed over the K
    blocks by the caller). T = (I + A)^-1 is recomputed per program unless ``cfg.save_t``. The only K-contraction of the whole-K kernel, dW X^T in dT, is
    rewritten with X S = (I + A) W S = (I + A)(U - Vn) = beta V - (I + A) Vn (from Vn = U - W S,
    W = T X, U = T beta V, T = (I + A)^-1): dT = dvn (beta v)^T + dW X^T = dvn Vn^T (I + A)^T,
    which contracts over V only (and avoids the cancellation of the two O(|v|) terms)."""
    if cfg.save_t:
        (q_ref, k_ref, qs_ref, ks_ref, vs_ref, do_ref, b_ref, gc_ref, gr_ref, eg_ref, ekd_ref, h_ref, dh_ref, vn_ref,
         dvn_ref, dvns_ref, t_ref, dq_ref, dk_ref, dv_ref, db_ref, dgc_ref, dgr_ref, deg_ref, dekd_ref, ddec_ref) = refs
    else:
        (q_ref, k_ref, qs_ref, ks_ref, vs_ref, do_ref, b_ref, gc_ref, gr_ref, eg_ref, ekd_ref, h_ref, dh_ref, vn_ref,
         dvn_ref, dvns_ref, dq_ref, dk_ref, dv_ref, db_ref, dgc_ref, dgr_ref, deg_ref, dekd_ref, ddec_ref) = refs
        t_ref = None
    C = cfg.C
    k = _f32(k_ref)
    beta, gc, gr, eg = b_ref[...], gc_ref[...], gr_ref[...], eg_ref[...]
    strict = _strict_mask(C)
    Gs = _decay(gc, gr, incl=False)
    A = _mm(cfg, k * beta, k, tb=True) * Gs
    T = t_ref[...] if t_ref is not None else _inv_unit_lower(cfg, A)

    # --- value-channel blocks: [C, bk] accumulators over all of V (rows of h_n / dh_n: this block's K)
    bv = cfg.bv("grad")
    dQg = dW = dKd = dAqk = dVV = ddec = None
    acc = lambda a, b: b if a is None else a + b
    for jb in range(cfg.V // bv):  # static loop
        sl = slice(jb * bv, (jb + 1) * bv)
        S, dS = h_ref[:, sl], dh_ref[:, sl]
        vn, dvn, do = vn_ref[:, sl], dvn_ref[:, sl], do_ref[:, sl]
        dQg = acc(dQg, _mm(cfg, do, S, tb=True))  # o = Qg S + Aqk vn
        dAqk = acc(dAqk, _mm(cfg, do, vn, tb=True))
        dW = acc(dW, -_mm(cfg, dvn, S, tb=True))  # vn = U - W S
        dKd = acc(dKd, _mm(cfg, vn, dS, tb=True))  # S' = dec S + Kd^T vn
        dVV = acc(dVV, _mm(cfg, dvn, vn, tb=True))
        ddec = acc(ddec, _colsum(_rowsum(S.astype(F32) * dS.astype(F32))))
    ddec_ref[...] = ddec

    # --- this program's share of the value channels: dv, and dbeta through U = T (beta V)
    dvb = _mm(cfg, T, dvns_ref[...], ta=True, dt=F32)
    dv_ref[...] = (dvb * beta).astype(dv_ref.dtype)
    dbeta = _rowsum(dvb * _f32(vs_ref))

    ks = _f32(ks_ref)
    dekd_ref[...] = _rowsum(dKd * ks)  # Kd = K e^{gamma_C - gamma}
    dk = dKd * ekd_ref[...]

    # --- W = T X with X = beta K e^gamma; T = (I + A)^-1; A = strict((beta K) K^T * Gamma)
    kbs = ks * beta
    dT = dVV + _mm(cfg, dVV, A, tb=True, dt=F32)  # dvn Vn^T (I + A)^T
    dX = _mm(cfg, T, dW, ta=True, dt=F32)
    dA = -_mm(cfg, _mm(cfg, T, dT, ta=True, dt=F32, role="inv"), T, tb=True, dt=F32, role="inv") * strict
    M = dA * A
    dKK = dA * Gs
    dkb = _mm(cfg, dKK, ks) + dX * eg
    dk = dk + _mm(cfg, dKK, kbs, ta=True) + dkb * beta
    dbeta = dbeta + _rowsum(dkb * ks)
    deg = _rowsum(dX * kbs)

    _qk_grads_and_write(cfg, _f32(q_ref) * cfg.scale, k, _f32(qs_ref) * cfg.scale, ks, gc, gr, eg, dAqk, dQg, M,
                        strict, dk, dbeta, deg, dq_ref, dk_ref, db_ref, dgc_ref, dgr_ref, deg_ref)


def _strict_mask(C):
    i, j = _iotas(C)
    return jnp.where(i > j, 1.0, 0.0).astype(F32)


# ---------------------------------------------------------------------------
# pallas_call builders
# ---------------------------------------------------------------------------


def _blocks(in_specs, args, out_specs, out_shapes):
    return [(sp, a.dtype) for sp, a in zip(in_specs, args)] + [(sp, o.dtype) for sp, o in zip(out_specs, out_shapes)]


def _sds(shape, dt):
    return jax.ShapeDtypeStruct(tuple(shape), jnp.dtype(dt))


def _scalar_specs(cfg: Cfg, f):
    """gamma column, gamma row, and any further columns, per chunk; f(*g) -> (bh, chunk)."""
    C = cfg.C
    col = _hm_spec(C, 1, lambda *g: (*f(*g), 0))
    row = pl.BlockSpec((None, None, 1, C), lambda *g: (f(*g)[0], f(*g)[1], 0, 0))
    return col, row


def intra(cfg: Cfg, k, v, beta, gc, gr, eg, q=None, do=None):
    """W [BH,T,K] (intermediates' dtype) and U [BH,T,V] (cfg.u_dt); plus, when q is given,
    Aqk = tril(Q K^T * Gamma) [BH,n,C,C] (cfg.out_dt; for the fused forward), or with q and
    do given dVl = Aqk^T dO [BH,T,V] and, with ``tuning.save_t``, T [BH,n,C,C] f32 (backward)."""
    C, K, V, BH, n = cfg.C, cfg.K, cfg.V, cfg.BH, cfg.n
    mode = "wu" if q is None else ("fwd" if do is None else "bwd")
    f = lambda b, c: (b, c)
    col, row = _scalar_specs(cfg, f)
    tk = _tok_spec(cfg, C, K, lambda b, c: (b, c, 0))
    tv = _tok_spec(cfg, C, V, lambda b, c: (b, c, 0))
    in_specs = [tk, tv] + ([tv] if mode == "bwd" else []) + [col, col, row, col]
    args = [k, v] + ([do] if mode == "bwd" else []) + [beta, gc, gr, eg]
    if mode != "wu":
        in_specs = [tk] + in_specs
        args = [q] + args
    out_specs = [_hm_spec(C, K, lambda b, c: (b, c, 0)), _hm_spec(C, V, lambda b, c: (b, c, 0))]
    out_shape = [_sds((BH, cfg.Tp, K), cfg.mid_dt), _sds((BH, cfg.Tp, V), cfg.u_dt)]
    if mode == "bwd":
        out_specs.append(_hm_spec(C, V, lambda b, c: (b, c, 0)))
        out_shape.append(_sds((BH, cfg.Tp, V), cfg.mid_dt))
    elif mode == "fwd":
        out_specs.append(pl.BlockSpec((None, None, C, C), lambda b, c: (b, c, 0, 0)))
        out_shape.append(_sds((BH, n, C, C), cfg.out_dt))
    if mode == "bwd" and cfg.save_t:
        out_specs.append(pl.BlockSpec((None, None, C, C), lambda b, c: (b, c, 0, 0)))
        out_shape.append(_sds((BH, n, C, C), F32))
    fn = pl.pallas_call(
        functools.partial(_intra_kernel, cfg, mode),
        out_shape=out_shape,
        grid=(BH, n),
        in_specs=in_specs,
        out_specs=out_specs,
        name=f"gdn_intra_{mode}",
        **cfg.kw("intra", 2),
    )
    return _plat.call(cfg.p, fn, *args)


def _state_common_specs(cfg: Cfg, bv):
    """Whole-sequence specs for the state passes; grid (bh, j)."""
    Tp, K, n = cfg.Tp, cfg.K, cfg.n
    full_k = lambda: _tok_spec(cfg, Tp, K, lambda b, j: (b, 0, 0))
    hm_k = _hm_spec(Tp, K, lambda b, j: (b, 0, 0))
    hm_v = _hm_spec(Tp, bv, lambda b, j: (b, 0, j))
    col = _hm_spec(Tp, 1, lambda b, j: (b, 0, 0))
    dec = pl.BlockSpec((None, n, 1, 1), lambda b, j: (b, 0, 0, 0))
    st = pl.BlockSpec((None, cfg.nseq, K, bv), lambda b, j: (b, 0, 0, j))
    hs = pl.BlockSpec((None, n, K, bv), lambda b, j: (b, 0, 0, j))
    return full_k, hm_k, hm_v, col, dec, st, hs


def state_fwd(cfg: Cfg, w, u, k, ekd, dec, h0, info):
    """Forward state pass. Returns (Vn [BH,T,V], h [BH,n,K,V] entering states, final [G,nseq,K,V] f32)."""
    bv = cfg.bv("state")
    BH, K, V, n, Tp = cfg.BH, cfg.K, cfg.V, cfg.n, cfg.Tp
    full_k, hm_k, hm_v, col, decs, st, hs = _state_common_specs(cfg, bv)
    in_specs = [hm_k, hm_v, full_k(), col, decs, st]
    args = [w, u, k, ekd, dec, h0]
    if cfg.packed:
        in_specs.append(_plat.smem_spec(cfg.p, info.shape))
        args.append(info)
    out_shapes = [_sds((BH, Tp, V), cfg.mid_dt), _sds((BH, n, K, V), cfg.mid_dt), _sds(h0.shape, F32)]
    out_specs_l = [hm_v, hs, st]
    fn = pl.pallas_call(
        functools.partial(_state_fwd_kernel, cfg),
        out_shape=out_shapes,
        grid=(BH, V // bv),
        in_specs=in_specs,
        out_specs=out_specs_l,
        name="gdn_state_fwd",
        **cfg.kw("state", 2, blocks=_blocks(in_specs, args, out_specs_l, out_shapes)),
    )
    return _plat.call(cfg.p, fn, *args)


def state_out(cfg: Cfg, w, u, k, ekd, dec, h0, info, q, eg, aqk):
    """Fused forward state pass + output. Returns (o in the token layout and cfg.in_dt,
    final [G,nseq,K,V] f32)."""
    bv = cfg.bv("state")
    BH, K, V, n, Tp, C = cfg.BH, cfg.K, cfg.V, cfg.n, cfg.Tp, cfg.C
    full_k, hm_k, hm_v, col, decs, st, hs = _state_common_specs(cfg, bv)
    in_specs = [hm_k, hm_v, full_k(), col, decs, st, full_k(), col,
                pl.BlockSpec((None, n, C, C), lambda b, j: (b, 0, 0, 0))]
    args = [w, u, k, ekd, dec, h0, q, eg, aqk]
    if cfg.packed:
        in_specs.append(_plat.smem_spec(cfg.p, info.shape))
        args.append(info)
    out_shapes = [_sds(_tok_shape(cfg, V), cfg.in_dt), _sds(h0.shape, F32)]
    out_specs_l = [_tok_spec(cfg, Tp, bv, lambda b, j: (b, 0, j)), st]
    fn = pl.pallas_call(
        functools.partial(_state_out_kernel, cfg),
        out_shape=out_shapes,
        grid=(BH, V // bv),
        in_specs=in_specs,
        out_specs=out_specs_l,
        name="gdn_state_out",
        **cfg.kw("state", 2, blocks=_blocks(in_specs, args, out_specs_l, out_shapes)),
    )
    return _plat.call(cfg.p, fn, *args)


def output(cfg: Cfg, q, k, gc, gr, eg, h, vn):
    """o in the caller's token layout, dtype cfg.in_dt."""
    bv = cfg.bv("out")
    C, K, V, BH, n = cfg.C, cfg.K, cfg.V, cfg.BH, cfg.n
    f = lambda b, c, j: (b, c)
    col, row = _scalar_specs(cfg, f)
    tk = _tok_spec(cfg, C, K, lambda b, c, j: (b, c, 0))
    fn = pl.pallas_call(
        functools.partial(_output_kernel, cfg),
        out_shape=_sds(_tok_shape(cfg, V), cfg.in_dt),
        grid=(BH, n, V // bv),
        in_specs=[tk, tk, col, row, col,
                  pl.BlockSpec((None, None, K, bv), lambda b, c, j: (b, c, 0, j)),
                  _hm_spec(C, bv, lambda b, c, j: (b, c, j))],
        out_specs=_tok_spec(cfg, C, bv, lambda b, c, j: (b, c, j)),
        name="gdn_output",
        **cfg.kw("out", 3),
    )
    return _plat.call(cfg.p, fn, q, k, gc, gr, eg, h, vn)


def state_bwd(cfg: Cfg, q, k, w, dvl, do, eg, ekd, dec, dfin, info):
    """Reverse state pass. Returns (dh [BH,n,K,V], dVn [BH,T,V], d h0 [G,nseq,K,V] f32)."""
    bv = cfg.bv("state")
    BH, K, V, n, Tp = cfg.BH, cfg.K, cfg.V, cfg.n, cfg.Tp
    full_k, hm_k, hm_v, col, decs, st, hs = _state_common_specs(cfg, bv)
    do_spec = _tok_spec(cfg, Tp, bv, lambda b, j: (b, 0, j))
    in_specs = [full_k(), full_k(), hm_k, hm_v, do_spec, col, col, decs, st]
    args = [q, k, w, dvl, do, eg, ekd, dec, dfin]
    if cfg.packed:
        in_specs.append(_plat.smem_spec(cfg.p, info.shape))
        args.append(info)
    out_shapes = [_sds((BH, n, K, V), cfg.mid_dt), _sds((BH, Tp, V), cfg.mid_dt), _sds(dfin.shape, F32)]
    out_specs_l = [hs, hm_v, st]
    fn = pl.pallas_call(
        functools.partial(_state_bwd_kernel, cfg),
        out_shape=out_shapes,
        grid=(BH, V // bv),
        in_specs=in_specs,
        out_specs=out_specs_l,
        name="gdn_state_bwd",
        **cfg.kw("state", 2, blocks=_blocks(in_specs, args, out_specs_l, out_shapes)),
    )
    return _plat.call(cfg.p, fn, *args)


def state_both(cfg: Cfg, w, u, k, ekd, dec, h0, q, dvl, do, eg, dfin, info):
    """:func:`state_fwd` (without the final state) and :func:`state_bwd` in one launch
    (``tuning.merge_state``; not on TPU). Returns (Vn, h, dh, dVn, d h0)."""
    bv = cfg.bv("state")
    BH, K, V, n, Tp = cfg.BH, cfg.K, cfg.V, cfg.n, cfg.Tp
    full_k, hm_k, hm_v, col, decs, st, hs = _state_common_specs(cfg, bv)
    f3 = lambda spec: pl.BlockSpec(spec.block_shape, lambda b, j, d, im=spec.index_map: im(b, j))
    do_spec = _tok_spec(cfg, Tp, bv, lambda b, j: (b, 0, j))
    in_specs = [hm_k, hm_v, full_k(), col, decs, st, full_k(), hm_v, do_spec, col, st]
    args = [w, u, k, ekd, dec, h0, q, dvl, do, eg, dfin]
    in_specs = [f3(sp) for sp in in_specs]
    if cfg.packed:
        in_specs.append(_plat.smem_spec(cfg.p, info.shape))
        args.append(info)
    out_shapes = [_sds((BH, Tp, V), cfg.mid_dt), _sds((BH, n, K, V), cfg.mid_dt),
                   _sds((BH, n, K, V), cfg.mid_dt), _sds((BH, Tp, V), cfg.mid_dt), _sds(dfin.shape, F32)]
    out_specs_l = [f3(hm_v), f3(hs), f3(hs), f3(hm_v), f3(st)]
    fn = pl.pallas_call(
        functools.partial(_state_both_kernel, cfg),
        out_shape=out_shapes,
        grid=(BH, V // bv, 2),
        in_specs=in_specs,
        out_specs=out_specs_l,
        name="gdn_state_both",
        **cfg.kw("state", 3, blocks=_blocks(in_specs, args, out_specs_l, out_shapes)),
    )
    return _plat.call(cfg.p, fn, *args)


def grads(cfg: Cfg, q, k, v, do, beta, gc, gr, eg, ekd, h, dh, vn, dvn, t=None):
    """Per-chunk local gradients: (dq, dk, dv) in the token layout and cfg.in_dt;
    dbeta, dgamma_col, d e^gamma, d e^{gamma_C-gamma} as [BH,T,1]; dgamma_row [BH,n,1,C];
    d e^{gamma_C} [BH,n,1,1]; all scalars f32. (K-blocked kernel when ``cfg.grad_nk() > 1``.)"""
    if cfg.grad_nk() > 1:
        return _grads_ksplit(cfg, q, k, v, do, beta, gc, gr, eg, ekd, h, dh, vn, dvn, t)
    C, K, V, BH, n, Tp = cfg.C, cfg.K, cfg.V, cfg.BH, cfg.n, cfg.Tp
    f = lambda b, c: (b, c)
    col, row = _scalar_specs(cfg, f)
    tk = _tok_spec(cfg, C, K, lambda b, c: (b, c, 0))
    tv = _tok_spec(cfg, C, V, lambda b, c: (b, c, 0))
    hv = _hm_spec(C, V, lambda b, c: (b, c, 0))
    hk = pl.BlockSpec((None, None, K, V), lambda b, c: (b, c, 0, 0))
    fn = pl.pallas_call(
        functools.partial(_grad_kernel, cfg),
        out_shape=[
            _sds(_tok_shape(cfg, K), cfg.in_dt), _sds(_tok_shape(cfg, K), cfg.in_dt), _sds(_tok_shape(cfg, V), cfg.in_dt),
            _sds((BH, Tp, 1), F32), _sds((BH, Tp, 1), F32), _sds((BH, n, 1, C), F32),
            _sds((BH, Tp, 1), F32), _sds((BH, Tp, 1), F32), _sds((BH, n, 1, 1), F32),
        ],
        grid=(BH, n),
        in_specs=[tk, tk, tv, tv, col, col, row, col, col, hk, hk, hv, hv]
        + ([pl.BlockSpec((None, None, C, C), lambda b, c: (b, c, 0, 0))] if cfg.save_t else []),
        out_specs=[tk, tk, tv, col, col, row, col, col, pl.BlockSpec((None, None, 1, 1), lambda b, c: (b, c, 0, 0))],
        name="gdn_grads",
        **cfg.kw("grad", 2),
    )
    extra = (t,) if cfg.save_t else ()
    return _plat.call(cfg.p, fn, q, k, v, do, beta, gc, gr, eg, ekd, h, dh, vn, dvn, *extra)


def _grads_ksplit(cfg: Cfg, q, k, v, do, beta, gc, gr, eg, ekd, h, dh, vn, dvn, t=None):
    """:func:`grads` on the grid (B*H, chunks, K/bk) (see :func:`_grad_kernel_ksplit`)."""
    C, K, V, BH, n, Tp = cfg.C, cfg.K, cfg.V, cfg.BH, cfg.n, cfg.Tp
    nk = cfg.grad_nk()
    bk, bvs = K // nk, V // nk
    f = lambda b, c, j: (b, c)
    col, row = _scalar_specs(cfg, f)
    tk = _tok_spec(cfg, C, K, lambda b, c, j: (b, c, 0))
    tv = _tok_spec(cfg, C, V, lambda b, c, j: (b, c, 0))
    tks = _tok_spec(cfg, C, bk, lambda b, c, j: (b, c, j))
    tvs = _tok_spec(cfg, C, bvs, lambda b, c, j: (b, c, j))
    hv = _hm_spec(C, V, lambda b, c, j: (b, c, 0))
    hvs = _hm_spec(C, bvs, lambda b, c, j: (b, c, j))
    hk = pl.BlockSpec((None, None, bk, V), lambda b, c, j: (b, c, j, 0))
    pcol = pl.BlockSpec((None, None, C, 1), lambda b, c, j: (j, b, c, 0))
    prow = pl.BlockSpec((None, None, None, 1, C), lambda b, c, j: (j, b, c, 0, 0))
    pdec = pl.BlockSpec((None, None, None, 1, 1), lambda b, c, j: (j, b, c, 0, 0))
    in_specs = [tk, tk, tks, tks, tvs, tv, col, col, row, col, col, hk, hk, hv, hv, hvs]
    args = [q, k, q, k, v, do, beta, gc, gr, eg, ekd, h, dh, vn, dvn, dvn]
    if cfg.save_t:
        in_specs.append(pl.BlockSpec((None, None, C, C), lambda b, c, j: (b, c, 0, 0)))
        args.append(t)
    fn = pl.pallas_call(
        functools.partial(_grad_kernel_ksplit, cfg),
        out_shape=[
            _sds(_tok_shape(cfg, K), cfg.in_dt), _sds(_tok_shape(cfg, K), cfg.in_dt), _sds(_tok_shape(cfg, V), cfg.in_dt),
            _sds((nk, BH, Tp, 1), F32), _sds((nk, BH, Tp, 1), F32), _sds((nk, BH, n, 1, C), F32),
            _sds((nk, BH, Tp, 1), F32), _sds((nk, BH, Tp, 1), F32), _sds((nk, BH, n, 1, 1), F32),
        ],
        grid=(BH, n, nk),
        in_specs=in_specs,
        out_specs=[tks, tks, tvs, pcol, pcol, prow, pcol, pcol, pdec],
        name="gdn_grads_ksplit",
        **cfg.kw("grad", 3),
    )
    dq, dk, dv, db, dgc, dgr, deg, dekd, ddec = _plat.call(cfg.p, fn, *args)
    # dgc / dgr are the same in every K block (C x C terms only); the rest are partial sums over K
    return dq, dk, dv, db.sum(0), dgc[0], dgr[0], deg.sum(0), dekd.sum(0), ddec.sum(0)
