"""Data and head parallelism: under ``jax.jit`` on inputs sharded along the batch and / or the heads
(``NamedSharding(mesh, P(...))``), every backend of the op, the decode step, gated linear attention,
the GatedDeltaNet layer and ``gdn_jax.training``'s data-parallel step run on each device's block
with no all-gather (counted in the compiled HLO), outputs and gradients keep the inputs' sharding
and equal the unsharded run's.

Devices: the 4 CPU devices of tests/conftest.py (``jax_num_cpu_devices``); meshes of 2 (batch
only, heads only) and 4 (batch x heads). The Pallas kernels run in interpret mode; tiny shapes.
Equality: the sharded run computes each (batch row, head) with the same kernels on the same data,
so its results are the unsharded run's bit for bit (asserted as such).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from conftest import make_inputs, seed_of

from gdn_jax.ops import gated_delta_rule, gated_delta_rule_step, gated_linear_attention

COLLECTIVES = ("all-gather", "all-to-all", "collective-permute", "all-reduce")

pytestmark = pytest.mark.skipif(len(jax.devices()) < 4, reason="needs 4 devices (tests/conftest.py sets 4 CPU devices)")


def _mesh(data: int, model: int) -> Mesh:
    return Mesh(np.array(jax.devices()[:data * model]).reshape(data, model), ("data", "model"))


def _spec(batch: bool, heads: bool, head_axis: int, ndim: int) -> P:
    """Batch on axis 0 over "data", heads on ``head_axis`` over "model"."""
    entries = [None] * ndim
    if batch:
        entries[0] = "data"
    if heads:
        entries[head_axis] = "model"
    return P(*entries)


def _same(spec, want) -> bool:
    """PartitionSpecs equal up to trailing unsplit axes."""
    trim = lambda s: tuple(s)[:max([i + 1 for i, e in enumerate(s) if e is not None], default=0)]
    return trim(spec) == trim(want)


def _collectives(fn, *args) -> dict:
    text = jax.jit(fn).lower(*args).compile().as_text()
    return {c: text.count(c) for c in COLLECTIVES}


def _check_equal(got, want, what, exact):
    """Bit for bit (``exact``), else to float32 round-off: XLA may order a sum differently for a
    device's smaller block (rel_rms <= 1e-6, measured <= 2e-7)."""
    got, want = jax.tree.leaves(got), jax.tree.leaves(want)
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want)):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        assert a.shape == b.shape, (what, i)
        if exact:
            np.testing.assert_array_equal(a, b, err_msg=f"{what} #{i}")
        else:
            err = np.sqrt(np.mean((a - b) ** 2) / max(np.mean(b ** 2), 1e-30))
            assert err <= 1e-6, (what, i, err)


def _run_sharded(fn, args, specs, mesh, *, exact=True, allowed=()):
    """``fn`` under jit on ``args`` placed with ``specs`` (a PartitionSpec per argument, applied to
    every leaf of it): no collective other than ``allowed`` in its compiled HLO; the outputs equal
    ``fn``'s on one device (returned: the sharded outputs)."""
    sharded = [jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip(args, specs)]
    counts = _collectives(fn, *sharded)
    assert all(n == 0 for c, n in counts.items() if c not in allowed), counts
    got = jax.jit(fn)(*sharded)
    _check_equal(got, jax.jit(fn)(*args), fn.__name__, exact)
    return got


def _gva_inputs(tag, B, T, Hk, group, K, V, *, N=None):
    x = make_inputs(seed_of(tag), B, T, Hk, K, V, init=True, N=N)
    if group > 1:
        y = make_inputs(seed_of(tag, "v"), B, T, Hk * group, K, V, init=True, N=N)
        x = dict(x, v=y["v"], g=y["g"], beta=y["beta"], S0=y["S0"], do=y["do"], dS=y["dS"])
    return x


# (backend, data, model, value heads per key head, cu_seqlens): every mesh for pallas, each with
# other options, and the XLA backends on the batch x heads mesh
OP_CASES = [
    ("pallas", 2, 1, 1, None),
    ("pallas", 1, 2, 2, (0, 9, 30, 37)),
    ("pallas", 2, 2, 1, None),
    ("chunk", 2, 2, 2, None),
    ("scan", 2, 2, 1, None),
]


@pytest.mark.parametrize("backend,data,model,group,cu", OP_CASES)
def test_op_keeps_sharding(backend, data, model, group, cu):
    """gated_delta_rule forward and backward (o, final state, the six gradients) on a mesh of batch
    ("data") x heads ("model"): no collective, every output sharded like its input, the values of
    the unsharded run. Packed sequences (cu_seqlens, B = 1) split over the heads."""
    B = 1 if cu else 2
    N = None if cu is None else len(cu) - 1
    x = _gva_inputs(("sharding", backend, data, model, group, cu), B, 37, 2, group, 16, 32 if group > 1 else 16, N=N)
    cu_j = None if cu is None else jnp.asarray(cu, jnp.int32)

    def fwd_bwd(q, k, v, g, beta, s0, do, ds):
        def op(*a):
            return gated_delta_rule(*a[:5], initial_state=a[5], output_final_state=True, cu_seqlens=cu_j,
                                    backend=backend, chunk_size=16, use_qk_l2norm=data == model)
        out, vjp = jax.vjp(op, q, k, v, g, beta, s0)
        return out, vjp((do, ds))

    args = (x["q"], x["k"], x["v"], x["g"], x["beta"], x["S0"], x["do"], x["dS"])
    tok = _spec(data > 1, model > 1, 2, 4)
    gate = _spec(data > 1, model > 1, 2, 3)
    state = _spec(data > 1, model > 1, 1, 4)
    specs = (tok, tok, tok, gate, gate, state, tok, state)
    (o, s), grads = _run_sharded(fwd_bwd, args, specs, _mesh(data, model), exact=backend == "pallas")
    assert _same(o.sharding.spec, tok) and _same(s.sharding.spec, state)
    for gr, sp in zip(grads, specs):
        assert _same(gr.sharding.spec, sp)


def test_unsharded_program_unchanged():
    """On one device the partitioning wrapper is inlined: no custom partitioning call is lowered."""
    x = make_inputs(seed_of("sharding-one-device"), 1, 20, 1, 16, 16)
    f = lambda *a: gated_delta_rule(*a, backend="pallas", chunk_size=16)[0]
    text = jax.jit(jax.grad(lambda *a: jnp.sum(f(*a)), argnums=(0, 1, 2))).lower(
        x["q"], x["k"], x["v"], x["g"], x["beta"]).as_text()
    assert "CustomSPMDPartitioning" not in text and "tpu_custom_call" not in text


@pytest.mark.parametrize("backend", ["pallas", "scan"])
def test_step_keeps_sharding(backend):
    """gated_delta_rule_step (grouped value heads) forward and backward on the batch x heads mesh."""
    Hk, group, K, V = 2, 2, 16, 16
    x = _gva_inputs(("sharding-step", backend), 2, 1, Hk, group, K, V)
    q, k, v, g, beta = (x[n][:, 0] for n in ("q", "k", "v", "g", "beta"))
    s0, do, ds = x["S0"], x["do"][:, 0], x["dS"]

    def fwd_bwd(q, k, v, g, beta, s0, do, ds):
        out, vjp = jax.vjp(lambda *a: gated_delta_rule_step(*a, backend=backend, use_qk_l2norm=True), q, k, v, g,
                           beta, s0)
        return out, vjp((do, ds))

    vec, gate, state = P("data", "model", None), P("data", "model"), P("data", "model", None, None)
    (o, s), grads = _run_sharded(fwd_bwd, (q, k, v, g, beta, s0, do, ds), (vec, vec, vec, gate, gate, state, vec, state),
                                 _mesh(2, 2), exact=False)
    assert _same(o.sharding.spec, vec) and _same(s.sharding.spec, state) and _same(grads[3].sharding.spec, gate)


@pytest.mark.parametrize("backend,per_channel", [("chunk", True), ("scan", False)])
def test_linear_attention_keeps_sharding(backend, per_channel):
    """gated_linear_attention (GLA per-key-channel / per-head decay, grouped value heads) forward and
    backward on the batch x heads mesh."""
    x = _gva_inputs(("sharding-gla", backend), 2, 37, 2, 2, 16, 16)
    g = x["g"][..., None] * jnp.linspace(0.5, 1.5, 16) if per_channel else x["g"]

    def fwd_bwd(q, k, v, g, s0, do, ds):
        out, vjp = jax.vjp(lambda *a: gated_linear_attention(*a[:4], initial_state=a[4], output_final_state=True,
                                                             backend=backend, chunk_size=16), q, k, v, g, s0)
        return out, vjp((do, ds))

    tok, state = P("data", None, "model", None), P("data", "model", None, None)
    gate = tok if per_channel else P("data", None, "model")
    (o, _), _ = _run_sharded(fwd_bwd, (x["q"], x["k"], x["v"], g, x["S0"], x["do"], x["dS"]),
                             (tok, tok, tok, gate, state, tok, state), _mesh(2, 2), exact=False)
    assert _same(o.sharding.spec, tok)


def test_layer_data_parallel():
    """The GatedDeltaNet layer (backend pallas, replicated parameters) on a batch split over 2
    devices: output and gradients of the input and of every parameter as unsharded; the only
    collective is the all-reduce of the parameter gradients."""
    from gdn_jax.layers import GatedDeltaNet

    layer = GatedDeltaNet(32, num_heads=2, head_dim=16, backend="pallas", chunk_size=16, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(layer)
    xin = jnp.asarray(np.random.default_rng(seed_of("sharding-layer")).standard_normal((2, 24, 32)), jnp.float32)

    def fwd_bwd(params, x):
        def loss(params, x):
            y = nnx.merge(graphdef, params)(x)
            return jnp.sum(y * y), y

        (_, y), grads = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(params, x)
        return y, grads

    mesh = _mesh(2, 1)
    y, (dp, dx) = _run_sharded(fwd_bwd, (params, xin), (P(), P("data")), mesh, exact=False, allowed=("all-reduce",))
    assert _same(y.sharding.spec, P("data")) and _same(dx.sharding.spec, P("data"))


def test_training_step_data_parallel():
    """gdn_jax.training's data-parallel step (make_mesh / shard_batch / make_train_step) on 2
    devices with a GDN LM on backend pallas: no all-gather, loss and updated parameters as the
    unsharded step's (to float32 round-off of the cross-device gradient sum)."""
    from gdn_jax import training as T
    from gdn_jax.data import MQARConfig, TaskLoader
    from gdn_jax.models import LM, LMConfig

    cfg = LMConfig(vocab_size=32, d_model=32, num_layers=1, num_heads=2, chunk_size=16, backend="pallas")
    task = MQARConfig(vocab_size=32, seq_len=16, num_kv_pairs=2, test_examples=8)
    tx = T.make_optimizer(1e-2, warmup_steps=1, total_steps=4)
    batch = TaskLoader(task, 4, mode="stream").batch(0)
    mesh = T.make_mesh(jax.devices()[:2])
    graphdef, state = T.create_train_state(LM(cfg, rngs=nnx.Rngs(0)), tx, seed=0, mesh=mesh)
    step = T.make_train_step(graphdef, tx, mesh, donate=False)
    sharded = T.shard_batch(batch, mesh)
    text = step.lower(state, sharded).compile().as_text()
    assert text.count("all-gather") == 0 and text.count("all-to-all") == 0
    new, m = step(state, sharded)

    _, state1 = T.create_train_state(LM(cfg, rngs=nnx.Rngs(0)), tx, seed=0)
    new1, m1 = T.make_train_step(graphdef, tx, donate=False)(state1, batch)
    np.testing.assert_allclose(float(m["loss"]), float(m1["loss"]), rtol=1e-6)
    for a, b in zip(jax.tree.leaves(new), jax.tree.leaves(new1)):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=1e-5, atol=1e-6)
