"""Warnings where a user would want one (gdn_jax.ops._warnings): a direct op call with 1 < T < H
([B, T, H, D] with more heads than tokens: a head-first array?) warns once, naming the caller's line;
the layers' full-sequence call, prefill and decode never warn; backend="pallas" on the CPU warns
once that the Pallas interpreter runs (not with an explicit KernelConfig platform)."""
import warnings

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from gdn_jax.ops import (HeadFirstLayoutWarning, KernelConfig, PallasInterpreterWarning, gated_delta_rule,
                         gated_linear_attention)
from gdn_jax.ops import _warnings


def _inputs(T, H, K=16, seed=0):
    ks = jax.random.split(jax.random.key(seed), 5)
    q, k, v = (jax.random.normal(ks[i], (1, T, H, K)) for i in range(3))
    g = -jax.nn.softplus(jax.random.normal(ks[3], (1, T, H)))
    beta = jax.nn.sigmoid(jax.random.normal(ks[4], (1, T, H)))
    return q, k, v, g, beta


def _recorded(fn):
    """The warnings ``fn()`` issues with every filter open (``always``), after a reset of the once-only record."""
    _warnings.reset()
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        fn()
    return got


@pytest.mark.parametrize("op", ["gdr", "gla"])
def test_direct_call_with_fewer_tokens_than_heads_warns_once(op):
    def call(T, H):
        q, k, v, g, beta = _inputs(T, H)
        if op == "gdr":
            return gated_delta_rule(q, k, v, g, beta, backend="chunk", chunk_size=16)
        return gated_linear_attention(q, k, v, g, backend="chunk", chunk_size=16)

    got = _recorded(lambda: [call(3, 8), call(3, 8), call(2, 4)])
    cats = [w.category for w in got]
    assert cats.count(HeadFirstLayoutWarning) == 1, [str(w.message) for w in got]
    (w,) = [w for w in got if w.category is HeadFirstLayoutWarning]
    assert w.filename == __file__  # stacklevel: the line that called the op
    assert "(1, 3, 8, 16)" in str(w.message) and "head-first" in str(w.message)
    for T, H in ((1, 8), (4, 4), (16, 2)):  # one token (decode-like), T == H, T > H: no warning
        assert not [w for w in _recorded(lambda: call(T, H)) if w.category is HeadFirstLayoutWarning], (T, H)


def test_layers_prefill_and_decode_never_warn():
    from gdn_jax.layers import GatedDeltaNet, GatedLinearAttention

    x = jax.random.normal(jax.random.key(1), (1, 3, 64))  # 3 tokens, 8 heads of 8
    layers = [GatedDeltaNet(64, 8, backend="chunk", chunk_size=16, rngs=nnx.Rngs(0)),
              GatedLinearAttention(64, 8, decay="gla", backend="chunk", chunk_size=16, rngs=nnx.Rngs(0))]

    def use_all():
        for layer in layers:
            y = layer(x)
            y2, cache = layer.prefill(x[:, :2])
            y3, _ = layer.decode(x[:, 2:], cache)
            assert y.shape == x.shape and y2.shape == (1, 2, 64) and y3.shape == (1, 1, 64)

    got = _recorded(use_all)
    assert not [w for w in got if w.category is HeadFirstLayoutWarning], [str(w.message) for w in got]
    # the same shapes in a direct call do warn: the test above is not vacuous
    q, k, v, g, beta = _inputs(3, 8, K=8)
    assert [w.category for w in _recorded(lambda: gated_delta_rule(q, k, v, g, beta, backend="chunk"))] == \
        [HeadFirstLayoutWarning]


def test_pallas_on_cpu_warns_once_about_the_interpreter():
    if jax.default_backend() != "cpu":
        pytest.skip("the interpreter notice is for the CPU")
    q, k, v, g, beta = _inputs(16, 2)
    got = _recorded(lambda: [gated_delta_rule(q, k, v, g, beta, backend="pallas", chunk_size=16) for _ in range(2)])
    pw = [w for w in got if w.category is PallasInterpreterWarning]
    assert len(pw) == 1 and pw[0].filename == __file__ and "interpreter" in str(pw[0].message)
    # chosen explicitly (how the tests run the kernels), or another backend: no notice
    explicit = KernelConfig(platform="interpret")
    got = _recorded(lambda: [gated_delta_rule(q, k, v, g, beta, backend="pallas", chunk_size=16,
                                              kernel_config=explicit),
                             gated_delta_rule(q, k, v, g, beta, backend="chunk", chunk_size=16)])
    assert not [w for w in got if w.category is PallasInterpreterWarning]
    assert jnp.isfinite(gated_delta_rule(q, k, v, g, beta, backend="chunk", chunk_size=16)[0]).all()
