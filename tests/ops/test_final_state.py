"""The final-state-only forward of the Pallas op (``gdn_jax.ops.gated_delta_rule.final_state`` ->
``gdn_jax.ops.pallas.pallas_final_state``, per kernel path ``paths.FORWARD``'s ``run_final``), in
interpret mode.

* every forward kernel path that runs in interpret mode (fused, unfused, gate-free, TPU streamed,
  Hopper "wu", "t" and the transition form, which falls back to the full kernels): the final state,
  undifferentiated (no residuals written) and under differentiation, and the gradient of a loss of it with respect to q, k, v, g, beta and the initial state equal the
  full op's BIT FOR BIT (the same kernels' arithmetic without the output; the backward is the full
  op's with a zero output cotangent, which the full op gets too when the loss reads only the final
  state), with an initial state, packed ``cu_seqlens`` (an empty document) and grouped value heads,
  plus a dense B = 2 case; on the paths with a final-only mode the path's full ``run`` is replaced
  by one that raises, so the final-only kernels are what ran;
* the tests can fail: a final-only run that returns a state off by one part in 2^20, or a backward
  fed a nonzero output cotangent, fails them (:func:`test_comparison_catches_wrong_entries`);
* ``state_map`` (which now runs the final-only entry): M and N equal those of the full op's pass bit
  for bit (dense with GVA, and packed with ``continues`` and initial states), and against the float64
  reference of tests/reference.py within the suite's state tolerance (rel. rms 5e-3).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import BF16, F32, TOL_S, check_close, make_inputs, seed_of
from reference import reference

from gdn_jax.ops import HopperTuning, KernelConfig, TritonTuning, gated_delta_rule
from gdn_jax.ops.gated_delta_rule import final_state
from gdn_jax.ops.pallas import forward_kernels, paths
from gdn_jax.ops.pallas import vjp as pallas_vjp
from gdn_jax.ops.piece_maps import affine_state_map
from gdn_jax.ops.state_maps import state_map

MOSAIC = dict(platform="interpret", gpu_kernels="mosaic")
# (path, config, dtype, chunk, K = V, use_qk_l2norm)
PATHS = {
    "fused": (KernelConfig(platform="interpret"), F32, 16, 32, False),
    "unfused": (KernelConfig(platform="interpret", triton=TritonTuning(fuse_output=False)), F32, 16, 32, False),
    "gatefree": (KernelConfig(platform="interpret", triton=TritonTuning(gatefree=True)), BF16, 64, 32, True),
    "tpu": (KernelConfig(platform="tpu_interpret"), F32, 16, 32, False),
    "hopper_wu": (KernelConfig(**MOSAIC, hopper=HopperTuning(fwd_form="wu")), BF16, 64, 64, False),
    "hopper_t": (KernelConfig(**MOSAIC, hopper=HopperTuning(fwd_form="t")), BF16, 64, 64, False),
    "hopper_transition": (KernelConfig(**MOSAIC, hopper=HopperTuning(fwd_form="transition")), BF16, 64, 64, False),
}
CU = [0, 40, 40, 97, 150]  # an empty document; boundaries inside chunks


def _inputs(name, dense):
    cfg, dt, C, D, l2 = PATHS[name]
    B, Hk, G, N = (2, 2, 1, None) if dense else (1, 1, 2, len(CU) - 1)
    x = make_inputs(seed_of("final-state", name, dense), B, 150, Hk * G, D, D, gates="weak", init=True, dtype=dt,
                    N=N, normalize_qk=not l2)
    if G > 1:  # grouped value heads: q, k on the key heads
        x.q, x.k = x.q[:, :, :Hk], x.k[:, :, :Hk]
    cu = None if dense else jnp.asarray(CU, jnp.int32)
    return x, cu, dict(backend="pallas", chunk_size=C, kernel_config=cfg, use_qk_l2norm=l2, cu_seqlens=cu)


def _value_and_grads(fn, x):
    """(final state, grads of sum(S * dS) over q, k, v, g, beta, initial state), jitted."""
    def loss(q, k, v, g, b, s):
        S = fn(q, k, v, g, b, s)
        return jnp.sum(S * x.dS), S

    (_, S), grads = jax.jit(jax.value_and_grad(loss, argnums=tuple(range(6)), has_aux=True))(
        x.q, x.k, x.v, x.g, x.beta, x.S0)
    return S, grads


def _full(kw):
    return lambda q, k, v, g, b, s: gated_delta_rule(q, k, v, g, b, initial_state=s, output_final_state=True, **kw)[1]


def _final(kw):
    return lambda q, k, v, g, b, s: final_state(q, k, v, g, b, initial_state=s, **kw)


def _assert_same(got, ref):
    """Bit-for-bit equality of the final state and of every gradient."""
    for i, (a, b) in enumerate(zip(jax.tree.leaves(got), jax.tree.leaves(ref))):
        a, b = np.asarray(a.astype(F32)), np.asarray(b.astype(F32))
        assert np.array_equal(a, b), (i, float(np.max(np.abs(a - b))), float(np.max(np.abs(b))))


def _raising_run(name):
    def run(*a, **k):
        raise AssertionError(f"the full forward of {name!r} ran in a final-state-only call")
    return run


@pytest.mark.parametrize("name,dense", [(n, False) for n in PATHS] + [("fused", True)])
def test_final_state_equals_full_op(name, dense, monkeypatch):
    x, cu, kw = _inputs(name, dense)
    want_path = {"tpu": "fused"}.get(name, name)
    assert forward_kernels(x.q, x.k, x.v, x.g, x.beta, chunk_size=kw["chunk_size"], cu_seqlens=cu,
                           use_qk_l2norm=kw["use_qk_l2norm"], kernel_config=kw["kernel_config"]).path == want_path
    ref = _value_and_grads(_full(kw), x)
    p = paths.FORWARD_BY_NAME[want_path]
    if p.run_final is not None:  # the final-only kernels must be what runs, forward and under grad
        monkeypatch.setitem(paths.FORWARD_BY_NAME, want_path, dataclasses.replace(p, run=_raising_run(want_path)))
    seen = []  # the Hopper WY kernel: called without q (no Aqk) where no residuals are kept
    wy = paths.hopper_wy.wy_forward
    monkeypatch.setattr(paths.hopper_wy, "wy_forward", lambda c, q, *a, **k: seen.append(q is None) or wy(c, q, *a, **k))
    got = _value_and_grads(_final(kw), x)
    _assert_same(got, ref)
    # undifferentiated (no residuals: on the Hopper paths the WY kernel forms no Aqk either)
    _assert_same(jax.jit(_final(kw))(x.q, x.k, x.v, x.g, x.beta, x.S0), ref[0])
    if p.hopper and p.run_final is not None:
        assert seen == [False, True], seen  # Aqk kept for the backward (save_wy), then none
    assert float(jnp.max(jnp.abs(ref[0]))) > 0.1 and float(jnp.max(jnp.abs(ref[1][3]))) > 0  # a real state, dg


def test_comparison_catches_wrong_entries(monkeypatch):
    """The comparison above fails for a final-only run whose state is off by one part in 2^20, and
    for a backward fed a nonzero output cotangent."""
    x, cu, kw = _inputs("fused", False)
    ref = _value_and_grads(_full(kw), x)
    p = paths.FORWARD_BY_NAME["fused"]

    def off(*a):
        fin, saved = p.run_final(*a)
        return fin * (1 + 2.0 ** -20), saved

    with monkeypatch.context() as m:
        m.setitem(paths.FORWARD_BY_NAME, "fused", dataclasses.replace(p, run_final=off))
        with pytest.raises(AssertionError):
            _assert_same(_value_and_grads(_final(kw), x), ref)
    bwd = pallas_vjp._bwd
    monkeypatch.setattr(pallas_vjp, "_bwd", lambda route, res, cts: bwd(route, res, (jnp.ones_like(cts[0]), cts[1])))
    got = _value_and_grads(_final(kw), x)
    _assert_same(got[0], ref[0])  # the forward is right ...
    with pytest.raises(AssertionError):
        _assert_same(got, ref)  # ... the gradients are not


def _old_state_map(k, v, g, beta, *, initial_state=None, cu_seqlens=None, continues=None, **kw):
    """state_map as it was: the maps from the full op's final state."""
    def fin(values, start):
        return gated_delta_rule(k, k, values, g, beta, initial_state=start, cu_seqlens=cu_seqlens,
                                output_final_state=True, **kw)[1]

    return affine_state_map(fin, k, v, g, beta, dtype=F32, initial_state=initial_state, cu_seqlens=cu_seqlens,
                            continues=continues)


def test_state_map_unchanged_and_against_reference():
    """M, N of state_map on the pallas backend (interpret; the final-only entry) equal the full
    op's pass bit for bit, and the float64 reference (M: the final state of values 0 from I; N: of
    v from 0) to rel. rms TOL_S; packed documents (the first continuing, with initial states) too."""
    kw = dict(backend="pallas", chunk_size=16, kernel_config=KernelConfig(platform="interpret"))
    x = make_inputs(seed_of("final-state-map"), 2, 100, 4, 16, 32, gates="weak")
    k = x.k[:, :, :2]  # grouped value heads: 2 value heads per key head
    M, N = state_map(k, x.v, x.g, x.beta, **kw)
    _assert_same((M, N), _old_state_map(k, x.v, x.g, x.beta, **kw))
    eye = jnp.broadcast_to(jnp.eye(16, dtype=F32), (2, 4, 16, 16))
    _, rM = reference(k, k, jnp.zeros(x.v.shape[:-1] + (16,), F32), x.g, x.beta, initial_state=eye)
    _, rN = reference(k, k, x.v, x.g, x.beta)
    check_close({"M": (M, rM, TOL_S), "N": (N, rN, TOL_S)})
    cu = jnp.asarray([0, 30, 30, 100], jnp.int32)
    init = jnp.asarray(np.random.default_rng(seed_of("final-state-map-init")).standard_normal((3, 4, 16, 32)), F32)
    args = (k[:1], x.v[:1], x.g[:1], x.beta[:1])
    pk = dict(kw, initial_state=init, cu_seqlens=cu, continues=jnp.asarray(True))
    _assert_same(state_map(*args, **pk), _old_state_map(*args, **pk))


def test_hopper_wide_backward():
    """V = 256 on the Hopper kernels (the width K + V of a map at K = V = 128 on the GPU): the
    backward is the wide one ("hopper_blocks"), which reads the forward's saved states, here from
    the final-only state pass (h and Vn written, no o): bit-equal to the full op, forward and grads."""
    cfg = KernelConfig(**MOSAIC)
    x = make_inputs(seed_of("final-state-wide"), 1, 128, 2, 64, 256, gates="weak", init=True, dtype=BF16)
    kw = dict(backend="pallas", chunk_size=64, kernel_config=cfg)
    from gdn_jax.ops.pallas import backward_kernels

    assert backward_kernels(x.q, x.k, x.v, x.g, x.beta, chunk_size=64, kernel_config=cfg).path == "hopper_blocks"
    _assert_same(_value_and_grads(_final(kw), x), _value_and_grads(_full(kw), x))


@pytest.mark.parametrize("form,V,packed,grad", [("wu", 128, True, False), ("t", 128, False, False),
                                                (None, 256, True, True)])
def test_hopper_final_state_lowers_for_cuda(form, V, packed, grad):
    """The final-only Hopper state pass through Mosaic GPU's CUDA lowering (no GPU needed): both
    forms with the producer warpgroup (the GPU default at K = 128), packed and dense, and the default
    form at V = 256 (single q / W tiles and the wide backward) under value_and_grad."""
    from gdn_jax.ops import HopperTuning as HT

    cfg = KernelConfig(platform="gpu", gpu_kernels="mosaic", hopper=HT(fwd_form=form))
    sds = [jax.ShapeDtypeStruct((1, 256, 2, 128), BF16)] * 2 + [jax.ShapeDtypeStruct((1, 256, 2, V), BF16)]
    sds += [jax.ShapeDtypeStruct((1, 256, 2), F32), jax.ShapeDtypeStruct((1, 256, 2), BF16)]
    cu = jnp.asarray([0, 100, 101, 256], jnp.int32) if packed else None
    f = lambda q, k, v, g, b: final_state(q, k, v, g, b, backend="pallas", chunk_size=64, kernel_config=cfg,
                                          cu_seqlens=cu).sum()
    if grad:
        f = jax.value_and_grad(f, argnums=(0, 1, 2, 3, 4))
    text = jax.export.export(jax.jit(f), platforms=["cuda"])(*sds).mlir_module()
    assert text.count("custom_call @mosaic_gpu") == (4 if grad else 2)
