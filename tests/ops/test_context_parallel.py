"""Context parallelism (T sharded over a mesh axis, ``gdn_jax.ops.context_parallel``) against the
unsharded op (gated_delta_rule; op="la": gated_linear_attention, the no-delta-rule baselines):
o, final state and the gradient of every input (q, k, v, g, beta, initial_state),
each gradient also shard by shard (FLA #1115's bug class: wrong gradients on non-last shards).

2 and 4 shards run in this process (tests/conftest.py gives it 4 CPU devices), 8 in a subprocess
of 8 simulated devices (tests/ops/cp_check.py). Cases are pairwise over backend (scan, chunk,
pallas in interpret mode), packed documents crossing shards (``cu_seqlens``, one empty document,
one starting on a boundary), GVA, per-key-channel g, l2norm, initial state.
Tolerance: max |sharded - unsharded| <= 1e-5 max |unsharded| per array and per shard (float32
rounding: measured <= 7e-7, results/context_parallel_cpu/summary.md).
"""
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

from gdn_jax.ops.context_parallel import context_parallel_gated_delta_rule, shard_gated_delta_rule

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import cp_check  # noqa: E402

TOL = 1e-5
FIELDS = ("o", "final", "dq", "dk", "dv", "dg", "dbeta", "ds0")

CASES = {  # devices -> cases (pairwise: every backend packed and not, GVA, per-key-channel g)
    2: [dict(backend="pallas", packed=True, Hk=1, H=2), dict(backend="scan", g_pc=True, B=2),
        dict(op="la", no_decay=True, B=2),
        dict(backend="pallas", platform="tpu_interpret", packed=True)],  # the TPU kernels (streaming state passes)
    4: [dict(backend="chunk", packed=True, g_pc=True), dict(backend="scan", packed=True, Hk=1, H=2, l2norm=True),
        dict(backend="pallas", B=2, init=False), dict(op="la", packed=True, g_pc=True)],
    8: [dict(backend="chunk", B=2, Hk=1, H=2), dict(backend="scan", packed=True, g_pc=True),
        dict(backend="pallas", packed=True), dict(op="la", backend="scan", packed=True)],
}


def check(res):
    for f in FIELDS:
        if f in res:
            assert res[f] <= TOL, (f, res[f], res["case"])
        for i, e in enumerate(res.get(f + "_per_shard", [])):
            assert e <= TOL, (f, "shard", i, e, res["case"])
            assert res[f + "_shard_norms"][i] > 0, (f, "zero gradient on shard", i)  # a test that can fail


@pytest.mark.parametrize("devices, case", [(d, c) for d in (2, 4) for c in CASES[d]])
def test_sharded_equals_unsharded(devices, case):
    check(cp_check.run_case(case, devices))


def test_eight_devices():
    """8 simulated devices (a process of its own), T = 32: 4 tokens a shard."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    p = subprocess.run([sys.executable, cp_check.__file__, "--devices", "8", "--cases", json.dumps(CASES[8])],
                       env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    lines = [json.loads(x) for x in p.stdout.splitlines() if x.startswith("{")]
    assert len(lines) == len(CASES[8])
    for res in lines:
        assert res["devices"] == 8
        check(res)


def _mesh(n=2):
    return Mesh(np.array(jax.devices()[:n]), ("seq",))


def _inputs(B=1, T=8, H=1, K=16, V=16, beta_v=False):
    r = np.random.default_rng(1)
    q, k, v = (jnp.asarray(r.standard_normal((B, T, H, d)), jnp.float32) for d in (K, K, V))
    g = -jnp.ones((B, T, H)) * 0.1
    beta = jnp.full((B, T, H) + ((V,) if beta_v else ()), 0.5)
    return q, k, v, g, beta


def test_refusals():
    """Per-value-channel beta, mask_nonfinite, a T the axis does not divide and a bad cu_seqlens are refused by name."""
    mesh = _mesh()
    with pytest.raises(ValueError, match="per-value-channel beta"):
        shard_gated_delta_rule(*_inputs(beta_v=True), mesh=mesh, axis="seq", backend="scan")
    with pytest.raises(ValueError, match="mask_nonfinite"):
        shard_gated_delta_rule(*_inputs(), mesh=mesh, axis="seq", backend="scan", mask_nonfinite=True)
    with pytest.raises(ValueError, match="multiple of the 2 devices"):
        shard_gated_delta_rule(*_inputs(T=7), mesh=mesh, axis="seq", backend="scan")
    with pytest.raises(ValueError, match="end at T = 8"):
        shard_gated_delta_rule(*_inputs(), mesh=mesh, axis="seq", backend="scan", cu_seqlens=jnp.array([0, 3, 4]))
    with pytest.raises(TypeError, match="cu_seqlens must be an integer array, got float"):
        shard_gated_delta_rule(*_inputs(), mesh=mesh, axis="seq", backend="scan", cu_seqlens=[0.0, 3.0, 8.0])


def test_refusals_name_the_argument():
    """A mesh axis that does not exist (shard_gated_delta_rule's axis / batch_axis; axis_name and a
    layer's context_axis that no enclosing shard_map binds, or a call outside one) and an
    initial_state of the wrong shape (checked before the state maps use it) are ValueErrors naming
    the argument, not JAX's KeyError / NameError or a concatenate's TypeError."""
    from flax import nnx
    from jax.sharding import PartitionSpec as P

    from gdn_jax.layers import Attention, GatedDeltaNet

    mesh, x = _mesh(), _inputs(T=16, H=2)
    with pytest.raises(ValueError, match=r"axis='sequence' is not an axis of the mesh, whose axes are \('seq',\)"):
        shard_gated_delta_rule(*x, mesh=mesh, axis="sequence", backend="scan")
    with pytest.raises(ValueError, match="batch_axis='data' is not an axis of the mesh"):
        shard_gated_delta_rule(*x, mesh=mesh, axis="seq", batch_axis="data", backend="scan")
    with pytest.raises(ValueError, match="must be different mesh axes"):
        shard_gated_delta_rule(*x, mesh=mesh, axis="seq", batch_axis="seq", backend="scan")
    spec = P(None, "seq")
    own = lambda fn: jax.shard_map(fn, mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False)
    with pytest.raises(ValueError, match="axis_name='sequence' is not a mesh axis of an enclosing jax.shard_map"):
        jax.shard_map(lambda *a: context_parallel_gated_delta_rule(*a, axis_name="sequence", backend="scan")[0],
                      mesh=mesh, in_specs=(spec,) * 5, out_specs=spec)(*x)
    for layer in (GatedDeltaNet(32, 2, 16, backend="chunk", chunk_size=16, rngs=nnx.Rngs(0)),
                  Attention(32, 2, 16, rngs=nnx.Rngs(0))):
        with pytest.raises(ValueError, match="context_axis='sequence' is not a mesh axis"):
            own(lambda h: layer(h, context_axis="sequence"))(jnp.ones((1, 16, 32)))
        with pytest.raises(ValueError, match="context_axis='seq' is not a mesh axis"):  # outside any shard_map
            layer(jnp.ones((1, 16, 32)), context_axis="seq")
    cu = jnp.asarray([0, 5, 16], jnp.int32)
    wrong_n = r"\[N, H, K, V\].*\(2, 2, 16, 16\), got shape \(3,"
    wrong_v = r"\[B, H, K, V\] = \(1, 2, 16, 16\), got shape \(1, 2, 16, 8\)"
    for s0, cus, want in ((jnp.zeros((3, 2, 16, 16)), cu, wrong_n), (jnp.zeros((1, 2, 16, 8)), None, wrong_v)):
        with pytest.raises(ValueError, match=want):
            shard_gated_delta_rule(*x, mesh=mesh, axis="seq", backend="chunk", initial_state=s0, cu_seqlens=cus)


def test_cu_seqlens_as_a_list():
    """Boundaries as a Python list or tuple, which gated_delta_rule takes, are taken too (before:
    "cu_seqlens must be an integer array"), and give the unsharded op's result (<= 1e-5 of the max)."""
    from gdn_jax.ops import gated_delta_rule

    q, k, v, g, beta = _inputs(T=8)
    k = k / jnp.linalg.norm(k, axis=-1, keepdims=True)
    o0 = gated_delta_rule(q, k, v, g, beta, backend="scan", cu_seqlens=[0, 3, 8])[0]
    for cu in ([0, 3, 8], (0, 3, 8)):
        f = jax.jit(lambda *a: shard_gated_delta_rule(*a, mesh=_mesh(), axis="seq", backend="scan", cu_seqlens=cu)[0])
        o1 = f(q, k, v, g, beta)
        assert float(jnp.max(jnp.abs(o1 - o0))) <= TOL * float(jnp.max(jnp.abs(o0)))


def test_user_shard_map():
    """context_parallel_gated_delta_rule inside a shard_map of one's own (batch over 'data', T over 'seq')."""
    from jax.sharding import PartitionSpec as P

    from gdn_jax.ops import gated_delta_rule

    mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("data", "seq"))
    q, k, v, g, beta = _inputs(B=2, T=16)
    spec = P("data", "seq")
    f = jax.shard_map(lambda *a: context_parallel_gated_delta_rule(*a, axis_name="seq", backend="chunk",
                                                                   chunk_size=16, output_final_state=True),
                      mesh=mesh, in_specs=(spec,) * 5, out_specs=(spec, P("data")))
    o1, s1 = jax.jit(f)(q, k / jnp.linalg.norm(k, axis=-1, keepdims=True), v, g, beta)
    o0, s0 = gated_delta_rule(q, k / jnp.linalg.norm(k, axis=-1, keepdims=True), v, g, beta, backend="chunk",
                              chunk_size=16, output_final_state=True)
    np.testing.assert_allclose(o1, o0, rtol=0, atol=1e-5 * float(jnp.abs(o0).max()))
    np.testing.assert_allclose(s1, s0, rtol=0, atol=1e-5 * float(jnp.abs(s0).max()))


@pytest.mark.parametrize("kind, packed", [("gdn", False), ("kda", True), ("gla", True), ("gated_attention", True)])
def test_layer_sharded_equals_unsharded(kind, packed):
    """A layer over 4 shards of T = 32 (gdn; kda: GatedDeltaNet with per-key-channel decay; gla:
    GatedLinearAttention with per-key-channel decay; gated_attention: K, V all-gathered, RoPE at
    global positions) with the short conv's halo: output and the gradients of every parameter and
    of x equal the unsharded layer's (packed: documents crossing shards, the conv, the recurrence
    and RoPE restarting inside a shard)."""
    from flax import nnx
    from jax.sharding import PartitionSpec as P

    from gdn_jax.layers import Attention, GatedDeltaNet, GatedLinearAttention

    layer = {"gdn": lambda: GatedDeltaNet(32, 2, 16, backend="chunk", chunk_size=16, rngs=nnx.Rngs(0)),
             "kda": lambda: GatedDeltaNet(32, 2, 16, decay_per_channel=True, backend="chunk", chunk_size=16,
                                          rngs=nnx.Rngs(0)),
             "gla": lambda: GatedLinearAttention(32, 2, 16, decay="gla", chunk_size=16, rngs=nnx.Rngs(0)),
             "gated_attention": lambda: Attention(32, 2, 16, rope_fraction=0.5, qk_norm=True, output_gate=True,
                                                  rngs=nnx.Rngs(0))}[kind]()
    graphdef, params = nnx.split(layer)
    r = np.random.default_rng(3)
    B = 1 if packed else 2
    x = jnp.asarray(r.standard_normal((B, 32, 32)), jnp.float32)
    w = jnp.asarray(r.standard_normal((B, 32, 32)), jnp.float32)
    cu = jnp.asarray(cp_check.PACKED_CU, jnp.int32) if packed else None
    mesh = _mesh(4)

    def ref(p, x):
        return nnx.merge(graphdef, p)(x, cu_seqlens=cu)

    def sharded(p, x):
        body = lambda p, x, cu: nnx.merge(graphdef, p)(x, cu_seqlens=cu, context_axis="seq")
        return jax.shard_map(body, mesh=mesh, in_specs=(P(), P(None, "seq"), P()),
                             out_specs=P(None, "seq"))(p, x, cu)

    def run(fn):
        return jax.jit(jax.value_and_grad(lambda p, x: jnp.sum(fn(p, x) * w), argnums=(0, 1)))(params, x)

    (l0, (gp0, gx0)), (l1, (gp1, gx1)) = run(ref), run(sharded)
    y0, y1 = jax.jit(ref)(params, x), jax.jit(sharded)(params, x)
    assert float(jnp.max(jnp.abs(y1 - y0))) <= TOL * float(jnp.max(jnp.abs(y0)))
    for a, b in zip(jax.tree.leaves((gp0, gx0)), jax.tree.leaves((gp1, gx1))):
        assert float(jnp.max(jnp.abs(a))) > 0
        err = float(jnp.max(jnp.abs(b - a))) / float(jnp.max(jnp.abs(a)))
        print("layer grad rel err", a.shape, f"{err:.1e}")
        assert err <= 3 * TOL, (a.shape, err)  # measured <= 6e-6 (A_log: a sum over every token)


def test_lm_train_step_data_times_sequence():
    """A 2-layer hybrid LM (gdn, gated_attention) training step on a 2 x 2 mesh (batch over 'data', T over
    'seq') equals the unsharded step: loss, accuracy, gradient norm and the updated parameters."""
    import optax
    from flax import nnx

    from gdn_jax.models import LM, LMConfig
    from gdn_jax.training import create_train_state, make_eval_step, make_mesh, make_train_step

    cfg = LMConfig(vocab_size=16, d_model=32, num_layers=2, num_heads=2, mixer=("gdn", "gated_attention"),
                   backend="pallas", chunk_size=16)  # the kernels (interpret mode) under the training shard_map
    r = np.random.default_rng(5)
    tokens = jnp.asarray(r.integers(0, 16, (2, 32)), jnp.int32)
    targets = jnp.asarray(np.where(r.random((2, 32)) < 0.7, r.integers(0, 16, (2, 32)), -100), jnp.int32)
    mesh = make_mesh(jax.devices()[:4], seq=2)  # ("data", "seq") = 2 x 2
    assert dict(mesh.shape) == {"data": 2, "seq": 2}
    tx = optax.sgd(0.5)
    out = []
    for m in (None, mesh):
        graphdef, state = create_train_state(LM(cfg, rngs=nnx.Rngs(0)), tx, seed=0, mesh=m)
        state, metrics = make_train_step(graphdef, tx, m)(state, (tokens, targets))
        ev = make_eval_step(graphdef, m)(state, (tokens, targets))
        out.append((state.params, metrics, ev))
    (p0, m0, e0), (p1, m1, e1) = out
    for k in ("loss", "accuracy", "grad_norm"):
        np.testing.assert_allclose(m1[k], m0[k], rtol=1e-5, err_msg=k)
    for k in ("loss_sum", "correct", "count"):
        np.testing.assert_allclose(e1[k], e0[k], rtol=1e-5, err_msg=k)
    for a, b in zip(jax.tree.leaves(p0), jax.tree.leaves(p1)):
        np.testing.assert_allclose(b, a, rtol=0, atol=1e-5)


def test_state_map_composes():
    """state_map alone (no mesh): M S + N is the op's final state from S, and the map of a
    sequence is the composition of its halves' maps (float32 rounding: <= 1e-5 of the max)."""
    from gdn_jax.ops import gated_delta_rule
    from gdn_jax.ops.state_maps import apply_map, compose, state_map

    q, k, v, g, beta = _inputs(B=2, T=32, H=2)
    k = k / jnp.linalg.norm(k, axis=-1, keepdims=True)
    S = jnp.asarray(np.random.default_rng(2).standard_normal((2, 2, 16, 16)), jnp.float32)
    kw = dict(backend="chunk", chunk_size=16)
    M, N = state_map(k, v, g, beta, **kw)
    _, ref = gated_delta_rule(q, k, v, g, beta, initial_state=S, output_final_state=True, **kw)
    close = lambda a, b: float(jnp.max(jnp.abs(a - b))) <= 1e-5 * float(jnp.max(jnp.abs(b)))
    assert close(apply_map(M, N, S), ref)
    half = lambda sl: state_map(*(x[:, sl] for x in (k, v, g, beta)), **kw)
    M2, N2 = compose(*half(slice(16, 32)), *half(slice(0, 16)))
    assert close(M2, M) and close(N2, N)


def test_state_map_width_stays_on_the_narrow_backend():
    """The augmented width K + V runs as one call only where it resolves to the same backend as the
    widths K and V: on a GPU, "auto" at K = V = 256 would send width 512 to the chunk form (the
    Pallas kernels stop at 256), so M and N are two Pallas calls; at K = V = 128 (width 256 on
    Pallas) one call; an explicit "pallas" beyond its widths: two calls; on CPU "auto" is chunk at
    every width: one call. And the two-call maps equal the one-call maps (float32 rounding)."""
    from gdn_jax.ops._common import GateForms
    from gdn_jax.ops.state_maps import _augmented_widths, state_map
    from gdn_jax.ops.piece_maps import affine_state_map

    forms = GateForms(g_per_channel=False, beta_per_channel=False)
    bf = jnp.bfloat16
    assert _augmented_widths("auto", forms, 64, 128, 128, bf, platform="gpu")
    assert not _augmented_widths("auto", forms, 64, 256, 256, bf, platform="gpu")
    assert not _augmented_widths("pallas", forms, 64, 256, 256, bf, platform="gpu")
    assert not _augmented_widths("auto", forms, 64, 128, 256, bf, platform="gpu")
    assert _augmented_widths("auto", forms, 64, 256, 256, bf, platform="cpu")

    from gdn_jax.ops.gated_delta_rule import final_state

    q, k, v, g, beta = _inputs(B=2, T=32, H=2)
    k = k / jnp.linalg.norm(k, axis=-1, keepdims=True)
    fs = lambda values, start: final_state(k, k, values, g, beta, initial_state=start, backend="chunk", chunk_size=16)
    one = affine_state_map(fs, k, v, dtype=jnp.float32, augmented=True)
    two = affine_state_map(fs, k, v, dtype=jnp.float32, augmented=False)
    for a, b in zip(one, two):
        assert float(jnp.max(jnp.abs(a - b))) <= 1e-5 * float(jnp.max(jnp.abs(a)))
    M, N = state_map(k, v, g, beta, backend="chunk", chunk_size=16)
    assert float(jnp.max(jnp.abs(M - one[0]))) <= 1e-5 * float(jnp.max(jnp.abs(M)))


def test_refusals_layers_and_models():
    """Shards shorter than the conv halo, learned positions and a user-registered mixer are
    refused by name under context_axis."""
    from flax import nnx
    from jax.sharding import PartitionSpec as P

    from gdn_jax.layers import GatedDeltaNet
    from gdn_jax.models import LM, LMConfig
    from gdn_jax.models.lm import MIXERS, register_mixer

    layer = GatedDeltaNet(32, 2, 16, backend="chunk", chunk_size=16, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(layer)
    body = lambda p, x: nnx.merge(graphdef, p)(x, context_axis="seq")
    f = jax.shard_map(body, mesh=_mesh(4), in_specs=(P(), P(None, "seq")), out_specs=P(None, "seq"))
    with pytest.raises(ValueError, match="kernel_size - 1 = 3"):
        f(params, jnp.ones((1, 8, 32)))  # 2 tokens a shard, a halo of 3
    tokens = jnp.zeros((1, 8), jnp.int32)
    with pytest.raises(NotImplementedError, match="pos_embedding"):
        LM(LMConfig(vocab_size=16, d_model=32, num_layers=1, num_heads=2, pos_embedding="learned", max_seq_len=8),
           rngs=nnx.Rngs(0))(tokens, context_axis="seq")
    register_mixer("cp_test_custom", lambda cfg, i, rngs: GatedDeltaNet(cfg.d_model, cfg.num_heads, rngs=rngs))
    try:
        lm = LM(LMConfig(vocab_size=16, d_model=32, num_layers=1, num_heads=2, mixer="cp_test_custom"),
                rngs=nnx.Rngs(0))
        with pytest.raises(NotImplementedError, match="cp_test_custom"):
            lm(tokens, context_axis="seq")
    finally:
        MIXERS.pop("cp_test_custom", None)


@pytest.mark.parametrize("kernels", ["triton", "tpu", "hopper"])
def test_pallas_kernels_typed_for_checked_shard_map(kernels):
    """The compiled Pallas kernels (Triton, Mosaic TPU, the Hopper kernels of Mosaic GPU: traced
    here, not run) inside ``shard_map(check_vma=True)``: forward, state maps and backward
    type-check (the out_shapes carry the inputs' varying mesh axes; untyped, pallas_call refuses
    them, and plgpu.kernel's untyped outputs fail the backward), packed documents, an initial
    state and the final state; the output varies over 'seq'."""
    from jax.sharding import PartitionSpec as P

    from gdn_jax.ops._vma import varying_axes
    from gdn_jax.ops.pallas import KernelConfig

    config = {"triton": KernelConfig(platform="gpu", gpu_kernels="triton"), "tpu": KernelConfig(platform="tpu"),
              "hopper": KernelConfig(platform="gpu", gpu_kernels="mosaic")}[kernels]
    hopper = kernels == "hopper"  # the Hopper kernels take bf16, head dims >= 64, chunk 64
    D, T, C, dt = (64, 256, 64, jnp.bfloat16) if hopper else (16, 32, 16, jnp.float32)
    q, k, v, g, beta = _inputs(T=T, H=2, K=D, V=D)
    q, k, v = (x.astype(dt) for x in (q, k, v))
    cu = jnp.asarray([int(c) * T // 32 for c in cp_check.PACKED_CU], jnp.int32)
    s0 = jnp.ones((len(cp_check.PACKED_CU) - 1, 2, D, D)) * 0.1
    seen = []

    def body(q, k, v, g, beta, s0, cu):
        o, fin = context_parallel_gated_delta_rule(q, k, v, g, beta, axis_name="seq", initial_state=s0, cu_seqlens=cu,
                                                   output_final_state=True, backend="pallas", chunk_size=C,
                                                   kernel_config=config)
        seen.append(varying_axes(o))
        return o, fin

    spec = P(None, "seq")
    f = jax.shard_map(body, mesh=_mesh(4), in_specs=(spec,) * 5 + (P(), P()), out_specs=(spec, P()), check_vma=True)
    loss = lambda *a: jnp.sum(f(*a, cu)[0].astype(jnp.float32)) + jnp.sum(f(*a, cu)[1])
    jaxpr = str(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2, 3, 4, 5)))(q, k, v, g, beta, s0))
    assert seen and all(s == {"seq"} for s in seen)
    assert ("mpmd_map" in jaxpr) == hopper and ("pallas_call" in jaxpr) != hopper  # the kernels asked for


def test_pallas_interpreter_in_user_shard_map():
    """The Pallas kernels in JAX's interpreter (CPU) inside a shard_map of one's own: with
    check_vma=False equal to the unsharded op (<= 1e-5 of the max, o and the gradient of q); with
    check_vma=True (which JAX's interpreter cannot lower) a ValueError that names check_vma=False,
    at trace time."""
    from jax.sharding import PartitionSpec as P

    from gdn_jax.ops import gated_delta_rule

    q, k, v, g, beta = _inputs(T=32, H=2)
    k = k / jnp.linalg.norm(k, axis=-1, keepdims=True)
    body = lambda *a: context_parallel_gated_delta_rule(*a, axis_name="seq", backend="pallas", chunk_size=16)[0]
    spec = P(None, "seq")
    sm = lambda check: jax.shard_map(body, mesh=_mesh(2), in_specs=(spec,) * 5, out_specs=spec, check_vma=check)
    with pytest.raises(ValueError, match="check_vma=False"):
        jax.make_jaxpr(sm(True))(q, k, v, g, beta)
    ref = lambda q: gated_delta_rule(q, k, v, g, beta, backend="chunk", chunk_size=16)[0]
    o1, o0 = jax.jit(sm(False))(q, k, v, g, beta), ref(q)
    assert float(jnp.max(jnp.abs(o1 - o0))) <= TOL * float(jnp.max(jnp.abs(o0)))
    w = jnp.asarray(np.random.default_rng(4).standard_normal(o0.shape), jnp.float32)
    d1 = jax.jit(jax.grad(lambda q: jnp.sum(sm(False)(q, k, v, g, beta) * w)))(q)
    d0 = jax.grad(lambda q: jnp.sum(ref(q) * w))(q)
    assert float(jnp.max(jnp.abs(d1 - d0))) <= TOL * float(jnp.max(jnp.abs(d0)))
