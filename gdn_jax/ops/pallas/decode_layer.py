"""Fused decode of one Gated DeltaNet layer: everything between the input and the output projection
of one token in one Pallas kernel.

The layer's six input projections are one matmul whose output ``proj [B, N]`` holds, in this
order (:func:`segments`), ``q [Hk*K] | k [Hk*K] | v [H*V] | z [H*V] | a [H or H*K] | b [H or H*V]``
(``z`` the output gate's pre-activation, ``a`` the decay's, absent with ``decay="none"``, ``b``
beta's). Per batch row and value head h (key head ``h // (H // Hk)``, grouped value heads) the
kernel then runs, in float32::

    q, k, v <- silu(conv(conv state, proj))      short causal conv, conv state shifted by one token
    q, k    <- L2-normalised, q * scale
    g        = -exp(A_log) softplus(a + dt_bias)  (decay "mamba2", capped at -1e4), log sigmoid(a)
               ("sigmoid") or 0 ("none"); per head or per key channel
    beta     = sigmoid(b) (x2 with negative eigenvalues); per head or per value channel
    S       <- exp(g) S;  S <- S + k (beta (v - S^T k))^T;  o = S^T q
    y        = RMSNorm(o) * norm_weight * silu(z)            (the gated output norm, over V)

and writes ``y [B, H*V]`` (the output projection's input, in ``proj``'s dtype), the new state (in
``state_dtype``) and the three new conv states. The formulas and their order are those of
:meth:`gdn_jax.layers.GatedDeltaNet.decode` (its projections, :class:`~gdn_jax.layers.conv.ShortConv`,
:meth:`~gdn_jax.layers.GatedDeltaNet.gates`, :func:`gdn_jax.ops.gated_delta_rule_step`, the gated
RMSNorm); only the roundings differ (the conv, SiLU and the read stay in float32 here instead of
the compute dtype).

Platforms: GPU through the Triton lowering (one program per batch row and value head, the whole
``[K, V]`` state block; segments read straight from ``proj`` through the block index maps, so their
offsets must be multiples of their block sizes, :func:`covers`; the state updated in column chunks
of ``bv``); TPU (Mosaic; ``"tpu"`` /
``"tpu_interpret"``): one program per batch row holding every head, the segments sliced and
reshaped to head-major blocks by XLA; CPU in interpret mode (the GPU program).

What it does not take (:func:`covers` names the reason; the layer then keeps the per-op path):
layers without a short conv (or ``conv_size`` 1), head dims other than powers of two from 16 to 256,
and Kimi Delta Attention (its low-rank gates need a second matmul before the kernel).
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Dict, Optional, Tuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from .._common import L2NORM_EPS
from . import platform as _plat

F32 = jnp.float32
MAX_DECAY_RATE = 1e4  # as gdn_jax.layers.gated_deltanet.MAX_DECAY_RATE (the ops package does not import layers)
DECAYS = ("mamba2", "sigmoid", "none")


@dataclasses.dataclass(frozen=True)
class LayerSpec:
    """The static description of a layer's fused decode (hashable).

    Attributes:
      Hk, H: key and value heads (H a multiple of Hk). K, V: head dims. W: the conv kernel size.
      decay: "mamba2", "sigmoid" or "none". g_per_channel: one decay per key channel.
      beta_per_channel: one beta per value channel. neg_eigval: beta = 2 sigmoid(b).
      scale: the query scale (a Python float). norm_eps: the output RMSNorm's epsilon.
    """

    Hk: int
    H: int
    K: int
    V: int
    W: int
    decay: str = "mamba2"
    g_per_channel: bool = False
    beta_per_channel: bool = False
    neg_eigval: bool = False
    scale: float = 1.0
    norm_eps: float = 1e-6

    @property
    def group(self) -> int:
        return self.H // self.Hk

    @property
    def ga(self) -> int:
        return self.K if self.g_per_channel else 1

    @property
    def gb(self) -> int:
        return self.V if self.beta_per_channel else 1


def segments(spec: LayerSpec) -> Dict[str, Tuple[int, int]]:
    """``{name: (offset, size)}`` of the fused projection's columns, in order q, k, v, z, a, b
    (``a`` absent with decay "none")."""
    sizes = [("q", spec.Hk * spec.K), ("k", spec.Hk * spec.K), ("v", spec.H * spec.V), ("z", spec.H * spec.V)]
    if spec.decay != "none":
        sizes.append(("a", spec.H * spec.ga))
    sizes.append(("b", spec.H * spec.gb))
    out, off = {}, 0
    for name, n in sizes:
        out[name] = (off, n)
        off += n
    return out


def proj_width(spec: LayerSpec) -> int:
    """N, the fused projection's width."""
    off, n = list(segments(spec).values())[-1]
    return off + n


def covers(spec: LayerSpec, dtype, state_dtype) -> Optional[str]:
    """None when the fused layer kernel takes this layer, else the reason (a phrase)."""
    if spec.decay not in DECAYS:
        return f"decay {spec.decay!r}"
    if spec.W < 2:
        return f"conv_size {spec.W} (the kernel shifts a conv state of conv_size - 1 >= 1 tokens)"
    for name, d in (("K", spec.K), ("V", spec.V)):
        if d < 16 or d > 256 or d & (d - 1):
            return f"head dim {name}={d} (needs a power of two from 16 to 256)"
    if spec.H % spec.Hk:
        return f"{spec.H} value heads for {spec.Hk} key heads (needs a multiple)"
    for name, dt in (("compute", dtype), ("state", state_dtype)):
        if jnp.dtype(dt) not in (jnp.dtype(F32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
            return f"{name} dtype {jnp.dtype(dt)} (needs float32, bfloat16 or float16)"
    blocks = dict(q=spec.K, k=spec.K, v=spec.V, z=spec.V, a=spec.ga, b=spec.gb)
    for name, (off, _) in segments(spec).items():
        if off % blocks[name]:
            return (f"projection segment {name} at column {off}, not a multiple of its block {blocks[name]} "
                    f"(head counts and dims that do not tile the fused projection)")
    return None


# ----------------------------------------------------------------------------- shared math
def _softplus(x):
    return jnp.maximum(x, 0.0) + jnp.log1p(jnp.exp(-jnp.abs(x)))


def _log_decay(spec: LayerSpec, a, A_log, dt_bias):
    """g (float32) from the decay pre-activation a (float32), as the layer's gates()."""
    if spec.decay == "none":
        return jnp.zeros_like(a)
    if spec.decay == "sigmoid":
        return -_softplus(-a)
    z = a + dt_bias
    small = z < -20.0
    log_sp = jnp.where(small, z, jnp.log(_softplus(jnp.where(small, 0.0, z))))
    return -jnp.exp(jnp.minimum(A_log + log_sp, math.log(MAX_DECAY_RATE)))


def _beta(spec: LayerSpec, b):
    beta = jax.nn.sigmoid(b)
    return 2.0 * beta if spec.neg_eigval else beta


def _silu(x):
    return x * jax.nn.sigmoid(x)


# ----------------------------------------------------------------------------- GPU / interpret
def _kernel(*refs, spec: LayerSpec, bv: int):
    """One (batch row, value head) program; refs in :func:`_gpu_call`'s order. The state block
    ``[K, V]`` is updated in column chunks of ``bv`` (fewer live registers on a GPU); the read's
    chunks are kept for the RMSNorm over all of V."""
    it = iter(refs)
    pq, pk, pv, pz = next(it), next(it), next(it), next(it)
    pa = next(it) if spec.decay != "none" else None
    pb = next(it)
    cq, ck, cv, wq, wk, wv = (next(it) for _ in range(6))
    A_ref = next(it) if spec.decay == "mamba2" else None
    dtb_ref = next(it) if spec.decay == "mamba2" else None
    nw_ref, s_ref = next(it), next(it)
    y_ref, ns_ref, cq_o, ck_o, cv_o = (next(it) for _ in range(5))
    W, V = spec.W, spec.V

    def conv(c_ref, w_ref, x_ref, cols=slice(None)):
        x = x_ref[cols].astype(F32)
        acc = x * w_ref[W - 1, cols].astype(F32)
        for i in range(W - 1):
            acc = acc + c_ref[i, cols].astype(F32) * w_ref[i, cols].astype(F32)
        return _silu(acc)

    def shift(c_ref, x_ref, o_ref):
        for i in range(W - 2):
            o_ref[i, :] = c_ref[i + 1, :]
        o_ref[W - 2, :] = x_ref[...].astype(o_ref.dtype)

    q, k = conv(cq, wq, pq), conv(ck, wk, pk)
    q = q * jax.lax.rsqrt(jnp.sum(q * q) + L2NORM_EPS) * spec.scale
    k = k * jax.lax.rsqrt(jnp.sum(k * k) + L2NORM_EPS)
    a = pa[...].astype(F32) if pa is not None else jnp.zeros((1,), F32)
    decay = jnp.exp(_log_decay(spec, a, None if A_ref is None else A_ref[...].astype(F32),
                               None if dtb_ref is None else dtb_ref[...].astype(F32)))[:, None]  # [1 | K, 1]
    outs, sq = [], 0.0
    for j in range(V // bv):
        cols = slice(j * bv, (j + 1) * bv)
        v = conv(cv, wv, pv, cols)
        beta = _beta(spec, pb[...].astype(F32) if spec.gb == 1 else pb[cols].astype(F32))  # [1] or [bv]
        S = s_ref[:, cols].astype(F32) * decay
        pred = jnp.sum(S * k[:, None], axis=0)
        S = S + k[:, None] * (beta * (v - pred))[None, :]
        o = jnp.sum(S * q[:, None], axis=0)
        ns_ref[:, cols] = S.astype(ns_ref.dtype)
        outs.append(o)
        sq = sq + jnp.sum(o * o)
    inv = jax.lax.rsqrt(sq / V + spec.norm_eps)
    for j, o in enumerate(outs):
        cols = slice(j * bv, (j + 1) * bv)
        y = o * inv * nw_ref[cols].astype(F32) * _silu(pz[cols].astype(F32))
        y_ref[cols] = y.astype(y_ref.dtype)
    shift(cv, pv, cv_o)

    @pl.when(pl.program_id(0) % spec.group == 0)  # the first value head of a key head writes its q, k convs
    def _():
        shift(cq, pq, cq_o)
        shift(ck, pk, ck_o)


def _gpu_call(p, spec: LayerSpec, state_dtype, num_warps, bv, proj, convs, conv_w, A_log, dt_bias, norm_w, state):
    B = proj.shape[0]
    Hk, H, K, V, W, G = spec.Hk, spec.H, spec.K, spec.V, spec.W, spec.group
    seg = segments(spec)

    def col(name, size, head):
        base = seg[name][0] // size
        return pl.BlockSpec((None, size), lambda i: (i // H, base + head(i)))

    kh, vh = (lambda i: (i % H) // G), (lambda i: i % H)
    args, specs = [proj] * 4, [col("q", K, kh), col("k", K, kh), col("v", V, vh), col("z", V, vh)]
    if spec.decay != "none":
        args.append(proj)
        specs.append(col("a", spec.ga, vh))
    args.append(proj)
    specs.append(col("b", spec.gb, vh))
    conv_specs = [pl.BlockSpec((None, W - 1, n), lambda i, h=h: (i // H, 0, h(i))) for n, h in ((K, kh), (K, kh), (V, vh))]
    w_specs = [pl.BlockSpec((W, n), lambda i, h=h: (0, h(i))) for n, h in ((K, kh), (K, kh), (V, vh))]
    conv_at = len(args)
    args += list(convs) + list(conv_w)
    specs += conv_specs + w_specs
    if spec.decay == "mamba2":
        args += [A_log, dt_bias]
        specs += [pl.BlockSpec((1,), lambda i: (i % H,)), pl.BlockSpec((spec.ga,), lambda i: (i % H,))]
    args += [norm_w, state]
    specs += [pl.BlockSpec((V,), lambda i: (0,)), pl.BlockSpec((None, None, K, V), lambda i: (i // H, i % H, 0, 0))]
    out_specs = [pl.BlockSpec((None, V), lambda i: (i // H, i % H)),
                 pl.BlockSpec((None, None, K, V), lambda i: (i // H, i % H, 0, 0))] + conv_specs
    out_shape = [jax.ShapeDtypeStruct((B, H * V), proj.dtype), jax.ShapeDtypeStruct((B, H, K, V), jnp.dtype(state_dtype))]
    out_shape += [jax.ShapeDtypeStruct(c.shape, c.dtype) for c in convs]
    aliases = {len(args) - 1: 1} if jnp.dtype(state.dtype) == jnp.dtype(state_dtype) else {}
    # The conv states are updated in place too: a loop-carried cache written to a new buffer is
    # copied back into the carry every step (on one H100, 24 device copies per token of the 8-layer
    # seed model, 32 µs of 379). The v conv is one value head's block: always safe. The q / k convs
    # of a key head are read by all its value heads' programs and written by the first, so with
    # grouped value heads (G > 1) another program could read the shifted state: aliased only at G = 1.
    aliases[conv_at + 2] = 4
    if G == 1:
        aliases.update({conv_at: 2, conv_at + 1: 3})
    fn = pl.pallas_call(functools.partial(_kernel, spec=spec, bv=bv), out_shape=out_shape, grid=(B * H,), in_specs=specs,
                        out_specs=out_specs, input_output_aliases=aliases, name="gdn_decode_layer",
                        **_plat.call_kwargs(p, num_warps=num_warps, num_stages=1, n_grid=1))
    return _plat.invoke(p, fn, *args)


# ----------------------------------------------------------------------------- TPU
def _kernel_heads(*refs, spec: LayerSpec):
    """TPU: every head of one batch row: q, k [Hk, K], v, z [H, V], a [H, ga], b [H, gb], convs
    [W-1, Hk | H, K | V], conv weights [W, Hk | H, K | V], A_log [H, 1], dt_bias [H, ga], norm
    weight [1, V], state [H, K, V]."""
    it = iter(refs)
    pq, pk, pv, pz = next(it), next(it), next(it), next(it)
    pa = next(it) if spec.decay != "none" else None
    pb = next(it)
    cq, ck, cv, wq, wk, wv = (next(it) for _ in range(6))
    A_ref = next(it) if spec.decay == "mamba2" else None
    dtb_ref = next(it) if spec.decay == "mamba2" else None
    nw_ref, s_ref = next(it), next(it)
    y_ref, ns_ref, cq_o, ck_o, cv_o = (next(it) for _ in range(5))
    W, G = spec.W, spec.group

    def conv(c_ref, w_ref, x_ref, o_ref):
        x = x_ref[...].astype(F32)
        acc = x * w_ref[W - 1].astype(F32)
        for i in range(W - 1):
            acc = acc + c_ref[i].astype(F32) * w_ref[i].astype(F32)
        for i in range(W - 2):
            o_ref[i] = c_ref[i + 1]
        o_ref[W - 2] = x_ref[...].astype(o_ref.dtype)
        return _silu(acc)

    q, k, v = conv(cq, wq, pq, cq_o), conv(ck, wk, pk, ck_o), conv(cv, wv, pv, cv_o)
    q = q * jax.lax.rsqrt(jnp.sum(q * q, axis=-1, keepdims=True) + L2NORM_EPS) * spec.scale
    k = k * jax.lax.rsqrt(jnp.sum(k * k, axis=-1, keepdims=True) + L2NORM_EPS)
    if G > 1:  # value head j reads key head j // G
        Hk, K = q.shape
        q, k = (jnp.broadcast_to(x[:, None, :], (Hk, G, K)).reshape(Hk * G, K) for x in (q, k))
    beta = _beta(spec, pb[...].astype(F32))
    a = pa[...].astype(F32) if pa is not None else jnp.zeros(beta.shape[:1] + (1,), F32)
    g = _log_decay(spec, a, None if A_ref is None else A_ref[...].astype(F32),
                   None if dtb_ref is None else dtb_ref[...].astype(F32))
    S = s_ref[...].astype(F32) * jnp.exp(g)[:, :, None]  # g: [H, 1] or [H, K]
    pred = jnp.sum(S * k[:, :, None], axis=1)
    S = S + k[:, :, None] * (beta * (v - pred))[:, None, :]  # beta: [H, 1] or [H, V]
    o = jnp.sum(S * q[:, :, None], axis=1)
    ns_ref[...] = S.astype(ns_ref.dtype)
    o = o * jax.lax.rsqrt(jnp.mean(o * o, axis=-1, keepdims=True) + spec.norm_eps) * nw_ref[...].astype(F32)
    y_ref[...] = (o * _silu(pz[...].astype(F32))).astype(y_ref.dtype)


def _tpu_call(p, spec: LayerSpec, state_dtype, proj, convs, conv_w, A_log, dt_bias, norm_w, state):
    B = proj.shape[0]
    Hk, H, K, V, W = spec.Hk, spec.H, spec.K, spec.V, spec.W
    seg = segments(spec)
    part = lambda name, heads, d: jax.lax.slice_in_dim(proj, seg[name][0], seg[name][0] + seg[name][1],
                                                       axis=1).reshape(B, heads, d)
    args = [part("q", Hk, K), part("k", Hk, K), part("v", H, V), part("z", H, V)]
    if spec.decay != "none":
        args.append(part("a", H, spec.ga))
    args.append(part("b", H, spec.gb))
    shapes = ((Hk, K), (Hk, K), (H, V))
    args += [c.reshape(B, W - 1, *s) for c, s in zip(convs, shapes)]
    args += [w.reshape(W, *s) for w, s in zip(conv_w, shapes)]
    if spec.decay == "mamba2":
        args += [A_log.reshape(H, 1), dt_bias.reshape(H, spec.ga)]
    args += [norm_w.reshape(1, V), state]
    row = lambda x: pl.BlockSpec((None,) + x.shape[1:], lambda b, n=x.ndim - 1: (b,) + (0,) * n)
    whole = lambda x: pl.BlockSpec(x.shape, lambda b, n=x.ndim: (0,) * n)
    n_rows = 4 + (spec.decay != "none") + 1
    specs = [row(x) for x in args[:n_rows + 3]] + [whole(x) for x in args[n_rows + 3:-1]] + [row(args[-1])]
    conv_out = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in args[n_rows:n_rows + 3]]
    out_shape = [jax.ShapeDtypeStruct((B, H, V), proj.dtype),
                 jax.ShapeDtypeStruct((B, H, K, V), jnp.dtype(state_dtype))] + conv_out
    out_specs = [row(x) for x in out_shape]
    aliases = {len(args) - 1: 1} if jnp.dtype(state.dtype) == jnp.dtype(state_dtype) else {}
    aliases.update({n_rows + i: 2 + i for i in range(3)})  # the conv states in place (one program per row)
    blocks = [(s, x.dtype) for s, x in zip(specs, args)] + [(s, x.dtype) for s, x in zip(out_specs, out_shape)]
    fn = pl.pallas_call(functools.partial(_kernel_heads, spec=spec), out_shape=out_shape, grid=(B,), in_specs=specs,
                        out_specs=out_specs, input_output_aliases=aliases, name="gdn_decode_layer_tpu",
                        **_plat.call_kwargs(p, num_warps=4, num_stages=1, n_grid=1, blocks=blocks))
    y, ns, *cs = _plat.invoke(p, fn, *args)
    return (y.reshape(B, H * V), ns) + tuple(c.reshape(x.shape) for c, x in zip(cs, convs))


# ----------------------------------------------------------------------------- XLA form (the VJP)
def reference(proj, conv_states, conv_weights, A_log, dt_bias, norm_weight, state, *, spec: LayerSpec, state_dtype):
    """The kernel's computation in plain ``jax.numpy`` (same arguments and results as
    :func:`decode_layer`, same float32 math and order of operations up to summation order); the
    kernel's reverse-mode derivative is this function's (:func:`decode_layer` is a ``custom_vjp``:
    the Pallas call aliases its state and conv buffers, which Pallas cannot differentiate)."""
    B = proj.shape[0]
    Hk, H, K, V, G = spec.Hk, spec.H, spec.K, spec.V, spec.group
    seg = {n: proj[:, o:o + m] for n, (o, m) in segments(spec).items()}

    def conv(c, w, x):  # conv state [B, W-1, C] (oldest first) and the token [B, C] against w [W, C]
        acc = x.astype(F32) * w[-1].astype(F32)
        for i in range(spec.W - 1):
            acc = acc + c[:, i].astype(F32) * w[i].astype(F32)
        return _silu(acc), jnp.concatenate([c[:, 1:], x[:, None].astype(c.dtype)], axis=1)

    (q, cq), (k, ck), (v, cv) = (conv(c, w, seg[n]) for c, w, n in zip(conv_states, conv_weights, "qkv"))
    q, k, v = q.reshape(B, Hk, K), k.reshape(B, Hk, K), v.reshape(B, H, V)
    q = q * jax.lax.rsqrt(jnp.sum(q * q, -1, keepdims=True) + L2NORM_EPS) * spec.scale
    k = k * jax.lax.rsqrt(jnp.sum(k * k, -1, keepdims=True) + L2NORM_EPS)
    q, k = jnp.repeat(q, G, axis=1), jnp.repeat(k, G, axis=1)  # [B, H, K]: value head h reads key head h // G
    a = seg["a"].astype(F32).reshape(B, H, spec.ga) if spec.decay != "none" else jnp.zeros((B, H, 1), F32)
    g = _log_decay(spec, a, None if A_log is None else A_log.astype(F32)[:, None],
                   None if dt_bias is None else dt_bias.astype(F32).reshape(H, spec.ga))
    beta = _beta(spec, seg["b"].astype(F32).reshape(B, H, spec.gb))  # [B, H, 1 | V]
    S = state.astype(F32) * jnp.exp(g)[..., None]  # [B, H, K, V]
    pred = jnp.sum(S * k[..., None], axis=2)
    S = S + k[..., None] * (beta * (v - pred))[:, :, None, :]
    o = jnp.sum(S * q[..., None], axis=2)  # [B, H, V]
    o = o * jax.lax.rsqrt(jnp.mean(o * o, -1, keepdims=True) + spec.norm_eps)
    y = o * norm_weight.astype(F32) * _silu(seg["z"].astype(F32).reshape(B, H, V))
    return y.reshape(B, H * V).astype(proj.dtype), S.astype(state_dtype), (cq, ck, cv)


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8, 9, 10, 11))
def _kernel_call(proj, conv_states, conv_weights, A_log, dt_bias, norm_weight, state, spec, state_dtype, p,
                 num_warps, bv):
    args = (proj, conv_states, conv_weights, A_log, dt_bias, norm_weight, state)
    if _plat.is_tpu_layout(p):
        y, ns, *cs = _tpu_call(p, spec, state_dtype, *args)
    else:
        y, ns, *cs = _gpu_call(p, spec, state_dtype, num_warps, bv, *args)
    return y, ns, tuple(cs)


def _kernel_call_fwd(proj, conv_states, conv_weights, A_log, dt_bias, norm_weight, state, spec, state_dtype, p,
                     num_warps, bv):
    args = (proj, conv_states, conv_weights, A_log, dt_bias, norm_weight, state)
    return _kernel_call(*args, spec, state_dtype, p, num_warps, bv), args


def _kernel_call_bwd(spec, state_dtype, p, num_warps, bv, args, ct):
    _, vjp = jax.vjp(lambda *a: reference(*a, spec=spec, state_dtype=state_dtype), *args)
    return vjp(ct)


_kernel_call.defvjp(_kernel_call_fwd, _kernel_call_bwd)


# ----------------------------------------------------------------------------- entry point
def decode_layer(proj, conv_states, conv_weights, A_log, dt_bias, norm_weight, state, *, spec: LayerSpec,
                 state_dtype, platform: Optional[str] = None, num_warps: int = 4, bv: Optional[int] = None):
    """One token of a Gated DeltaNet layer after its fused input projection (see the module docstring).

    Args:
      proj: ``[B, N]`` the fused projection of the token (:func:`segments`; N = :func:`proj_width`),
        in the compute dtype.
      conv_states: ``(conv_q [B, W-1, Hk*K], conv_k [B, W-1, Hk*K], conv_v [B, W-1, H*V])``
        (aliased to the new conv states, as the state: conv_v always, conv_q and conv_k where every
        key head has one value head; on TPU all three).
      conv_weights: the short convs' weights ``([W, Hk*K], [W, Hk*K], [W, H*V])``.
      A_log: ``[H]``; dt_bias: ``[H]`` or ``[H*K]`` (decay "mamba2"; None otherwise).
      norm_weight: ``[V]``, the output RMSNorm's weight.
      state: ``[B, H, K, V]``, any of float32 / bfloat16 / float16 (aliased to the new state when it
        is already in ``state_dtype``: donate it under ``jax.jit`` to update in place).
      spec: the layer's :class:`LayerSpec`; state_dtype: the new state's dtype.
      platform: the kernel platform (None: that of ``jax.default_backend()``). num_warps: GPU warps
        per program. bv: the GPU program's column chunk of the state (a power of two dividing V;
        None: ``min(V, 64)``, the block of the step kernel :mod:`.decode`).

    Returns:
      ``(y [B, H*V] in proj.dtype, new state [B, H, K, V] in state_dtype, (conv_q, conv_k, conv_v)
      shifted by the token, in their dtypes)``.

    Differentiable in reverse mode (``jax.grad`` / ``jax.vjp``): the derivative is that of
    :func:`reference`, the same computation in plain ``jax.numpy``, at the same inputs (the kernel
    aliases its buffers, which Pallas cannot differentiate; under differentiation XLA copies the
    state instead of updating it in place). Forward mode (``jax.jvp``) raises ``TypeError``.

    Raises:
      NotImplementedError: a layer :func:`covers` does not take (naming why).
      ValueError: arrays whose shapes do not fit ``spec``.
    """
    reason = covers(spec, proj.dtype, state_dtype)
    if reason is not None:
        raise NotImplementedError(f"the fused decode layer kernel does not take {reason}")
    B = proj.shape[0]
    Hk, H, K, V, W = spec.Hk, spec.H, spec.K, spec.V, spec.W
    want = [("proj", proj, (B, proj_width(spec))), ("conv_q", conv_states[0], (B, W - 1, Hk * K)),
            ("conv_k", conv_states[1], (B, W - 1, Hk * K)), ("conv_v", conv_states[2], (B, W - 1, H * V)),
            ("conv weight q", conv_weights[0], (W, Hk * K)), ("conv weight k", conv_weights[1], (W, Hk * K)),
            ("conv weight v", conv_weights[2], (W, H * V)), ("norm_weight", norm_weight, (V,)),
            ("state", state, (B, H, K, V))]
    if spec.decay == "mamba2":
        want += [("A_log", A_log, (H,)), ("dt_bias", dt_bias, (H * spec.ga,))]
    for name, x, shape in want:
        if tuple(x.shape) != shape:
            raise ValueError(f"{name} must have shape {shape}, got {tuple(x.shape)}")
    p = platform or _plat.default_platform()
    if not _plat.is_tpu_layout(p):
        bv = min(V, 64) if bv is None else bv
        if bv < 1 or bv & (bv - 1) or V % bv:
            raise ValueError(f"bv must be a power of two dividing V = {V}, got {bv}")
    return _kernel_call(proj, tuple(conv_states), tuple(conv_weights), A_log, dt_bias, norm_weight, state, spec,
                        jnp.dtype(state_dtype), p, num_warps, bv)
