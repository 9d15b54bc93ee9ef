"""Prefill + decode against the full forward for every decode backend (``"scan"``, ``"pallas"``: the
fused step kernel, ``"fused_layer"``: the whole GDN layer in one kernel; Pallas in interpret mode on
CPU), float32 and bfloat16; the decode loop's unrolling and greedy path; what ``"auto"`` picks and
what the fused layer declines; the fused layer's drift over a long teacher-forced decode.

Tolerances (RMS-relative, the suite's of tests/models/test_inference.py): logits and caches 1e-5 in
float32, 2e-2 in bfloat16 (the fused layer keeps conv, SiLU and the read in float32 where the other
paths round them to bf16); conv states exactly equal (a shift of the projections, in float32; in
bf16 the projections of one token and of the prompt are separate matmuls: 2e-2). Drift: 1e-4 at
every one of 256 steps (test_inference.py's DRIFT_BOUND). The float32 tolerances assume float32
matmuls: on a GPU JAX's default precision lets XLA use TF32 (on one H100 the scan path's logits were
2e-4 off), so every test here runs at ``jax.default_matmul_precision("highest")`` (no effect on CPU).
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from gdn_jax.inference import GDNCache, KVCache
from gdn_jax.inference.generate import _decode_loop, decode_drift, decode_loop, generate
from gdn_jax.layers import GatedDeltaNet, KimiDeltaAttention
from gdn_jax.models import LM, LMConfig

BACKENDS = ("scan", "pallas", "fused_layer")


@pytest.fixture(autouse=True)
def _float32_matmuls():
    with jax.default_matmul_precision("highest"):
        yield


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.sqrt(np.mean((a - b) ** 2) / np.mean(b ** 2)))


def _hybrid(backend, dtype="float32", **kw):
    """GDN layer with grouped value heads (4 value heads over 2 key heads) + gated attention."""
    cfg = LMConfig(d_model=32, num_heads=2, num_layers=2, hybrid_every=2, hybrid_mixer="gated_attention",
                   num_v_heads=4, chunk_size=16, dtype=dtype, decode_backend=backend, embed_init_std=1.0, **kw)
    return LM(cfg, rngs=nnx.Rngs(0))


@pytest.mark.parametrize("dtype,tol", [("float32", 1e-5), ("bfloat16", 2e-2)])
@pytest.mark.parametrize("backend,B", [(b, 2) for b in BACKENDS] + [("fused_layer", 1)])
def test_prefill_plus_decode_equals_forward(backend, B, dtype, tol):
    """Prefill 14 tokens, decode 3 (jitted steps, the weight view built once; the last step without
    a view: the six projections as separate matmuls): every step's logits, then the GDN state, the conv states and the
    KV cache against the full forward and the prefill of all 17 tokens. B = 1 also covers the one-row
    projections run as two rows (``gdn_jax.layers._rows``: the output projection, the LM head)."""
    model = _hybrid(backend, dtype)
    gdn = model.blocks[0].mixer
    assert gdn.uses_fused_decode() == (backend == "fused_layer")
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, 256, (B, 17)), jnp.int32)
    full = jax.jit(model.__call__)(tokens)
    graphdef, state = nnx.split(model)
    _, cache = jax.jit(lambda st, t: nnx.merge(graphdef, st).prefill(t, 20))(state, tokens[:, :14])
    view = jax.jit(lambda st: nnx.merge(graphdef, st).decode_view())(state)
    assert (view[0] is not None) == (backend == "fused_layer") and view[1] is None
    step = jax.jit(lambda st, t, c, v: nnx.merge(graphdef, st).decode_step(t, c, view=v))
    for t in range(14, 17):
        lg, cache = step(state, tokens[:, t], cache, view if t < 16 else None)
        assert lg.dtype == jnp.float32 and rel(lg, full[:, t]) < tol, (t, rel(lg, full[:, t]))
    _, ref = model.prefill(tokens, 20)
    assert isinstance(cache[0], GDNCache) and isinstance(cache[1], KVCache)
    assert cache[0].state.dtype == jnp.float32 and cache[0].conv_q.dtype == jnp.dtype(dtype)
    for a, b in zip(jax.tree_util.tree_leaves(cache), jax.tree_util.tree_leaves(ref)):
        assert a.shape == b.shape and a.dtype == b.dtype
        if a.ndim == 0:
            assert int(a) == int(b) == 17
        else:
            assert rel(a, b) < tol
    if dtype == "float32":
        for a, b in zip(cache[0][1:], ref[0][1:]):
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("B", [1, 2])
def test_gradient_through_a_fused_layer_step_equals_the_scan_step(B):
    """jax.grad of a decode step's logits (after a prefill) with respect to every parameter and the
    GDN state: the fused layer (its custom VJP) against decode_backend="scan" on the same model,
    float32, within 1e-5 RMS-relative per leaf."""
    grads = {}
    tokens = jnp.asarray(np.random.default_rng(3).integers(0, 256, (B, 6)), jnp.int32)
    ct = jnp.asarray(np.random.default_rng(4).normal(size=(B, 256)), jnp.float32)
    for backend in ("scan", "fused_layer"):
        model = _hybrid(backend)
        graphdef, state = nnx.split(model)
        _, cache = model.prefill(tokens[:, :5], 8)

        def loss(st, gdn_state):
            c = (cache[0]._replace(state=gdn_state),) + tuple(cache[1:])
            lg, _ = nnx.merge(graphdef, st).decode_step(tokens[:, 5], c)
            return jnp.sum(lg * ct)

        grads[backend] = jax.jit(jax.grad(loss, argnums=(0, 1)))(state, cache[0].state)
    leaves = [jax.tree_util.tree_leaves(grads[b]) for b in ("scan", "fused_layer")]
    assert len(leaves[0]) == len(leaves[1]) > 10
    for a, b in zip(*leaves):
        if np.any(np.asarray(a)):
            assert rel(b, a) < 1e-5, rel(b, a)


def test_unrolled_loop_and_greedy_path_same_tokens():
    """decode_loop and generate give the same tokens for unroll 1 and 3 (7 steps: two unrolled
    iterations and one step after the loop), greedy and sampled, and so does a loop of traced step
    count; the fused layer's greedy tokens equal the per-op decode's."""
    model = _hybrid("scan")
    prompt = jnp.asarray(np.random.default_rng(2).integers(0, 256, (2, 5)), jnp.int32)
    key = jax.random.key(3)
    out = {}
    for u in (1, 3):
        for temp in (0.0, 0.8):
            out[u, temp] = generate(model, prompt, 8, key=key, temperature=temp, unroll=u)
            _, cache = model.prefill(prompt, 16)
            toks, _ = decode_loop(model, cache, out[u, temp][:, 0], 7, key=jax.random.key(4), temperature=temp,
                                  unroll=u)
            out[u, temp, "loop"] = toks
    for k in [(0.0,), (0.8,), (0.0, "loop"), (0.8, "loop")]:
        np.testing.assert_array_equal(out[(1,) + k], out[(3,) + k])
    np.testing.assert_array_equal(out[1, 0.0, "loop"], out[1, 0.0][:, 1:])  # greedy: the same continuation
    # a traced step count (time_decode_loop(traced_count=True)'s loop): 7 of 9 slots, unroll 3 (two
    # iterations of 3, then a loop of single steps), the same greedy tokens, the last 2 columns untouched
    graphdef, state = nnx.split(model)
    _, cache = model.prefill(prompt, 16)
    toks, _ = _decode_loop(graphdef, state, cache, out[1, 0.0][:, 0], jax.random.split(key, 9), jnp.float32(0.0),
                           jnp.int32(7), top_k=None, greedy=True, unroll=3)
    np.testing.assert_array_equal(toks[:, :7], out[1, 0.0][:, 1:])
    assert not np.any(np.asarray(toks[:, 7:]))
    fused = generate(_hybrid("fused_layer"), prompt, 8, unroll=2)
    np.testing.assert_array_equal(fused, out[1, 0.0])
    with pytest.raises(ValueError, match="unroll must be an int >= 1"):
        generate(model, prompt, 2, unroll=0)


def test_auto_picks_the_fused_layer_on_a_gpu_and_declines_by_name(monkeypatch):
    from gdn_jax.layers import gated_deltanet as gdn_mod
    from gdn_jax.ops.pallas import platform as plat

    layer = GatedDeltaNet(32, 2, rngs=nnx.Rngs(0))
    kda = KimiDeltaAttention(32, 2, rngs=nnx.Rngs(0))
    noconv = GatedDeltaNet(32, 2, use_short_conv=False, rngs=nnx.Rngs(0))
    assert not layer.uses_fused_decode() and layer.decode_view() is None  # CPU: the per-op path
    monkeypatch.setattr(plat, "default_platform", lambda: "gpu")
    monkeypatch.setattr(jax, "device_count", lambda *a: 4)  # several devices: the per-op path (partitioned)
    assert not layer.uses_fused_decode()
    monkeypatch.setattr(jax, "device_count", lambda *a: 1)  # a one-GPU process: the fused layer
    assert layer.uses_fused_decode() and layer.decode_view()["w_in"].shape == (32, 4 * 32 + 2 * 2)
    monkeypatch.setattr(gdn_mod, "AUTO_FUSED_LAYER", False)  # the switch back to the per-op decode
    assert not layer.uses_fused_decode() and layer.decode_view() is None
    monkeypatch.setattr(gdn_mod, "AUTO_FUSED_LAYER", True)
    assert not kda.uses_fused_decode() and "Kimi Delta Attention" in kda.fused_decode_reason()
    assert not noconv.uses_fused_decode() and "use_short_conv=False" in noconv.fused_decode_reason()
    with pytest.raises(ValueError, match="Kimi Delta Attention"):
        KimiDeltaAttention(32, 2, decode_backend="fused_layer", rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="Kimi Delta Attention"):
        LMConfig(d_model=32, num_heads=2, mixer="kda", decode_backend="fused_layer")
    with pytest.raises(ValueError, match="short conv"):
        LMConfig(d_model=32, num_heads=2, use_short_conv=False, decode_backend="fused_layer")
    with pytest.raises(ValueError, match="does not take head dim K=24"):
        GatedDeltaNet(48, 2, decode_backend="fused_layer", rngs=nnx.Rngs(0))


def test_fused_layer_decode_drift_256_steps():
    """Teacher-forced decode of 256 tokens through the fused layer kernel against one chunked
    forward: bounded at every step, not growing, the final state equal to the prefill's."""
    model = _hybrid("fused_layer")
    tokens = jax.random.randint(jax.random.key(3), (1, 257), 0, 256)
    r, cache = decode_drift(model, tokens, n_prompt=1)
    print("fused-layer decode drift: max", r.max(), "first/last 64", r[:64].mean(), r[-64:].mean())
    assert r.shape == (256,) and np.all(np.isfinite(r)) and r.max() < 1e-4
    assert r[-64:].mean() < 10 * r[:64].mean()
    _, ref = model.prefill(tokens, 257)
    assert rel(cache[0].state, ref[0].state) < 1e-4
