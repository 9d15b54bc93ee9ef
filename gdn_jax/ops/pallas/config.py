"""Kernel configuration of ``backend="pallas"``: the user's options (:class:`KernelConfig`: platform
and chunks, and the groups :class:`Precision` (here), :class:`~.tuning.TritonTuning` and
:class:`~.hopper.tuning.HopperTuning`, each beside the kernels that read it) and the one place that
turns them, with the call's platform, shapes and dtype, into the concrete settings every kernel
reads (:func:`kernel_chunk`, :func:`resolve` -> :class:`KernelCall`).

Nothing here is global or mutable: a :class:`KernelConfig` is a frozen, hashable value passed
to ``gated_delta_rule(..., kernel_config=...)``, so ``jax.jit`` keys its cache on it like on any
other static argument. None of its fields changes the result beyond floating-point rounding. The
measurements behind the defaults are in docs/kernels.md ("Options in detail"), in
``results/hopper_h200/`` (KERNELS.md option by option, NOTE.md, HISTORY.md) and in
``results/bench_pallas_h200/``.
"""
from __future__ import annotations

import dataclasses
import difflib
import sys
import warnings
from typing import Optional, Union

import jax
import jax.numpy as jnp
import numpy as np

from .call import KernelCall
from .checks import check_bool, check_choice, check_int
from .hopper.tuning import HopperTuning, HopperVariants
from .tuning import TritonTuning
from .platform import PLATFORMS, is_tpu_layout

F32 = jnp.float32
SUPPORTED_CHUNK_SIZES = (16, 32, 64, 128)  # chunk sizes the kernels take (forward and backward)
MAX_DIM = 256  # largest head dim K or V the kernels take

# Largest kernel chunk per platform and head dim max(K, V), as ((largest head dim, largest chunk),
# ...). The chunked form is exact, so the kernels may run at a smaller chunk than ``chunk_size``.
# GPU backward: at C = 64 the gradient kernel's C x C tiles spill registers (H200, D = 128:
# backward 6.4 ms at C = 64, 3.1-3.3 ms at C = 32). The forward kernels have no such tiles and
# the backward recomputes what it needs from the inputs, so the forward runs at its own, larger
# chunk for 16-bit inputs (half the sequential steps of the state pass: 1.02 vs 1.18 ms at
# B4 T4096 H16 D128); float32 inputs (3-pass TF32 dots) keep the backward's chunk. The Hopper
# backward (Mosaic GPU, hopper/) runs at 64 (:func:`kernel_chunk`).
_MAX_CHUNK = {
    ("gpu", "bwd"): ((128, 32), (256, 32)),
    ("gpu", "fwd"): ((128, 64), (256, 32)),
}
# Smallest max(K, V) at which bf16 inputs get bf16 intermediates (``mid_dtype="auto"``). Below it
# the bf16 rounding of W, U, Vn and the state dots is not averaged over enough channels (CPU,
# B2 T200 H2, chunk 64, g = 0, beta = 1.9, K = V = 16 / 32 vs the float64 reference: o 1.2e-2 /
# 9.2e-3 and dg 2.7e-2 with bf16 intermediates, 1.7e-3 with float32 ones); small heads are cheap
# either way (bound by reading q, k, v).
BF16_MID_MIN_DIM = 64

@dataclasses.dataclass(frozen=True)
class Precision:
    """Precision of the kernels (every path; they accumulate in float32 in every case).

    Attributes:
      mid_dtype: intermediates in HBM (W, Vn, h_n, dVl, dVn, dh_n) and operands of most dots:
        "auto" (bf16 for bf16 inputs with max(K, V) >= 64, else float32), "f32" or "bf16".
      u_dtype, state_dot, out_dot: U in HBM / the state passes' dot operands / the output dots'
        operands: "mid" (= mid_dtype) or "f32" (keeps U = W S + Vn wider: rel. rms of o 2.6e-3
        instead of 3.8e-3 at D = 128, 5-11 % slower).
      f32_inputs: float32 q, k, v "keep" (float32 kernels) or rounded to "bf16" (the 16-bit path).
      f16_inputs: float16 q, k, v "keep" (float16 Triton kernels) or "bf16" (the Hopper kernels too).
      gpu_f32_inv, gpu_f32_mm: Triton precision of float32 dots in the triangular inverse / the
        others: "tf32", "tf32x3" (~float32) or "ieee"; None: "tf32" (like XLA's float32 matmuls).

    Raises:
      TypeError / ValueError: a field outside its choices, naming it.
    """

    mid_dtype: str = "auto"
    u_dtype: str = "mid"
    state_dot: str = "mid"
    out_dot: str = "mid"
    f32_inputs: str = "keep"
    f16_inputs: str = "keep"
    gpu_f32_inv: Optional[str] = None
    gpu_f32_mm: Optional[str] = None

    def __post_init__(self):
        for name, ok in (("mid_dtype", ("auto", "f32", "bf16")), ("u_dtype", ("f32", "mid")),
                         ("state_dot", ("f32", "mid")), ("out_dot", ("f32", "mid")), ("f32_inputs", ("keep", "bf16")),
                         ("f16_inputs", ("keep", "bf16")), ("gpu_f32_inv", (None, "tf32", "tf32x3", "ieee")),
                         ("gpu_f32_mm", (None, "tf32", "tf32x3", "ieee"))):
            check_choice("Precision", name, getattr(self, name), ok)


_GROUPS = {"precision": Precision, "triton": TritonTuning, "hopper": HopperTuning}
# the group of each field of the groups, by its own name: the flat keywords of earlier releases
# (KernelConfig(mid_dtype=...), one release with a FutureWarning) and the benchmarks' command lines
FLAT_NAMES = dict(
    **{f.name: "precision" for f in dataclasses.fields(Precision)},
    **{f.name: "triton" for f in dataclasses.fields(TritonTuning)},
    **{f.name: "hopper" for f in dataclasses.fields(HopperTuning) if f.name != "variants"},
    **{f.name: "hopper.variants" for f in dataclasses.fields(HopperVariants)},
)
GROUP_CLASSES = dict(_GROUPS, **{"hopper.variants": HopperVariants})


@dataclasses.dataclass(frozen=True, init=False)
class KernelConfig:
    """Options of the Pallas kernels (``gated_delta_rule(..., backend="pallas", kernel_config=...)``):
    a frozen, hashable value; none changes the result beyond rounding. Every default is resolved per
    call by :func:`resolve` from the platform, head dims, dtype and batch * heads; the measurements
    behind them are in docs/kernels.md ("Options in detail").

    Attributes:
      platform: "gpu" (Triton / Mosaic GPU), "tpu" (Mosaic TPU), "interpret" (CPU, GPU code path) or
        "tpu_interpret" (CPU, TPU semantics); None: that of ``jax.default_backend()``.
      fwd_chunk, bwd_chunk: tokens per chunk of the forward / backward kernels (16, 32, 64 or 128,
        dividing one another); None: ``min(chunk_size, cap)`` per platform and head dim.
      gpu_kernels: "triton", "mosaic" (the Hopper kernels where they take the call) or None
        ("mosaic" on an sm_90 GPU); :mod:`gdn_jax.ops.pallas.paths` lists which kernels run.
      precision: :class:`Precision`.
      triton: :class:`~gdn_jax.ops.pallas.tuning.TritonTuning` (the portable kernels).
      hopper: :class:`~gdn_jax.ops.pallas.hopper.tuning.HopperTuning` (the Hopper kernels).
      keys_unit_norm: the caller promises that every key k_t it passes has L2 norm 1 (it normalised
        them itself, e.g. a layer with its own L2 norm); with ``use_qk_l2norm=True`` the op knows it
        anyway. Only the gate-free forward (``TritonTuning.gatefree``) reads it: its inverse T0 is
        bounded only for unit-norm keys (raw keys can overflow float32 there). Not checked (keys
        may be traced): a false promise can give inf / NaN. Default False.
      seq_split: the sequence split (:mod:`gdn_jax.ops.seq_split`): None (default: off), "auto"
        (the piece count of :func:`~gdn_jax.ops.pallas.split_plan.auto_pieces` from B, H, K, V, T,
        the chunk and the GPU's SM count; often 1, no split; never where the Hopper kernels run,
        whose measured splits all lost: ``split_plan.MEASURED_HOPPER``) or a power of two from 2
        to 64 (that many pieces a sequence, where each has >= 2 chunks; else declined). Every
        sequence is cut into pieces run as extra batch rows from their true entering states (state
        maps of one augmented call, a float32 scan), forward and backward. On one H100 with the
        Hopper kernels: 0.65-0.80x the unsplit forward, 0.48-0.63x forward+backward at
        1 x 16384 / 32768 x 16 x 128 (P = 2, 4, 8); on the Triton kernels unmeasured.
        ``forward_kernels`` / ``backward_kernels`` report the pieces (``KernelsReport.pieces``) and
        why the split did not run where asked (``split_reason``).

    Deprecated: the flat keywords of earlier releases (``KernelConfig(mid_dtype="f32", save_wy=False,
    bv_state=32, ...)``, one per field of the groups) still work for one release: each is moved into
    its group and a ``FutureWarning`` spells the grouped form of the keywords given; reading
    ``config.<flat name>`` works likewise.

    Raises:
      TypeError / ValueError: a field outside its choices (naming it), a group of the wrong type,
        or a keyword that is neither a field nor a flat name.
    """

    platform: Optional[str] = None
    fwd_chunk: Optional[int] = None
    bwd_chunk: Optional[int] = None
    gpu_kernels: Optional[str] = None
    precision: Precision = Precision()
    triton: TritonTuning = TritonTuning()
    hopper: HopperTuning = HopperTuning()
    seq_split: Optional[Union[int, str]] = None  # an int or "auto" (validated in __init__)
    keys_unit_norm: bool = False

    def __init__(self, platform: Optional[str] = None, fwd_chunk: Optional[int] = None,
                 bwd_chunk: Optional[int] = None, gpu_kernels: Optional[str] = None,
                 precision: Optional[Precision] = None, triton: Optional[TritonTuning] = None,
                 hopper: Optional[HopperTuning] = None, seq_split=None, keys_unit_norm: bool = False, **flat):
        groups = {"precision": precision, "triton": triton, "hopper": hopper}
        given = {name for name, val in groups.items() if val is not None}
        for name, cls in _GROUPS.items():
            if groups[name] is None:
                groups[name] = cls()
            elif not isinstance(groups[name], cls):
                raise TypeError(f"KernelConfig.{name} must be a {cls.__name__}, got {type(groups[name]).__name__}")
        if flat:
            unknown = sorted(set(flat) - set(FLAT_NAMES))
            if unknown:
                known = [f.name for f in dataclasses.fields(KernelConfig)] + list(FLAT_NAMES)
                near = {n: ["fwd_chunk' or 'bwd_chunk"] if n == "chunk_size" else difflib.get_close_matches(n, known, n=1)
                        for n in unknown}
                hint = "; ".join(f"{n!r}: did you mean '{m[0]}'?" for n, m in near.items() if m)
                raise TypeError(f"KernelConfig() got unexpected keyword arguments {unknown}" + (f" ({hint})" if hint else ""))
            level, frame = 2, sys._getframe(1)  # point at the user's line, past dataclasses.replace
            while frame is not None and frame.f_globals.get("__name__") == "dataclasses":
                level, frame = level + 1, frame.f_back
            warnings.warn(
                f"KernelConfig({', '.join(f'{n}=' for n in flat)}...): flat keywords are deprecated and will be "
                f"removed in the next release; write {_grouped_spelling(flat, given)} (docs/kernels.md)",
                FutureWarning, stacklevel=level)
            groups = _with_flat(groups, flat)
        for name, val in (("platform", platform), ("fwd_chunk", fwd_chunk), ("bwd_chunk", bwd_chunk),
                          ("gpu_kernels", gpu_kernels)):
            object.__setattr__(self, name, val)
        for name, val in groups.items():
            object.__setattr__(self, name, val)
        check_choice("KernelConfig", "platform", self.platform, (None,) + PLATFORMS)
        check_choice("KernelConfig", "gpu_kernels", self.gpu_kernels, (None, "triton", "mosaic"))
        object.__setattr__(self, "seq_split", _check_seq_split(seq_split))
        check_bool("KernelConfig", "keys_unit_norm", keys_unit_norm)
        object.__setattr__(self, "keys_unit_norm", keys_unit_norm)
        for name in ("fwd_chunk", "bwd_chunk"):
            val = check_int("KernelConfig", name, getattr(self, name), optional=True)
            if val is not None and val not in SUPPORTED_CHUNK_SIZES:
                raise ValueError(f"KernelConfig.{name} must be one of {SUPPORTED_CHUNK_SIZES} or None, got {val!r}")
            object.__setattr__(self, name, val)

    def __getattr__(self, name):
        """The deprecated flat names (``config.save_wy``): the group's field, with a FutureWarning."""
        group = FLAT_NAMES.get(name)
        if group is None or name.startswith("__"):
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        warnings.warn(f"KernelConfig.{name} is deprecated; read KernelConfig.{_path(name)}", FutureWarning,
                      stacklevel=2)
        return _flat_value(self, name)


MAX_PIECES = 64  # largest KernelConfig.seq_split


def _check_seq_split(val):
    """``KernelConfig.seq_split``: None, "auto" or a power of two from 2 to :data:`MAX_PIECES`."""
    if val is None or (isinstance(val, str) and val == "auto"):
        return val
    if isinstance(val, bool) or not isinstance(val, (int, np.integer)):
        raise TypeError(f"KernelConfig.seq_split must be None, 'auto' or an int, got {type(val).__name__} {val!r}")
    if val < 2 or val > MAX_PIECES or val & (val - 1):
        raise ValueError(f"KernelConfig.seq_split must be None, 'auto' or a power of two from 2 to {MAX_PIECES} "
                         f"(pieces a sequence), got {val!r}")
    return int(val)


def from_flat_names(**kw) -> KernelConfig:
    """A :class:`KernelConfig` from keywords naming its top-level fields or its groups' fields by
    their own names (``from_flat_names(platform="gpu", save_wy=False, state_slots=3)``), without the
    deprecation warning of ``KernelConfig(save_wy=False)``: for the benchmarks, whose command lines
    and variant tables name options that way.

    Raises:
      TypeError / ValueError: as :class:`KernelConfig` and its groups.
    """
    top = {n: v for n, v in kw.items() if n not in FLAT_NAMES}
    flat = {n: v for n, v in kw.items() if n in FLAT_NAMES}
    groups = {g: top.pop(g, None) or GROUP_CLASSES[g]() for g in _GROUPS}
    return KernelConfig(**top, **_with_flat(groups, flat))


def _grouped_spelling(flat: dict, given=()) -> str:
    """The grouped spelling of the flat keywords ``flat``, for the deprecation warning:
    ``KernelConfig(precision=Precision(mid_dtype='f32'), hopper=HopperTuning(variants=HopperVariants(...)))``;
    a group in ``given`` (passed too, as ``dataclasses.replace`` passes every group) is spelled as a
    change of it, ``hopper=dataclasses.replace(hopper, save_wy=False)``, which keeps its other fields."""
    by = {}
    for name, val in flat.items():
        by.setdefault(FLAT_NAMES[name], []).append(f"{name}={val!r}")
    variants = by.pop("hopper.variants", None)
    if variants is not None:
        made = "dataclasses.replace(hopper.variants, " if "hopper" in given else "HopperVariants("
        by.setdefault("hopper", []).append(f"variants={made}{', '.join(variants)})")
    groups = [f"{g}=dataclasses.replace({g}, {', '.join(by[g])})" if g in given
              else f"{g}={_GROUPS[g].__name__}({', '.join(by[g])})" for g in _GROUPS if g in by]
    where = " (HopperVariants: gdn_jax.ops.pallas.hopper.tuning)" if variants is not None else ""
    return f"KernelConfig({', '.join(groups)}){where}"


def _path(name: str) -> str:
    return f"{FLAT_NAMES[name]}.{name}"


def _flat_value(config: KernelConfig, name: str):
    group = FLAT_NAMES[name]
    rec = config.hopper.variants if group == "hopper.variants" else object.__getattribute__(config, group)
    return getattr(rec, name)


def _with_flat(groups: dict, flat: dict) -> dict:
    """``groups`` with the flat keywords ``flat`` moved into them (each group validated when made)."""
    by = {}
    for name, val in flat.items():
        by.setdefault(FLAT_NAMES[name], {})[name] = val
    out = dict(groups)
    hopper = out["hopper"]
    if "hopper.variants" in by:
        hopper = dataclasses.replace(hopper, variants=dataclasses.replace(hopper.variants, **by.pop("hopper.variants")))
    if "hopper" in by:
        hopper = dataclasses.replace(hopper, **by.pop("hopper"))
    out["hopper"] = hopper
    for name, changes in by.items():
        out[name] = dataclasses.replace(out[name], **changes)
    return out


def check_type(kernel_config) -> None:
    """``kernel_config`` must be None or a :class:`KernelConfig` (``TypeError`` naming it otherwise)."""
    if kernel_config is not None and not isinstance(kernel_config, KernelConfig):
        raise TypeError(f"kernel_config must be a gdn_jax.ops.KernelConfig or None, got {type(kernel_config).__name__}")


def auto_mid_dtype(in_dt, K: int, V: int):
    """The intermediates' dtype of ``mid_dtype="auto"``: bfloat16 for bfloat16 inputs with
    max(K, V) >= :data:`BF16_MID_MIN_DIM`, else float32."""
    if jnp.dtype(in_dt) == jnp.bfloat16 and max(K, V) >= BF16_MID_MIN_DIM:
        return jnp.dtype(jnp.bfloat16)
    return jnp.dtype(F32)


def kernel_chunk(config: KernelConfig, platform: str, direction: str, chunk_size: int, head_dim: int,
                 in_dt) -> int:
    """The chunk the kernels of ``direction`` ("fwd" or "bwd") run with for a requested
    ``chunk_size`` and ``head_dim = max(K, V)`` (the call's own head dims, before padding)."""
    explicit = config.fwd_chunk if direction == "fwd" else config.bwd_chunk
    if explicit is not None:
        return explicit
    if (direction == "bwd" and platform == "gpu" and _mosaic_wanted(config, platform)
            and jnp.dtype(in_dt) == jnp.dtype(jnp.bfloat16) and 64 <= head_dim <= 128 and chunk_size >= 64):
        return 64  # the Hopper backward's chunk (wgmma tiles are 64 rows)
    if (platform == "gpu" and _mosaic_wanted(config, platform) and jnp.dtype(in_dt) == jnp.dtype(jnp.bfloat16)
            and 128 < head_dim <= 256 and chunk_size >= 64 and config.triton.fuse_output
            and config.precision.mid_dtype in ("auto", "bf16") and "f32" not in (config.precision.u_dtype, config.precision.state_dot, config.precision.out_dot)
            and (direction == "fwd" or _wide_hopper(config))):
        return 64  # the Hopper forward at K = 256 (hopper.plan.fwd_covers takes the call), and its mixed backward
    if direction == "fwd" and jnp.dtype(in_dt) == jnp.dtype(F32):
        direction = "bwd"  # the forward's own cap was measured with 16-bit inputs
    for d, c in _MAX_CHUNK.get((platform, direction), ()):
        if head_dim <= d:
            return min(int(chunk_size), c)
    return int(chunk_size)


def _state_block(BH, C, V, state_dt) -> int:
    """Default value block of the state passes: sequential chains want >= ~2 programs per SM
    (an H200 has 132); V > 128 halves at most to 32 when C <= 16 or with 16-bit state dots (B2
    T8192 H8 D256 on an H200: C16 forward 3.0 -> 2.0 ms from bv 16 to 32; C32 with bf16 state
    dots fwd+bwd 5.37 ms at bv 32 vs 6.24 ms at 16; with float32 ones bv 16 is faster)."""
    bv = min(V, 64)
    lo = 32 if (V > 128 and (C <= 16 or jnp.dtype(state_dt) != F32)) else 16
    while bv > lo and BH * (V // bv) < 256:
        bv //= 2
    return bv


def _block(name: str, explicit: Optional[int], default: int, total: int, given: Optional[int] = None) -> int:
    """``explicit`` (None: ``default``) clipped to the (padded) head dim ``total``; ``given``: the
    call's own head dim, named in the message where padding changed it.

    Raises:
      ValueError: a block that does not divide ``total``, naming the value the user gave.
    """
    b = min(explicit or default, total)
    if total % b:
        dim = name[1].upper()
        pad = f" ({dim}={given} zero-padded to a power of two)" if given not in (None, total) else ""
        raise ValueError(f"TritonTuning.{name}={explicit or default} must divide the head dim {total}{pad}")
    return b


def resolve(config: KernelConfig, *, platform: str, C: int, n: int, BH: int, H: int, K: int, V: int,
            K0: int, V0: int, scale: float, in_dt, packed: bool, nseq: int, group: int = 1,
            unit_keys: bool = False) -> KernelCall:
    """Resolve ``config`` for one direction of a call: kernel chunk ``C`` (from
    :func:`kernel_chunk`) and ``n`` chunks, ``BH`` = batch * value heads ``H`` (``group`` value
    heads per key head), padded head dims ``K``, ``V``
    (the call's own ``K0``, ``V0`` pick the intermediates' dtype), ``in_dt`` the dtype q, k, v
    are read in, ``unit_keys`` whether the keys are unit-norm (``use_qk_l2norm``, or the caller's
    promise ``config.keys_unit_norm``).

    Raises:
      ValueError: a block size that does not divide its head dim.
    """
    tpu = is_tpu_layout(platform)
    if config.precision.mid_dtype == "auto":
        mid = auto_mid_dtype(in_dt, K0, V0)
    else:
        mid = jnp.dtype({"f32": F32, "bf16": jnp.bfloat16}[config.precision.mid_dtype])
    wide = lambda opt: jnp.dtype(F32) if opt == "f32" else mid
    u_dt, state_dt, out_dt = wide(config.precision.u_dtype), wide(config.precision.state_dot), wide(config.precision.out_dot)
    f32_auto = "tf32"  # 1-pass TF32 (XLA's default for float32 matmuls); "tf32x3" on request

    def vdefault(kind):
        if tpu:
            return V if V <= 128 or V % 128 else 128
        if kind == "state":
            return _state_block(BH, C, V, state_dt)
        return min(V, 128) if kind == "out" else min(V, 64)

    bv_state = _block("bv_state", config.triton.bv_state, vdefault("state"), V, V0)
    bv_out = _block("bv_out", config.triton.bv_out, vdefault("out"), V, V0)
    bv_grad = _block("bv_grad", config.triton.bv_grad, vdefault("grad"), V, V0)

    bk = _block("bk_grad", config.triton.bk_grad, K if (tpu or K <= 128) else 128, K, K0)
    nk = K // bk
    if V % nk or V // nk < 16:  # each K block also writes dv for V/nk columns: >= 16 of them
        nk = 1
    save_t = (nk == 1) if config.triton.save_t is None else config.triton.save_t
    if tpu:
        merge = False  # each program of a merged launch writes only its own outputs: not on TPU
    elif config.triton.merge_state is None:
        merge = platform == "gpu" and BH * (V // bv_state) <= 128
    else:
        merge = config.triton.merge_state
    call = KernelCall(
        platform=platform, layout="hm" if tpu else "bthd", BH=BH, H=H, group=group, n=n, C=C, K=K, V=V, scale=float(scale),
        in_dt=jnp.dtype(in_dt).name, mid_dt=mid.name, u_dt=u_dt.name, state_dt=state_dt.name, out_dt=out_dt.name,
        f32_inv=config.precision.gpu_f32_inv or f32_auto, f32_mm=config.precision.gpu_f32_mm or f32_auto, packed=packed, nseq=nseq,
        bv_state=bv_state, bv_out=bv_out, bv_grad=bv_grad, grad_nk=nk,
        warps_wy=config.triton.warps_wy, warps_state=config.triton.warps_state, warps_out=config.triton.warps_out,
        warps_grad=config.triton.warps_grad or (8 if max(K, V) >= 128 else 4),
        num_stages=2 if config.triton.num_stages is None else config.triton.num_stages,
        fuse_output=config.triton.fuse_output, save_t=bool(save_t), merge_state=bool(merge),
        gatefree=config.triton.gatefree, unit_keys=bool(unit_keys or config.keys_unit_norm),
        save_wy=config.hopper.save_wy is not False, wy_inverse=config.hopper.wy_inverse, wy_precision=config.hopper.wy_precision,
        wy_compact=config.hopper.wy_compact, grad_precision=config.hopper.grad_precision, grad_tp=config.hopper.grad_t_phase,
        fwd_form=config.hopper.fwd_form or ("t" if K > 128 else "wu"), fwd_form_auto=config.hopper.fwd_form is None,
        approx_math=config.hopper.approx_math, own_barriers=config.hopper.own_barriers(), wy_per_cta=config.hopper.variants.wy_chunks_per_cta or 1, late_o=config.hopper.late_o_store,
        state_prod=config.hopper.state_producer, state_wgs=config.hopper.variants.state_warpgroups, state_slots=config.hopper.variants.state_slots,
        rev_prod=config.hopper.reverse_producer, grad_wgs=config.hopper.grad_warpgroups,
        grad_per_cta=config.hopper.variants.grad_chunks_per_cta or 1,
        save_states=config.hopper.save_states is not False,
        hopper=_mosaic_wanted(config, platform), bv_given=config.triton.bv_state, wide_backward=config.hopper.wide_backward,
    )
    return call


def _wide_hopper(config: KernelConfig) -> bool:
    """Whether ``config.hopper.wide_backward`` asks for a Hopper backward at K > 128 (None, "hopper_xla", "hopper")."""
    return (config.hopper.wide_backward in (None, "hopper_xla", "hopper") and config.hopper.save_wy is not False
            and config.hopper.save_states is not False)


def _mosaic_wanted(config: KernelConfig, platform: str) -> bool:
    """Whether ``config.gpu_kernels`` asks for the Hopper kernels on ``platform`` (None: on an sm_90
    GPU with a JAX whose Mosaic GPU API they use: checked on 0.10.2 (lowering) and 0.11.2)."""
    from .platform import is_hopper

    if platform not in ("gpu", "interpret"):
        return False
    if config.gpu_kernels is None:
        new_jax = tuple(int(x) for x in jax.__version__.split(".")[:2]) >= (0, 10)
        return platform == "gpu" and new_jax and is_hopper()
    return config.gpu_kernels == "mosaic"
