"""The differentiable Pallas op: input preparation (plain JAX), the ``jax.custom_vjp`` that runs
the kernels, and the way back to the public layout.

Plain JAX (differentiated by autodiff): the input transform of :func:`gdn_jax.ops._common.prepare`
(q, k L2 normalisation, a traced scale); zero-padding of head dims to powers of two (exact: zero
channels never mix in); the time layout of :func:`gdn_jax.ops.packing.to_chunk_layout` (padding,
or every packed sequence on chunk boundaries); the in-chunk cumulative log decay gamma and its
exponentials (:func:`gate_terms`: TPU Pallas has no in-kernel cumsum), whose cotangents the
backward pulls back to g with ``jax.vjp``.

Kernels (:func:`chunk_gated_delta_rule`, one ``custom_vjp``): its arrays keep batch and value
heads on axes of their own (the split layout of :func:`to_kernel_inputs`); the forward and the
backward kernels each run through :func:`.partition.run_sharded` on one block of batch rows and
heads, merged into the kernels' layout there (:func:`_merge`), so that under ``jit`` on sharded
inputs every device runs its own rows and heads. The forward and the backward each
run at their own chunk (:func:`gdn_jax.ops.pallas.config.kernel_chunk`). The residuals are the
inputs, O(T (K + V)) per head, and where both directions run the Hopper kernels at one chunking
also what ``HopperTuning.save_wy`` (Aqk, T: 24 KB per chunk and head at C = 64, on by default) and
``HopperTuning.save_states`` (h_n, Vn and, with save_wy, W; on by default: the per-chunk states
h_n alone, n K V per head, are 134 MB in bf16 at B4 T4096 H16 D128) keep; the backward recomputes
the rest. A call that is not differentiated runs the forward without these residual writes.

* the kernels of each direction: the first entry of the table of kernel paths (:mod:`.paths`)
  that covers the call, chosen once per call in :func:`to_kernel_inputs` (on the whole call, before
  any sharding) and passed to the ``custom_vjp`` as a static argument; :func:`forward` /
  :func:`backward` run the chosen entry.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from .. import packing as _packing
from .._common import prepare
from . import platform as _plat
from . import partition as _partition
from . import paths as _paths
from .config import KernelCall, KernelConfig, kernel_chunk, resolve

F32 = jnp.float32


def gate_terms(call: KernelCall, beta_hm, g_hm):
    """Per-token kernel scalars of one chunking (plain JAX; differentiable) from head-major beta
    and log decay g [BH, Tp] f32: beta column, gamma column [BH, Tp, 1], gamma row [BH, n, 1, C],
    e^gamma, e^{gamma_C - gamma} columns, e^{gamma_C} [BH, n, 1, 1]."""
    BH, n, C = call.BH, call.n, call.C
    gh = g_hm.reshape(BH, n, C)
    gam = jnp.cumsum(gh, axis=-1)  # in-chunk cumulative log decay gamma
    gam_col = gam.reshape(BH, n * C, 1)
    gam_row = gam.reshape(BH, n, 1, C)
    e_gam = jnp.exp(gam_col)
    # gamma_C - gamma_i = sum_{j>i} g_j, summed directly (a reverse cumsum of g shifted by one)
    # rather than as a difference of two large cumulative sums (|gamma| reaches thousands under
    # strong decay, and f32 differences of such numbers lose ~1e-4 absolute).
    gnext = jnp.concatenate([gh[..., 1:], jnp.zeros_like(gh[..., :1])], axis=-1)
    e_gam_end = jnp.exp(jnp.flip(jnp.cumsum(jnp.flip(gnext, -1), axis=-1), -1)).reshape(BH, n * C, 1)
    e_gam_last = jnp.exp(gam[..., -1:]).reshape(BH, n, 1, 1)
    return beta_hm.reshape(BH, n * C, 1), gam_col, gam_row, e_gam, e_gam_end, e_gam_last


def forward(call: KernelCall, q, k, v, beta, gam, gam_row, e_gam, e_gam_end, e_gam_last, h0, flags, save_wy=False,
            save_states=False, path=None, final_only=False):
    """The forward kernels of one chunking: (o in the token layout, final state [G, nseq, K, V] f32).
    ``flags``: per-chunk flags (``cu_seqlens``) or a dummy. ``path``: the :data:`.paths.FORWARD`
    entry to run, with ``call`` as that entry prepared it (:class:`.paths.Chosen`); None: the
    table's choice for ``call``. With ``save_wy`` and / or ``save_states`` (Hopper paths only) a
    third result, the residuals the Hopper backward reuses: a dict with the WY products ``aqk,
    t_hi, t_lo`` (``save_wy``), the states entering each chunk ``h`` with ``vn``
    (``save_states``) and ``w`` (both). With ``final_only`` the entry's final-state-only run
    (:func:`.paths.run_final_state`): o is None."""
    if path is None:
        chosen = _paths.choose("fwd", call)
        call, path = chosen.call, chosen.path
    args = (q, k, v, beta, gam, gam_row, e_gam, e_gam_end, e_gam_last, h0, flags, save_wy, save_states)
    if final_only:
        o, (fin, saved) = None, _paths.run_final_state(path, call, *args)
    else:
        o, fin, saved = _paths.FORWARD_BY_NAME[path].run(call, *args)
    if call.packed:
        fin = jnp.where(_packing.sequences_with_chunks(flags, call.nseq)[None, :, None, None], fin, h0)
    if save_wy or save_states:
        return o, fin, saved
    return o, fin


def saves_wy(route) -> bool:
    """Whether the forward keeps its WY products for the backward (``HopperTuning.save_wy``): both
    directions of ``route`` (the forward's and the backward's :class:`.paths.Chosen`) on Hopper
    paths at the same chunking."""
    return bool(route[1].call.save_wy and _paths.hopper_both(*route))


def saves_states(route) -> bool:
    """Whether the forward keeps the states entering each chunk and Vn for the backward
    (``HopperTuning.save_states``): both directions of ``route`` on Hopper paths at the same
    chunking."""
    return bool(route[1].call.save_states and _paths.hopper_both(*route))


def backward(call: KernelCall, inputs, cts, saved=None, path=None):
    """The backward kernels of one chunking. ``inputs``: the arguments of :func:`forward`;
    ``cts``: (do, d final state); ``saved``: the forward's residual dict (:func:`forward` with
    ``save_wy`` / ``save_states``: :func:`saves_wy`, :func:`saves_states`) or None; ``path``: the
    :data:`.paths.BACKWARD` entry (None: the table's choice for ``call`` without a forward, so never
    one that needs the forward's residuals). Returns the cotangents of every input of
    :func:`forward` (None for the flags)."""
    if path is None:
        chosen = _paths.choose("bwd", call)
        call, path = chosen.call, chosen.path
    do, dfin = cts
    do = do.astype(call.in_dt)
    dfin = dfin.astype(F32)
    gr, dh0, de_gam_last = _paths.BACKWARD_BY_NAME[path].run(call, inputs, do, dfin, saved)
    return _cotangents(call, gr, dh0, de_gam_last, inputs[-1], dfin)


def _cotangents(call: KernelCall, gr, dh0, de_gam_last, flags, dfin):
    """The backward's results in :func:`forward`'s argument order: d initial_state kept at d final
    for packed sequences without chunks, dq / dk summed over each group of value heads."""
    if call.packed:
        dh0 = jnp.where(_packing.sequences_with_chunks(flags, call.nseq)[None, :, None, None], dh0, dfin)
    dq, dk = (_sum_groups(call, x) for x in (gr["dq"], gr["dk"]))
    return (dq, dk, gr["dv"], gr["dbeta"], gr["dgam"], gr["dgam_row"], gr["de_gam"], gr["de_gam_end"],
            de_gam_last, dh0, None)


def _sum_groups(call: KernelCall, x):
    """dq / dk written per value head -> per key head (the sum over each group of value heads)."""
    G = call.group
    if G == 1:
        return x
    if call.layout == "bthd":
        B, Tp, H, D = x.shape
        return x.astype(F32).reshape(B, Tp, H // G, G, D).sum(3).astype(x.dtype)
    BH, Tp, D = x.shape
    return x.astype(F32).reshape(BH // G, G, Tp, D).sum(1).astype(x.dtype)


def saved_names(save_wy: bool, save_states: bool) -> tuple:
    """The keys of :func:`forward`'s residual dict for ``save_wy`` / ``save_states``, sorted."""
    names = (("aqk", "t_hi", "t_lo") if save_wy else ()) + (("h", "vn") if save_states else ())
    return tuple(sorted(names + (("w",) if save_wy and save_states else ())))


# The kernels' arrays in the split layout (batch and value heads on axes of their own, so that
# the kernels can be partitioned over them: see :mod:`.partition`) and in the kernel layout.
# Labels: "b" batch, "h" key heads, "v" value heads, "." not split, "*" the rest.
_TOK = {"bthd": ("b.h.", "b.v."), "hm": ("bh..", "bv..")}  # q / k, and v / o, of each layout


def _local(call: KernelCall, B: int, H: int) -> KernelCall:
    """``call`` for a block of B batch rows and H value heads (one device's under sharding)."""
    return call if (call.BH, call.H) == (B * H, H) else dataclasses.replace(call, BH=B * H, H=H)


def _merge(call: KernelCall, q, k, v, beta, g, h0):
    """Split layout -> kernel layout: beta, g [B,H,Tp] -> [BH,Tp]; h0 [B,H,nseq,K,V] -> [BH,nseq,K,V];
    q, k, v [B,H,Tp,D] -> [BH,Tp,D] on the head-major (TPU) layout."""
    if call.layout == "hm":
        q, k, v = (x.reshape(x.shape[0] * x.shape[1], *x.shape[2:]) for x in (q, k, v))
    flat = lambda x: x.reshape(x.shape[0] * x.shape[1], *x.shape[2:])
    return q, k, v, flat(beta), flat(g), flat(h0)


def _split(x, B: int, H: int):
    """[B*H, ...] -> [B, H, ...]."""
    return x.reshape(B, H, *x.shape[1:])


def _split_tok(call: KernelCall, x, B: int):
    """A token array of the kernel layout -> the split layout (the head-major one: [B, H, Tp, D])."""
    return _split(x, B, x.shape[0] // B) if call.layout == "hm" else x


def _forward_block(static, q, k, v, beta, g, h0, flags):
    """The forward kernels on one block of batch rows and heads (split layout in and out):
    o, final state [B,H,nseq,K,V] and the residuals named by :func:`saved_names`. ``static``: (the
    forward's :class:`.paths.Chosen`, save_wy, save_states) and, for the final-state-only forward, a
    fourth entry True: no o in the results."""
    chosen, save, keep, *final = static
    final_only = bool(final and final[0])
    B, H = beta.shape[:2]
    call = _local(chosen.call, B, H)
    q, k, v, beta, g, h0 = _merge(call, q, k, v, beta, g, h0)
    out = forward(call, q, k, v, *gate_terms(call, beta, g), h0, flags, save_wy=save, save_states=keep,
                  path=chosen.path, final_only=final_only)
    saved = out[2] if (save or keep) else {}
    o = () if final_only else (_split_tok(call, out[0], B),)
    return o + (_split(out[1], B, H),) + tuple(_split(saved[n], B, H) for n in saved_names(save, keep))


def _backward_block(static, q, k, v, beta, g, h0, flags, do, dfin, *saved):
    """The backward kernels on one block of batch rows and heads (split layout in and out):
    dq, dk, dv, dbeta, dg, d h0. ``static``: (the backward's :class:`.paths.Chosen`, the names of
    ``saved``)."""
    chosen, names = static
    B, H = beta.shape[:2]
    call = _local(chosen.call, B, H)
    q, k, v, beta, g, h0 = _merge(call, q, k, v, beta, g, h0)
    if call.layout == "hm":
        do = do.reshape(B * H, *do.shape[2:])
    dfin = dfin.reshape(B * H, *dfin.shape[2:])
    res = {n: x.reshape(B * H, *x.shape[2:]) for n, x in zip(names, saved)} or None
    terms, terms_vjp = jax.vjp(lambda b, g: gate_terms(call, b, g), beta, g)
    dq, dk, dv, *dterms, dh0, _ = backward(call, (q, k, v, *terms, h0, flags), (do, dfin), saved=res,
                                           path=chosen.path)
    dbeta, dg = terms_vjp(tuple(dterms))
    return (_split_tok(call, dq, B), _split_tok(call, dk, B), _split_tok(call, dv, B), _split(dbeta, B, H),
            _split(dg, B, H), _split(dh0, B, H))


def _run_forward(route, q, k, v, beta, g, h0, flags, save=False, keep=False, final_only=False):
    """The forward kernels through :func:`.partition.run_sharded`: (o, final, residual dict); o is
    None with ``final_only``."""
    cf = route[0].call
    qk, vo = _TOK[cf.layout]
    n = len(saved_names(save, keep))
    static = (route[0], save, keep) + ((True,) if final_only else ())
    out_labels = (() if final_only else (vo,)) + ("bv*",) + ("bv*",) * n
    outs = _partition.run_sharded(_forward_block, static, (q, k, v, beta, g, h0, flags),
                       (qk, qk, vo, "bv.", "bv.", "bv*", "."), out_labels, group=cf.group,
                       interpreted=_plat.interpreted(cf.platform))
    if final_only:
        outs = (None,) + tuple(outs)
    return outs[0], outs[1], dict(zip(saved_names(save, keep), outs[2:]))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def chunk_gated_delta_rule(route, q, k, v, beta, g, h0, flags_fwd, flags_bwd):
    """The chunked gated delta rule in Pallas kernels: ``(o, final_state f32 [B,H,nseq,K,V])``.

    ``route`` = the forward's and the backward's :class:`.paths.Chosen` (the kernel path of each
    direction and the :class:`KernelCall` it reads), each with its own chunk; the
    arrays in the split layout of :func:`to_kernel_inputs` (q, k, v as the kernels read them,
    head-major on TPU as [B,H,Tp,D]; beta and g [B,H,Tp] f32; h0 [B,H,nseq,K,V] f32);
    ``flags_*`` the per-chunk flags of each chunking. The kernels run through
    :func:`.partition.run_sharded`: under ``jit`` on sharded inputs each device runs its own batch
    rows and heads. The residuals are the inputs (the backward recomputes the rest) and, on the
    Hopper kernels, with ``HopperTuning.save_wy`` (:func:`saves_wy`) the forward's Aqk and T, with
    ``HopperTuning.save_states`` (:func:`saves_states`) the states entering each chunk and Vn (and,
    with both, W). Undifferentiated, the forward writes no residuals."""
    o, fin, _ = _run_forward(route, q, k, v, beta, g, h0, flags_fwd)
    return o, fin


def _fwd(route, q, k, v, beta, g, h0, flags_fwd, flags_bwd):
    save, keep = saves_wy(route), saves_states(route)
    o, fin, saved = _run_forward(route, q, k, v, beta, g, h0, flags_fwd, save, keep)
    return (o, fin), (q, k, v, beta, g, h0, flags_fwd, flags_bwd, saved)


def _bwd(route, res, cts):
    q, k, v, beta, g, h0, flags_fwd, flags_bwd, saved = res
    cb = route[1].call
    qk, vo = _TOK[cb.layout]
    names = tuple(sorted(saved))
    do, dfin = cts
    grads = _partition.run_sharded(_backward_block, (route[1], names), (q, k, v, beta, g, h0, flags_bwd, do, dfin,
                                                       *(saved[n] for n in names)),
                        (qk, qk, vo, "bv.", "bv.", "bv*", ".", vo, "bv*") + ("bv*",) * len(names),
                        (qk, qk, vo, "bv.", "bv.", "bv*"), group=cb.group, interpreted=_plat.interpreted(cb.platform))
    return (*grads, None, None)


chunk_gated_delta_rule.defvjp(_fwd, _bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def chunk_final_state(route, q, k, v, beta, g, h0, flags_fwd, flags_bwd):
    """:func:`chunk_gated_delta_rule`'s final state alone (``final_state f32 [B,H,nseq,K,V]``), from
    the forward kernels' final-state-only runs (:func:`.paths.run_final_state`: no o, and no
    query-side work where the path has that mode). Same arguments. Differentiable: the residuals are
    those of :func:`chunk_gated_delta_rule` (the Hopper forward keeps the same ones, from the same
    kernels without the output), the backward is its backward with a zero output cotangent."""
    _, fin, _ = _run_forward(route, q, k, v, beta, g, h0, flags_fwd, final_only=True)
    return fin


def _final_fwd(route, q, k, v, beta, g, h0, flags_fwd, flags_bwd):
    save, keep = saves_wy(route), saves_states(route)
    _, fin, saved = _run_forward(route, q, k, v, beta, g, h0, flags_fwd, save, keep, final_only=True)
    return fin, (q, k, v, beta, g, h0, flags_fwd, flags_bwd, saved)


def _final_bwd(route, res, dfin):
    v = res[2]
    # o has v's shape and dtype in the split layout (both in the kernels' input dtype, V padded alike)
    return _bwd(route, res, (jnp.zeros_like(v), dfin))


chunk_final_state.defvjp(_final_fwd, _final_bwd)


# ---------------------------------------------------------------------------
# from the public layout to the kernels' and back
# ---------------------------------------------------------------------------


def _pow2(d):
    return 1 << (int(d) - 1).bit_length()


def _in_dtype(*xs):
    """The dtype the kernels read q, k, v in: theirs if they agree on a supported one, else f32."""
    dts = {jnp.dtype(x.dtype) for x in xs}
    if len(dts) == 1:
        (dt,) = dts
        if dt in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32)):
            return dt
    return jnp.dtype(F32)


def _static_scale(scale, K):
    """The static float folded into the kernels, or None when ``scale`` is traced."""
    if scale is None:
        return float(K) ** -0.5
    if isinstance(scale, jax.core.Tracer):
        return None
    return float(np.asarray(scale))


@dataclasses.dataclass
class KernelInputs:
    """Kernel-ready inputs of one call: ``route`` (the forward's and backward's
    :class:`.paths.Chosen`: the kernel path of each direction and the :class:`KernelCall` its kernels
    read), ``args`` of :func:`chunk_gated_delta_rule` in its split layout (q, k, v; beta and g
    [B,H,Tp]; h0 [B,H,nseq,K,V]; the flags of each chunking), ``valid`` (False for a malformed traced
    ``cu_seqlens``) and ``finish(o, final)`` mapping its outputs back to [B, T, H, V] /
    [B | N, H, K, V] (o None: the final state alone). :meth:`kernel_args` gives the arrays in the kernels' own layout; ``calls``
    and ``paths`` the two calls and the two path names."""

    route: tuple
    args: tuple
    valid: jax.Array
    finish: Callable

    @property
    def calls(self) -> tuple:
        """(forward :class:`KernelCall`, backward KernelCall), as the chosen paths' kernels read them."""
        return tuple(c.call for c in self.route)

    @property
    def paths(self) -> tuple:
        """(forward path, backward path): the names of the :mod:`.paths` entries that run."""
        return tuple(c.path for c in self.route)

    def kernel_args(self, direction="fwd"):
        """``(call, inputs of forward/backward)`` of the forward or backward chunking (to time or
        test the kernels alone)."""
        i = 0 if direction == "fwd" else 1
        call = self.calls[i]
        q, k, v, beta, g, h0 = _merge(call, *self.args[:6])
        return call, (q, k, v, *gate_terms(call, beta, g), h0, self.args[6 + i])


def to_kernel_inputs(q, k, v, g, beta, *, scale=None, initial_state=None, cu_seqlens=None, use_qk_l2norm=False,
                     chunk_size=64, config: KernelConfig = KernelConfig()) -> KernelInputs:
    """Plain-JAX preparation (differentiable): normalisation, head-dim padding, the time layout,
    head-major per-token scalars, the two directions' :class:`KernelCall` and their kernel paths
    (:func:`.paths.choose_both`)."""
    p = config.platform or _plat.default_platform()
    if p == "gpu":
        _plat.silence_triton_deprecation_at_lowering()
    B, T, Hk, K0 = q.shape
    H, V0 = v.shape[2], v.shape[-1]  # value heads (grouped value heads: H = group * Hk)
    G = H // Hk
    in_dt = out_dt = _in_dtype(q, k, v)
    if (in_dt == jnp.dtype(F32) and config.precision.f32_inputs == "bf16") or (
            in_dt == jnp.dtype(jnp.float16) and config.precision.f16_inputs == "bf16"):
        in_dt = jnp.dtype(jnp.bfloat16)  # Precision.f32_inputs / f16_inputs: the kernels read bf16 operands
    Cb = kernel_chunk(config, p, "bwd", chunk_size, max(K0, V0), in_dt)
    Cf = kernel_chunk(config, p, "fwd", chunk_size, max(K0, V0), in_dt)
    C = max(Cf, Cb)  # the time layout is built for the larger chunk (powers of two: the smaller divides it)

    sc = _static_scale(scale, K0)
    q, k, v, g, beta = prepare(q, k, v, g, beta, scale, use_qk_l2norm, F32, qkv_dtype=in_dt,
                               fold_scale=sc is None)
    sc = 1.0 if sc is None else sc

    # head dims: zero-pad to a power of two (exact: zero channels never mix in)
    K, V = max(16, _pow2(K0)), max(16, _pow2(V0))
    if K != K0:
        q, k = (jnp.pad(x, [(0, 0)] * 3 + [(0, K - K0)]) for x in (q, k))
    if V != V0:
        v = jnp.pad(v, [(0, 0)] * 3 + [(0, V - V0)])

    (q, k, v, g, beta), Tp, packing, valid = _packing.to_chunk_layout((q, k, v, g, beta), cu_seqlens, C)
    packed = packing is not None
    if packed:
        N = cu_seqlens.shape[0] - 1
        flags = _packing.chunk_flags(*packing[1:])
        flags_f, flags_b = (_packing.split_chunk_flags(flags, C // Cf), _packing.split_chunk_flags(flags, C // Cb))
    else:
        N = 1
        flags_f = flags_b = jnp.zeros((1,), jnp.int32)
    BH = B * H
    tpu = _plat.is_tpu_layout(p)
    # the split layout (batch and heads on axes of their own; the kernel layout merges them per
    # device, see _merge): per-token scalars head-major [B,H,Tp] (tiny arrays; XLA), on TPU q, k,
    # v [B,H,Tp,D]
    g_bh, beta_bh = jnp.moveaxis(g, 2, 1), jnp.moveaxis(beta, 2, 1)
    if tpu:
        q, k, v = (jnp.moveaxis(x, 2, 1) for x in (q, k, v))

    # states: [B, H, nseq, K, V] (B = 1, nseq = N with cu_seqlens)
    if initial_state is None:
        h0 = jnp.zeros((B, H, N, K, V), F32)
    else:
        h0 = initial_state.astype(F32)
        if K != K0 or V != V0:
            h0 = jnp.pad(h0, [(0, 0), (0, 0), (0, K - K0), (0, V - V0)])
        h0 = h0[:, :, None] if not packed else jnp.swapaxes(h0, 0, 1)[None]

    mk = lambda c: resolve(config, platform=p, C=c, n=Tp // c, BH=BH, H=H, K=K, V=V, K0=K0, V0=V0, scale=sc,
                           in_dt=in_dt, packed=packed, nseq=N, group=G, unit_keys=use_qk_l2norm)

    def finish(o, fin):  # o None: the final state alone (chunk_final_state)
        if o is not None:
            if tpu:
                o = jnp.moveaxis(o, 1, 2)
            o = _packing.from_chunk_layout(o, T, packing).astype(out_dt)
            if V != V0:
                o = o[..., :V0]
        fin = fin.reshape(B, H, K, V) if not packed else jnp.swapaxes(fin.reshape(H, N, K, V), 0, 1)
        if K != K0 or V != V0:
            fin = fin[:, :, :K0, :V0]
        return o, fin

    route = _paths.choose_both(mk(Cf), mk(Cb))
    return KernelInputs(route, (q, k, v, beta_bh, g_bh, h0, flags_f, flags_b), valid, finish)
