"""The fused decode layer kernel (:mod:`gdn_jax.ops.pallas.decode_layer`: conv update, SiLU, q/k L2
norms, decay and beta, state update and read, gated RMSNorm in one kernel) against an independent
float64 numpy layer step: the GPU program in interpret mode (its state updated in column chunks)
and the TPU variant under
``pltpu.InterpretParams()``, every decay form, per-channel gates, grouped value heads, a bfloat16
state; the Triton and Mosaic TPU lowerings (on this CPU); what it declines; its reverse-mode
derivative (a custom VJP through ``decode_layer.reference``) against central differences of the
float64 step.

Tolerances (rel_rms against float64 on the same rounded inputs): 1e-5 for float32 inputs and
state (measured ~1e-7); bf16 inputs: y within 5e-3 (it is rounded to bf16 once), the state 1e-5
(computed in float32); a bfloat16 state: 4e-3 (one rounding, ~2^-9). Conv states: exact (a shift).
Gradients: each argument's directional derivative of a random linear function of all outputs within
1e-4 (relative to the largest of them) of the float64 central difference (step 1e-6).
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gdn_jax.ops.pallas import decode_layer as DL

F32, BF16 = jnp.float32, jnp.bfloat16


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.sqrt(np.mean((a - b) ** 2) / np.mean(b ** 2)))


def ref_layer(spec, proj, convs, conv_w, A_log, dt_bias, norm_w, S):
    """float64 numpy: the GatedDeltaNet decode step written out from its definition."""
    # float64 numpy inputs are taken as they are (the gradient test's finite differences); others
    # are read as float32 values
    f = lambda x: x if isinstance(x, np.ndarray) and x.dtype == np.float64 else np.asarray(jnp.asarray(x, F32),
                                                                                          np.float64)
    proj, S, norm_w = f(proj), f(S), f(norm_w)
    B = proj.shape[0]
    Hk, H, K, V, W, G = spec.Hk, spec.H, spec.K, spec.V, spec.W, spec.group
    seg = {n: proj[:, o:o + m] for n, (o, m) in DL.segments(spec).items()}
    silu = lambda x: x / (1 + np.exp(-x))
    qkv = []
    for x, c, w in zip((seg["q"], seg["k"], seg["v"]), convs, conv_w):
        xx = np.concatenate([f(c), x[:, None]], 1)  # [B, W, D]: oldest first
        qkv.append(silu(np.einsum("bwd,wd->bd", xx, f(w))))
    q, k, v = qkv[0].reshape(B, Hk, K), qkv[1].reshape(B, Hk, K), qkv[2].reshape(B, H, V)
    q = q / np.sqrt((q * q).sum(-1, keepdims=True) + 1e-6) * spec.scale
    k = k / np.sqrt((k * k).sum(-1, keepdims=True) + 1e-6)
    q, k = np.repeat(q, G, 1), np.repeat(k, G, 1)
    softplus = lambda x: np.logaddexp(x, 0)
    a = seg["a"].reshape(B, H, spec.ga) if spec.decay != "none" else np.zeros((B, H, 1))
    if spec.decay == "mamba2":
        g = -np.minimum(np.exp(f(A_log))[None, :, None] * softplus(a + f(dt_bias).reshape(H, spec.ga)), 1e4)
    elif spec.decay == "sigmoid":
        g = -softplus(-a)
    else:
        g = a
    beta = 1 / (1 + np.exp(-seg["b"].reshape(B, H, spec.gb))) * (2 if spec.neg_eigval else 1)
    S = S * np.exp(g)[..., None]
    pred = np.einsum("bhkv,bhk->bhv", S, k)
    S = S + k[..., None] * (beta * (v - pred))[..., None, :]
    o = np.einsum("bhkv,bhk->bhv", S, q)
    o = o / np.sqrt((o * o).mean(-1, keepdims=True) + spec.norm_eps) * norm_w
    y = o * silu(seg["z"].reshape(B, H, V))
    new_convs = [np.concatenate([f(c)[:, 1:], x[:, None]], 1) for c, x in zip(convs, (seg["q"], seg["k"], seg["v"]))]
    return y.reshape(B, H * V), S, new_convs


def inputs(spec, B, dtype, seed):
    r = np.random.default_rng(seed)
    Hk, H, K, V, W = spec.Hk, spec.H, spec.K, spec.V, spec.W
    proj = jnp.asarray(r.normal(size=(B, DL.proj_width(spec))), dtype)
    convs = tuple(jnp.asarray(r.normal(size=(B, W - 1, n)), dtype) for n in (Hk * K, Hk * K, H * V))
    conv_w = tuple(jnp.asarray(r.normal(size=(W, n)) * 0.5, F32) for n in (Hk * K, Hk * K, H * V))
    A_log = jnp.asarray(r.uniform(-1, 1.5, size=(H,)), F32) if spec.decay == "mamba2" else None
    dt_bias = jnp.asarray(r.normal(size=(H * spec.ga,)), F32) if spec.decay == "mamba2" else None
    norm_w = jnp.asarray(r.uniform(0.5, 1.5, size=(V,)), F32)
    S = jnp.asarray(r.normal(size=(B, H, K, V)) * 0.3, F32)
    return proj, convs, conv_w, A_log, dt_bias, norm_w, S


SPECS = {
    "mamba2": DL.LayerSpec(Hk=2, H=2, K=32, V=64, W=4, scale=32 ** -0.5),
    "gva_per_channel_negeig": DL.LayerSpec(Hk=2, H=4, K=32, V=32, W=4, g_per_channel=True, beta_per_channel=True,
                                           neg_eigval=True, scale=0.2),
    "sigmoid_w3": DL.LayerSpec(Hk=2, H=2, K=16, V=32, W=3, decay="sigmoid", scale=0.25),
    "none": DL.LayerSpec(Hk=1, H=2, K=32, V=16, W=4, decay="none", scale=0.2),
}


@pytest.mark.parametrize("platform", ["interpret", "tpu_interpret"])
@pytest.mark.parametrize("name", list(SPECS))
def test_fused_layer_matches_float64(name, platform):
    spec = SPECS[name]
    x = inputs(spec, 2, F32, hash(name) % 1000)
    kw = dict(bv=16) if platform == "interpret" else {}  # the GPU program: state columns in chunks of 16
    y, S, convs = jax.jit(lambda *a: DL.decode_layer(*a, spec=spec, state_dtype=F32, platform=platform, **kw))(*x)
    ry, rS, rconvs = ref_layer(spec, *x)
    assert y.shape == ry.shape and y.dtype == F32 and S.dtype == F32
    assert rel(y, ry) < 1e-5 and rel(S, rS) < 1e-5, (rel(y, ry), rel(S, rS))
    for c, rc in zip(convs, rconvs):
        np.testing.assert_array_equal(np.asarray(c, np.float64), rc)


@pytest.mark.parametrize("platform", ["interpret", "tpu_interpret"])
def test_fused_layer_bf16_inputs_and_state(platform):
    spec = SPECS["gva_per_channel_negeig"]
    x = inputs(spec, 3, BF16, 5)
    ry, rS, rconvs = ref_layer(spec, *x)
    y, S, convs = DL.decode_layer(*x, spec=spec, state_dtype=F32, platform=platform)
    assert y.dtype == BF16 and convs[0].dtype == BF16
    assert rel(y, ry) < 5e-3 and rel(S, rS) < 1e-5
    y16, S16, _ = DL.decode_layer(*x, spec=spec, state_dtype=BF16, platform=platform)
    assert S16.dtype == BF16 and rel(S16, rS) < 4e-3 and rel(y16, ry) < 5e-3


@pytest.mark.parametrize("name", ["mamba2", "gva_per_channel_negeig", "none"])
def test_fused_layer_lowers_for_gpu_and_tpu(name):
    """The GPU program through the Triton lowering and the TPU variant through Mosaic, lowered on this
    CPU (jax.export), bf16 activations, float32 and bfloat16 states; sizes of the seed model's heads."""
    s = SPECS[name]
    spec = DL.LayerSpec(Hk=s.Hk * 2, H=s.H * 2, K=128, V=128, W=4, decay=s.decay, g_per_channel=s.g_per_channel,
                        beta_per_channel=s.beta_per_channel, neg_eigval=s.neg_eigval, scale=0.1)
    x = inputs(spec, 2, BF16, 1)
    sds = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), x)
    for sdt in (F32, BF16):
        gpu = jax.jit(lambda *a: DL.decode_layer(*a, spec=spec, state_dtype=sdt, platform="gpu"))
        dis = [jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
        assert "__gpu$xla.gpu.triton" in jax.export.export(gpu, platforms=["cuda"], disabled_checks=dis)(*sds).mlir_module()
        tpu = jax.jit(lambda *a: DL.decode_layer(*a, spec=spec, state_dtype=sdt, platform="tpu"))
        assert "tpu_custom_call" in jax.export.export(tpu, platforms=["tpu"])(*sds).mlir_module()


def _aliases(fn, *x):
    """The (input, output) aliases of the one pallas_call in ``fn``'s jaxpr."""
    def walk(jaxpr):
        for e in jaxpr.eqns:
            if e.primitive.name == "pallas_call":
                yield dict(e.params["input_output_aliases"]), len(e.invars)
            for v in e.params.values():  # nested jits (pjit's ClosedJaxpr)
                if hasattr(v, "jaxpr") and hasattr(v.jaxpr, "eqns"):
                    yield from walk(v.jaxpr)
    found = list(walk(jax.make_jaxpr(fn)(*x).jaxpr))
    assert len(found) == 1, found
    return found[0]


@pytest.mark.parametrize("platform", ["interpret", "tpu_interpret"])
def test_state_and_conv_states_update_in_place(platform):
    """The new state and conv states alias their inputs (no copy back into a loop's carry per token):
    every output but y on TPU and, on the GPU program, at one value head per key head; with grouped
    value heads the GPU program aliases conv_v only (conv_q / conv_k of a key head are read by all
    its value heads' programs), and the result is the same."""
    for name, G in (("mamba2", 1), ("gva_per_channel_negeig", 2)):
        spec = SPECS[name]
        x = inputs(spec, 2, F32, 3)
        fn = lambda *a: DL.decode_layer(*a, spec=spec, state_dtype=F32, platform=platform)
        al, n_in = _aliases(fn, *x)
        assert sorted(al.values()) == ([1, 2, 3, 4] if platform == "tpu_interpret" or G == 1 else [1, 4]), al
        assert max(al) == n_in - 1 and al[n_in - 1] == 1  # the state: the last input
        ry, rS, rconvs = ref_layer(spec, *x)
        y, S, convs = jax.jit(fn, donate_argnums=(1, 6))(*x)
        assert rel(y, ry) < 1e-5 and rel(S, rS) < 1e-5
        for c, rc in zip(convs, rconvs):
            np.testing.assert_array_equal(np.asarray(c, np.float64), rc)


def test_covers_and_errors():
    """What the kernel declines (the reason named), and argument errors."""
    ok = SPECS["mamba2"]
    assert DL.covers(ok, BF16, F32) is None
    assert "K=48" in DL.covers(DL.LayerSpec(Hk=2, H=2, K=48, V=64, W=4), F32, F32)
    assert "conv_size 1" in DL.covers(DL.LayerSpec(Hk=2, H=2, K=32, V=64, W=1), F32, F32)
    # v at column 2 * 1 * 16 = 32, not a multiple of V = 64
    assert "segment v" in DL.covers(DL.LayerSpec(Hk=1, H=1, K=16, V=64, W=4), F32, F32)
    x = inputs(ok, 1, F32, 0)
    with pytest.raises(NotImplementedError, match="K=48"):
        DL.decode_layer(*x, spec=DL.LayerSpec(Hk=2, H=2, K=48, V=64, W=4), state_dtype=F32)
    with pytest.raises(ValueError, match="bv must be a power of two dividing V = 64"):
        DL.decode_layer(*x, spec=ok, state_dtype=F32, platform="interpret", bv=24)
    with pytest.raises(ValueError, match=r"state must have shape \(1, 2, 32, 64\)"):
        DL.decode_layer(*x[:-1], x[-1][:, :, :16], spec=ok, state_dtype=F32)


@pytest.mark.parametrize("name,platform", [("gva_per_channel_negeig", "interpret"), ("mamba2", "tpu_interpret"),
                                           ("sigmoid_w3", "interpret")])
def test_fused_layer_gradient_matches_float64_differences(name, platform):
    """jax.grad through decode_layer (the kernel forward, ``reference``'s VJP) against the float64
    step: for every differentiable argument a random direction, <grad, direction> against
    (L(x + h d) - L(x - h d)) / 2h in float64 numpy, L = a random linear function of y, the new state
    and the new conv states. Also ``reference`` itself against the float64 step (forward)."""
    spec = SPECS[name]
    x = inputs(spec, 2, F32, 11)
    r = np.random.default_rng(5)
    ry, rS, rconvs = ref_layer(spec, *x)
    cts = (r.normal(size=ry.shape), r.normal(size=rS.shape), [r.normal(size=c.shape) for c in rconvs])

    def loss64(args):
        y, S, convs = ref_layer(spec, *args)
        return float(np.sum(y * cts[0]) + np.sum(S * cts[1]) + sum(np.sum(c * ct) for c, ct in zip(convs, cts[2])))

    def loss(*args):
        y, S, convs = DL.decode_layer(*args, spec=spec, state_dtype=F32, platform=platform)
        return (jnp.sum(y * cts[0]) + jnp.sum(S * cts[1])
                + sum(jnp.sum(c * jnp.asarray(ct, F32)) for c, ct in zip(convs, cts[2])))

    fy, fS, fconvs = DL.reference(*x, spec=spec, state_dtype=F32)
    assert rel(fy, ry) < 1e-5 and rel(fS, rS) < 1e-5
    grads = jax.jit(jax.grad(loss, argnums=tuple(range(7))))(*x)
    x64 = jax.tree_util.tree_map(lambda a: np.asarray(a, np.float64), x)
    leaves64, tree = jax.tree_util.tree_flatten(x64)
    gleaves = jax.tree_util.tree_leaves(grads)
    assert len(gleaves) == len(leaves64)
    h, got, want = 1e-6, [], []
    for i, (g, a) in enumerate(zip(gleaves, leaves64)):
        d = r.normal(size=a.shape)
        plus = [l + h * d if j == i else l for j, l in enumerate(leaves64)]
        minus = [l - h * d if j == i else l for j, l in enumerate(leaves64)]
        want.append((loss64(jax.tree_util.tree_unflatten(tree, plus))
                     - loss64(jax.tree_util.tree_unflatten(tree, minus))) / (2 * h))
        got.append(float(np.sum(np.asarray(g, np.float64) * d)))
    got, want = np.asarray(got), np.asarray(want)
    assert np.max(np.abs(got - want)) < 1e-4 * np.max(np.abs(want)), np.c_[got, want]
    assert np.all(np.abs(want) > 0)
