"""The table of kernel paths of ``backend="pallas"``: for each direction, the ways its kernels can run,
tried in the order listed; the first whose ``covers`` returns None runs.

Forward (:data:`FORWARD`):

1. ``hopper_t``: the Hopper kernels, T form (:func:`.hopper.wy.wy_forward` writes T = (I + A)^-1, the
   state pass forms Vn from T and v; ``HopperTuning.fwd_form="t"``, or None at K > 128 and at K = 128
   with many state-pass CTAs, :func:`.hopper.plan.t_form_default`);
2. ``hopper_transition``: the Hopper WY kernel and the transition-form state pass
   (:mod:`.hopper.transition`; ``fwd_form="transition"``, opt-in);
3. ``hopper_wu``: the Hopper kernels, W/U form (:func:`.hopper.wy.wy_forward` ->
   :func:`.hopper.state_fwd.forward_states_and_output`);
4. ``gatefree``: the portable kernels in the gate-free form (GPU / interpret layout; opt-in,
   ``TritonTuning(gatefree=True)``, and only for unit-norm keys): :func:`.inverse_gatefree.t0_and_aqk`
   (T0, Aqk) -> :func:`.state_fwd.forward_states_and_output_gatefree` (Vn from T0 * D in the loop);
5. ``fused``: the portable kernels (Triton on GPU, Mosaic TPU, interpret) with the state pass fused
   with the output (:func:`.wy.wy_repr` -> :func:`.state_fwd.forward_states_and_output`);
6. ``unfused``: the portable kernels with a separate output kernel (``fuse_output=False``).

Backward (:data:`BACKWARD`):

1. ``hopper``: every stage in the Hopper kernels (WY or the forward's saved T, recompute or the
   forward's saved states, reverse pass, gradient kernel);
2. ``hopper_blocks``: K or V above 128 (``wide_backward`` None or "hopper"): the Hopper reverse pass
   and the Hopper gradient kernel on 128 x 128 (key, value) blocks, on the forward's residuals;
3. ``hopper_xla``: as ``hopper_blocks`` with the local gradients as XLA matmuls
   (:func:`.grads_xla.chunk_grads_xla`);
4. ``portable``: the portable kernels (WY, the two state passes, merged or apart, gradient kernel).

Final state only (:func:`gdn_jax.ops.pallas.pallas_final_state`: the maps' pass of
:func:`gdn_jax.ops.state_maps.state_map` and of the sequence split, which read only the final
state): each forward entry's ``run_final`` runs the same path with no output, chosen by the same
``covers`` (one table, one choice):

* ``hopper_t``, ``hopper_wu``: the Hopper WY kernel without q (no Q K^T, no Aqk written;
  :func:`.hopper.wy.wy_forward` with q None) and the state pass in its final-only mode
  (:func:`.hopper.state_fwd.forward_final_state`: no Q S, no Aqk Vn, no o tile or store). Under
  differentiation with ``HopperTuning.save_wy`` the WY kernel forms Aqk as the full op's does (the
  backward reads it among the saved WY products), and with ``save_states`` the state pass also
  writes h and Vn;
* ``gatefree``: the inverse stage forms T0 alone (no Aqk) and the state pass writes no o
  (:func:`.state_fwd.forward_final_state_gatefree`);
* ``fused``, ``unfused``: the WY kernel without q (W, U; no Aqk) and the final-only state pass
  (:func:`.state_fwd.forward_final_state`; on TPU :func:`.state_tpu.forward_final_state`), no
  output kernel;
* ``hopper_transition`` (opt-in): no final-only mode (its one wgmma group per chunk carries the output
  products with the chain): the full kernels run and o is dropped (``run_final`` None).

Each entry is a :class:`Path`: ``covers(call, forward)`` -> None or why not (``forward``: the
forward's :class:`Chosen`, for the backward entries that need the forward's residuals), ``prepare(call)``
-> the call its kernels read (the Hopper entries resolve their form and value block there), ``run``
and, for the forward entries, ``run_final``. Adding a path is adding one entry. :func:`choose` picks the entry and keeps every other
entry's reason; ``gdn_jax.ops.pallas.forward_kernels`` / ``backward_kernels`` report them.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Optional, Tuple

from .._common import GateForms
from .call import KernelCall
from .grads import chunk_grads
from .grads_xla import chunk_grads_xla
from .hopper import grads as hopper_grads, state_bwd as hopper_state_bwd, state_fwd as hopper_state_fwd
from .hopper import plan as hopper_plan, transition as hopper_transition, wy as hopper_wy
from .inverse_gatefree import GATEFREE_CHUNK, gatefree_covers, t0_and_aqk
from .state_bwd import merged_states, reverse_states
from .state_fwd import (forward_final_state, forward_final_state_gatefree, forward_states, forward_states_and_output,
                        forward_states_and_output_gatefree, output)
from .wy import wy_repr


@dataclasses.dataclass(frozen=True)
class Path:
    """One way to run the kernels of one direction: ``name``; ``covers(call, forward)`` -> None
    where it takes ``call`` (a :class:`KernelCall` of :func:`.config.resolve`; ``forward`` the
    forward's :class:`Chosen` for a backward entry, None for a forward one), else the reason;
    ``prepare(call)`` -> the call its kernels read; ``run`` (forward: ``run(call, q, k, v, beta,
    gam, gam_row, e_gam, e_gam_end, e_gam_last, h0, flags, save_wy, save_states)`` -> (o, final,
    residual dict); backward: ``run(call, inputs, do, dfin, saved)`` -> (local gradients dict,
    d h0, d e^{gamma_C})); ``hopper``: it runs the Hopper kernels (the forward keeps residuals only
    where both directions do); ``run_final`` (forward entries): the same path writing the final state
    alone, ``run_final(<run's arguments>)`` -> (final, residual dict), or None where the path has no
    such mode (:func:`run_final_state` then runs ``run`` and drops o)."""

    name: str
    covers: Callable
    run: Callable
    prepare: Callable = lambda call: call
    hopper: bool = False
    run_final: Optional[Callable] = None


@dataclasses.dataclass(frozen=True)
class Chosen:
    """The entry that runs one direction of a call (``path``, a :class:`Path` name), the call its
    kernels read (``call``: :meth:`Path.prepare` of the resolved call), and why each other entry of
    the table does not run (``not_taken``: ((name, reason), ...), in table order)."""

    path: str
    call: KernelCall
    not_taken: Tuple[Tuple[str, str], ...] = ()


# ---------------------------------------------------------------------------------------------
# the Hopper entries' settings


def hopper_call(call: KernelCall) -> KernelCall:
    """``call`` with the Hopper kernels' settings at its chunking: the one-warpgroup state and
    reverse passes in interpret mode (``state_producer`` / ``reverse_producer``: GPU only), the state
    pass's value block (``TritonTuning.bv_state`` as given, else :func:`.hopper.plan.block_for`) and
    the forward form (``fwd_form`` None at K = 128 with many state-pass CTAs: "t" where its kernels
    take the call, :func:`.hopper.plan.t_form_default`). The backward's Hopper entries read the same
    value block (the reverse pass's follows the forward's)."""
    if call.platform == "interpret":
        call = dataclasses.replace(call, state_prod=False, rev_prod=False)
    call = dataclasses.replace(call, bv_mosaic=call.bv_given or hopper_plan.block_for(call))
    if call.fwd_form_auto and hopper_plan.t_form_default(call):
        t = dataclasses.replace(call, fwd_form="t")
        t = dataclasses.replace(t, bv_mosaic=call.bv_given or hopper_plan.block_for(t))
        if hopper_plan.fwd_covers(t) is None:
            call = t
    return call


def _not_asked(call: KernelCall) -> Optional[str]:
    """Why the Hopper kernels were not asked for (None where they were)."""
    if call.hopper:
        return None
    if call.platform not in ("gpu", "interpret"):
        return f"platform {call.platform!r} (the Hopper kernels run on 'gpu' or 'interpret')"
    if call.platform == "interpret":
        return ("not asked for (in interpret mode the Hopper kernels run only with KernelConfig(gpu_kernels='mosaic'); "
                "None or 'triton' runs the portable ones)")
    return "not asked for (KernelConfig.gpu_kernels: 'triton', or None on a GPU that is not sm_90)"


def _form_reason(c: KernelCall, form: str) -> str:
    """Why the Hopper forward entry of ``form`` does not run: ``c`` (resolved by :func:`hopper_call`)
    runs another form, either given (``HopperTuning.fwd_form``) or picked by the default rule."""
    if not c.fwd_form_auto:
        return f"the Hopper forward form is {c.fwd_form!r} (HopperTuning.fwd_form={c.fwd_form!r})"
    if form == "transition":
        return "opt-in: HopperTuning(fwd_form='transition'); fwd_form=None never picks it"
    if form == "t" and hopper_plan.t_form_default(c):
        t = dataclasses.replace(c, fwd_form="t")
        t = dataclasses.replace(t, bv_mosaic=c.bv_given or hopper_plan.block_for(t))
        return f"HopperTuning.fwd_form=None picks 't' here, but its kernels do not take the call: {hopper_plan.fwd_covers(t)}"
    ctas = c.BH * (c.V // c.bv_mosaic)
    return (f"the Hopper forward form is {c.fwd_form!r}: HopperTuning.fwd_form=None picks 't' at K > 128 and at "
            f"K = 128 with >= {hopper_plan.T_FORM_MIN_CTAS} state-pass CTAs; here K={c.K}, {ctas} CTAs "
            f"(HopperTuning(fwd_form={form!r}) asks for it)")


def _hopper_forward_covers(form: str):
    def covers(call: KernelCall, forward=None) -> Optional[str]:
        why = _not_asked(call)
        if why is not None:
            return why
        c = hopper_call(call)
        if c.fwd_form != form:
            return _form_reason(c, form)
        return hopper_plan.fwd_covers(c)

    return covers


# ---------------------------------------------------------------------------------------------
# forward runs


def _saved(wy, out, save_wy, save_states):
    saved = {}
    if save_wy:
        saved.update(aqk=wy["aqk"], t_hi=wy["t_hi"], t_lo=wy["t_lo"])
    if save_states:
        saved.update(h=out["h"], vn=out["vn"])
        if save_wy:  # with the saved Aqk and T the backward has no WY stage: it needs W from here
            saved["w"] = wy["w"]
    return saved


def _run_hopper_t(call, q, k, v, beta, gam, gam_row, e_gam, e_gam_end, e_gam_last, h0, flags, save_wy, save_states):
    """Hopper, T form: the state pass forms Vn from T and v."""
    wy = hopper_wy.wy_forward(call, q, k, None, beta, gam, e_gam, t_form=True, with_w=save_wy and save_states)
    out = hopper_state_fwd.forward_states_and_output(call, None, None, k, e_gam_end, e_gam_last, h0, flags, q, e_gam,
                                                     wy["aqk"], save_states=save_states, v=v,
                                                     t=(wy["t_hi"], wy["t_lo"]), beta=beta)
    return out["o"], out["final"], _saved(wy, out, save_wy, save_states)


def _final_hopper_t(call, q, k, v, beta, gam, gam_row, e_gam, e_gam_end, e_gam_last, h0, flags, save_wy, save_states):
    """Hopper, T form, final state only: the WY kernel without Aqk (with it where the backward keeps
    the WY products, ``save_wy``: the full op's residuals), the state pass without the output."""
    wy = hopper_wy.wy_forward(call, q if save_wy else None, k, None, beta, gam, e_gam, t_form=True,
                              with_w=save_wy and save_states)
    out = hopper_state_fwd.forward_final_state(call, None, None, k, e_gam_end, e_gam_last, h0, flags,
                                               save_states=save_states, v=v, t=(wy["t_hi"], wy["t_lo"]), beta=beta,
                                               e_gam=e_gam)
    return out["final"], _saved(wy, out, save_wy, save_states)


def _final_hopper_wu(call, q, k, v, beta, gam, gam_row, e_gam, e_gam_end, e_gam_last, h0, flags, save_wy, save_states):
    """Hopper, W/U form, final state only: the WY kernel without Aqk (with it under ``save_wy``, as
    :func:`_final_hopper_t`), the state pass without the output."""
    wy = hopper_wy.wy_forward(call, q if save_wy else None, k, v, beta, gam, e_gam, save_t=save_wy)
    out = hopper_state_fwd.forward_final_state(call, wy["w"], wy["u"], k, e_gam_end, e_gam_last, h0, flags,
                                               save_states=save_states)
    return out["final"], _saved(wy, out, save_wy, save_states)


def _run_hopper_wu(state_pass):
    def run(call, q, k, v, beta, gam, gam_row, e_gam, e_gam_end, e_gam_last, h0, flags, save_wy, save_states):
        wy = hopper_wy.wy_forward(call, q, k, v, beta, gam, e_gam, save_t=save_wy)
        out = state_pass()(call, wy["w"], wy["u"], k, e_gam_end, e_gam_last, h0, flags, q, e_gam, wy["aqk"],
                           save_states=save_states)
        return out["o"], out["final"], _saved(wy, out, save_wy, save_states)

    return run


def _no_residuals(name, save_wy, save_states):
    if save_wy or save_states:
        raise ValueError(f"forward(save_wy=True / save_states=True) needs a Hopper forward path, not {name!r}")


def _run_fused(call, q, k, v, beta, gam, gam_row, e_gam, e_gam_end, e_gam_last, h0, flags, save_wy, save_states):
    _no_residuals("fused", save_wy, save_states)
    wy = wy_repr(call, k, v, beta, gam, gam_row, e_gam, q=q)
    out = forward_states_and_output(call, wy["w"], wy["u"], k, e_gam_end, e_gam_last, h0, flags, q, e_gam, wy["aqk"])
    return out["o"], out["final"], {}


def _final_fused(call, q, k, v, beta, gam, gam_row, e_gam, e_gam_end, e_gam_last, h0, flags, save_wy, save_states):
    """The portable kernels, final state only (the ``fused`` and ``unfused`` entries): the WY kernel
    without q (no Aqk), the state pass writing the final state alone."""
    _no_residuals("fused", save_wy, save_states)
    wy = wy_repr(call, k, v, beta, gam, gam_row, e_gam)
    return forward_final_state(call, wy["w"], wy["u"], k, e_gam_end, e_gam_last, h0, flags)["final"], {}


def _gatefree_covers(call: KernelCall, forward=None) -> Optional[str]:
    """Why the gate-free forward does not take ``call`` (None where it does): not asked for, the
    TPU layout, :func:`.inverse_gatefree.gatefree_covers` (unit-norm keys, dtype), or the forward
    kernels' chunk (``call.C``, which ``KernelConfig.fwd_chunk`` or the platform's cap may set below
    the caller's ``chunk_size``)."""
    if not call.gatefree:
        return "not asked for (TritonTuning(gatefree=True) asks for it)"
    if call.layout != "bthd":
        return f"platform {call.platform!r}: the gate-free kernels have the GPU / interpret layout only"
    if not call.fuse_output:
        return "fuse_output=False (the gate-free state pass always writes o)"
    why = gatefree_covers(GateForms(False, False), chunk_size=GATEFREE_CHUNK, dtype=call.in_dt, use_qk_l2norm=False,
                          keys_unit_norm=call.unit_keys)
    if why is None and call.C != GATEFREE_CHUNK:
        # call.C is the forward kernels' chunk, not necessarily the caller's chunk_size: name both sources
        return (f"the forward kernels' chunk is {call.C} (chunk_size, or KernelConfig.fwd_chunk where given; on a "
                f"GPU float32 inputs and head dims above 128 cap it at 32): the gate-free path is built for chunk "
                f"{GATEFREE_CHUNK}; KernelConfig(fwd_chunk={GATEFREE_CHUNK}) asks for it")
    return why


def _run_gatefree(call, q, k, v, beta, gam, gam_row, e_gam, e_gam_end, e_gam_last, h0, flags, save_wy, save_states):
    _no_residuals("gatefree", save_wy, save_states)
    t = t0_and_aqk(call, q, k, beta, gam, gam_row)
    out = forward_states_and_output_gatefree(call, q, k, v, beta, gam, gam_row, e_gam, e_gam_end, e_gam_last, h0,
                                             flags, t["t0"], t["aqk"])
    return out["o"], out["final"], {}


def _final_gatefree(call, q, k, v, beta, gam, gam_row, e_gam, e_gam_end, e_gam_last, h0, flags, save_wy,
                    save_states):
    _no_residuals("gatefree", save_wy, save_states)
    t = t0_and_aqk(call, None, k, beta, gam, gam_row)
    out = forward_final_state_gatefree(call, k, v, beta, gam, gam_row, e_gam, e_gam_end, e_gam_last, h0, flags,
                                       t["t0"])
    return out["final"], {}


def _run_unfused(call, q, k, v, beta, gam, gam_row, e_gam, e_gam_end, e_gam_last, h0, flags, save_wy, save_states):
    _no_residuals("unfused", save_wy, save_states)
    wy = wy_repr(call, k, v, beta, gam, gam_row, e_gam)
    st = forward_states(call, wy["w"], wy["u"], k, e_gam_end, e_gam_last, h0, flags)
    return output(call, q, k, gam, gam_row, e_gam, st["h"], st["vn"])["o"], st["final"], {}


FORWARD: Tuple[Path, ...] = (
    Path("hopper_t", _hopper_forward_covers("t"), _run_hopper_t, hopper_call, hopper=True, run_final=_final_hopper_t),
    # the module attribute is read at call time (tests replace the kernels)
    Path("hopper_transition", _hopper_forward_covers("transition"),
         _run_hopper_wu(lambda: hopper_transition.forward_states_transition), hopper_call, hopper=True),
    Path("hopper_wu", _hopper_forward_covers("wu"),
         _run_hopper_wu(lambda: hopper_state_fwd.forward_states_and_output), hopper_call, hopper=True,
         run_final=_final_hopper_wu),
    Path("gatefree", _gatefree_covers, _run_gatefree, run_final=_final_gatefree),
    Path("fused", lambda call, forward=None: None if call.fuse_output else "fuse_output=False", _run_fused,
         run_final=_final_fused),
    Path("unfused", lambda call, forward=None: None, _run_unfused, run_final=_final_fused),
)


def run_final_state(path: str, call: KernelCall, *args):
    """The forward entry ``path`` writing only the final state: its ``run_final``, or where it has none
    its ``run`` with o dropped. ``args``: ``run``'s arguments after ``call``. Returns (final,
    residual dict)."""
    p = FORWARD_BY_NAME[path]
    if p.run_final is not None:
        return p.run_final(call, *args)
    _, fin, saved = p.run(call, *args)
    return fin, saved


# ---------------------------------------------------------------------------------------------
# backward


def _hopper_backward_covers(call: KernelCall, forward=None) -> Optional[str]:
    return _not_asked(call) or hopper_plan.bwd_covers(hopper_call(call))


def _wide_covers(call: KernelCall, forward: Optional[Chosen]) -> Optional[str]:
    """Why the Hopper reverse pass with block / XLA local gradients (K or V above 128) does not take
    ``call`` (None where it does): ``wide_backward`` "triton", ``save_wy`` or ``save_states`` off,
    head dims up to 128 (the ``hopper`` entry's), no Hopper forward at this chunk (at the
    backward's chunking or in the call's forward), or shared memory."""
    why = _not_asked(call)
    if why is not None:
        return why
    c = hopper_call(call)
    if max(c.K, c.V) <= 128:
        return f"K={c.K}, V={c.V}: this entry is for K or V above 128 (the 'hopper' entry takes K, V <= 128)"
    if c.wide_backward == "triton" or not (c.save_wy and c.save_states):
        return (f"wide_backward={c.wide_backward!r}, save_wy={c.save_wy}, save_states={c.save_states} "
                f"(needs wide_backward None, 'hopper' or 'hopper_xla' with both residuals)")
    if hopper_plan.fwd_covers(c) is not None:
        return f"the Hopper forward does not take the backward's chunking: {hopper_plan.fwd_covers(c)}"
    if c.layout != "bthd" or hopper_plan.reverse_smem_bytes(c, 16, True) > hopper_plan.SMEM_BYTES:
        return "the Hopper reverse pass does not fit (layout or shared memory)"
    if forward is None or not FORWARD_BY_NAME[forward.path].hopper or forward.call.C != c.C:
        where = "none" if forward is None else f"{forward.path!r} at chunk {forward.call.C}"
        return f"needs the Hopper forward's residuals at chunk {c.C} (forward: {where})"
    return None


def _blocks_covers(call: KernelCall, forward: Optional[Chosen]) -> Optional[str]:
    why = _wide_covers(call, forward)
    if why is not None:
        return why
    if call.wide_backward == "hopper_xla":
        return "wide_backward='hopper_xla'"
    if hopper_plan.block_call(hopper_call(call)) is None:
        return "the Hopper gradient kernel does not take its 128 x 128 blocks (see hopper.plan.block_call)"
    return None


def _run_hopper_backward(call, inputs, do, dfin, saved):
    q, k, v, beta, gam, gam_row, e_gam, e_gam_end, e_gam_last, h0, flags = inputs
    saved = saved or {}
    if "aqk" not in saved:
        wy = hopper_wy.wy_backward(call, q, k, v, do, beta, gam, e_gam)
    elif "w" in saved:  # the forward's Aqk, T, W and states: no WY stage (the reverse pass forms dVl)
        wy = dict(w=saved["w"], dvl=None, t_hi=saved["t_hi"], t_lo=saved["t_lo"])
    else:  # the forward's Aqk and T: no second inverse
        t_hi, t_lo = saved["t_hi"], saved["t_lo"]
        wy = dict(hopper_wy.wy_from_saved(call, k, v, do, beta, e_gam, saved["aqk"], t_hi, t_lo), t_hi=t_hi,
                  t_lo=t_lo)
    if "h" in saved:  # the forward's states and Vn: no forward recompute
        st = dict(h=saved["h"], vn=saved["vn"])
    else:
        st = hopper_state_fwd.recompute_states(call, wy["w"], wy["u"], k, e_gam_end, e_gam_last, h0, flags)
    rs = hopper_state_bwd.reverse_states(call, q, k, wy["w"], wy["dvl"], do, e_gam, e_gam_end, e_gam_last, dfin,
                                         st["h"], flags, aqk=saved["aqk"] if wy["dvl"] is None else None)
    gr = hopper_grads.chunk_grads(call, q, k, v, do, beta, gam, e_gam, e_gam_end, st["h"], rs["dh"], st["vn"],
                                  rs["dvn"], wy["t_hi"], wy["t_lo"])
    return gr, rs["dh0"], rs["de_gam_last"]


def _run_wide(blocks: bool):
    """K > 128 on Hopper: the Mosaic GPU reverse pass (dVl = Aqk^T dO formed in it) and the local
    gradients from the Hopper gradient kernel on 128-column blocks (``blocks``,
    :func:`.hopper.grads.chunk_grads_blocks`) or as XLA matmuls (:func:`.grads_xla.chunk_grads_xla`),
    both on the forward's saved Aqk, T, W, h_n and Vn."""
    def run(call, inputs, do, dfin, saved):
        q, k, v, beta, gam, gam_row, e_gam, e_gam_end, e_gam_last, h0, flags = inputs
        if not saved or not {"aqk", "t_hi", "t_lo", "w", "h", "vn"} <= set(saved):
            raise ValueError("backward: the Hopper wide backward needs the forward's residuals (save_wy and "
                             "save_states)")
        rs = hopper_state_bwd.reverse_states(call, q, k, saved["w"], None, do, e_gam, e_gam_end, e_gam_last, dfin,
                                             saved["h"], flags, aqk=saved["aqk"])
        grads = hopper_grads.chunk_grads_blocks if blocks else chunk_grads_xla
        gr = grads(call, q, k, v, do, beta, gam, e_gam, e_gam_end, saved["h"], rs["dh"], saved["vn"], rs["dvn"],
                   saved["t_hi"], saved["t_lo"])
        return gr, rs["dh0"], rs["de_gam_last"]

    return run


def _run_portable_backward(call, inputs, do, dfin, saved):
    q, k, v, beta, gam, gam_row, e_gam, e_gam_end, e_gam_last, h0, flags = inputs
    if saved:
        raise ValueError("backward(saved=...) needs a Hopper backward path, not 'portable'")
    wy = wy_repr(call, k, v, beta, gam, gam_row, e_gam, q=q, do=do)
    if call.merge_state:
        st = merged_states(call, wy["w"], wy["u"], k, e_gam_end, e_gam_last, h0, q, wy["dvl"], do, e_gam, dfin, flags)
    else:
        st = dict(forward_states(call, wy["w"], wy["u"], k, e_gam_end, e_gam_last, h0, flags))
        st.update(reverse_states(call, q, k, wy["w"], wy["dvl"], do, e_gam, e_gam_end, e_gam_last, dfin, flags))
    gr = chunk_grads(call, q, k, v, do, beta, gam, gam_row, e_gam, e_gam_end, st["h"], st["dh"], st["vn"], st["dvn"],
                     wy.get("t"))
    return gr, st["dh0"], gr["de_gam_last"]


BACKWARD: Tuple[Path, ...] = (
    Path("hopper", _hopper_backward_covers, _run_hopper_backward, hopper_call, hopper=True),
    Path("hopper_blocks", _blocks_covers, _run_wide(True), hopper_call, hopper=True),
    Path("hopper_xla", _wide_covers, _run_wide(False), hopper_call, hopper=True),
    Path("portable", lambda call, forward=None: None, _run_portable_backward),
)

FORWARD_BY_NAME = {p.name: p for p in FORWARD}
BACKWARD_BY_NAME = {p.name: p for p in BACKWARD}
# the names forward_kernels / backward_kernels report for the kernels (the portable ones by platform)
KERNELS = {"hopper_t": "hopper", "hopper_transition": "hopper", "hopper_wu": "hopper", "hopper": "hopper",
           "hopper_blocks": "hopper-blocks", "hopper_xla": "hopper+xla"}


def choose(direction: str, call: KernelCall, forward: Optional[Chosen] = None) -> Chosen:
    """The first entry of :data:`FORWARD` (``direction`` "fwd") or :data:`BACKWARD` ("bwd", with
    the forward's :class:`Chosen`) that covers ``call``, with every other entry's reason."""
    table = FORWARD if direction == "fwd" else BACKWARD
    chosen, reasons = None, []
    for p in table:
        why = p.covers(call, forward)
        if chosen is None and why is None:
            chosen = p
            continue
        reasons.append((p.name, why if why is not None else f"covers the call, but {chosen.name!r} comes first"))
    if chosen is None:  # the last entry of each table takes every call
        raise AssertionError(f"no {direction} kernel path takes the call: {reasons}")
    return Chosen(chosen.name, chosen.prepare(call), tuple(reasons))


def choose_both(cf: KernelCall, cb: KernelCall) -> Tuple[Chosen, Chosen]:
    """The forward's and the backward's :class:`Chosen` of a call (its two resolved calls)."""
    f = choose("fwd", cf)
    return f, choose("bwd", cb, f)


def hopper_both(fwd: Chosen, bwd: Chosen) -> bool:
    """Whether both directions run Hopper paths at one chunking (the forward may then keep residuals)."""
    return bool(FORWARD_BY_NAME[fwd.path].hopper and BACKWARD_BY_NAME[bwd.path].hopper
                and fwd.call.C == bwd.call.C and fwd.call.n == bwd.call.n)


def kernels_name(chosen: Chosen) -> str:
    """The kernels ``chosen`` runs, as ``forward_kernels`` names them: "hopper", "hopper-blocks",
    "hopper+xla", or the platform's ("triton" on GPU, "tpu", "interpret", "tpu_interpret")."""
    if chosen.path in KERNELS:
        return KERNELS[chosen.path]
    return "triton" if chosen.call.platform == "gpu" else chosen.call.platform
