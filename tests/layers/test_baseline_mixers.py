"""Baseline mixers (deltanet, mamba2, gla, linear): build, finite forward, loss falls on a fixed MQAR batch."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from gdn_jax.data.mqar import generate_mqar
from gdn_jax.layers.gated_deltanet import GatedDeltaNet
from gdn_jax.layers.linear_attention import GatedLinearAttention
from gdn_jax.models import LM, LMConfig, MIXERS
from gdn_jax.training import masked_cross_entropy

NEW = ("deltanet", "mamba2", "gla", "linear")


@pytest.mark.parametrize("mixer", NEW)
def test_mixer_lm_trains(mixer):
    assert mixer in MIXERS
    cfg = LMConfig(vocab_size=32, d_model=32, num_layers=1, num_heads=2, mixer=mixer, chunk_size=16)
    model = LM(cfg, rngs=nnx.Rngs(0))
    kind = GatedDeltaNet if mixer == "deltanet" else GatedLinearAttention
    assert isinstance(model.blocks[0].mixer, kind)
    batch = generate_mqar(8, vocab_size=32, seq_len=24, num_kv_pairs=3, seed=0)
    x, y = jnp.asarray(batch.inputs), jnp.asarray(batch.targets)
    graphdef, params = nnx.split(model, nnx.Param)
    tx = optax.adamw(1e-2, weight_decay=0.0)
    opt = tx.init(params)

    def loss_fn(p):
        return masked_cross_entropy(nnx.merge(graphdef, p)(x), y)

    @jax.jit
    def step(p, o):
        loss, grads = jax.value_and_grad(loss_fn)(p)
        upd, o = tx.update(grads, o, p)
        return optax.apply_updates(p, upd), o, loss

    logits = nnx.merge(graphdef, params)(x)
    assert logits.shape == (8, 24, 32) and bool(jnp.all(jnp.isfinite(logits)))
    losses = []
    for _ in range(8):
        params, opt, loss = step(params, opt)
        losses.append(float(loss))
    assert np.all(np.isfinite(losses)) and losses[-1] < losses[0] - 0.1, losses


def test_deltanet_has_no_decay_params_and_matches_g_zero():
    m = GatedDeltaNet(16, 2, decay="none", rngs=nnx.Rngs(0))
    assert not hasattr(m, "a_proj") and not hasattr(m, "A_log") and not hasattr(m, "dt_bias")
    x = jax.random.normal(jax.random.PRNGKey(1), (1, 10, 16))
    g, beta = m.gates(x)
    assert g.shape == (1, 10, 2) and not np.any(np.asarray(g))
    assert np.all(np.isfinite(np.asarray(m(x))))


@pytest.mark.parametrize("decay", ["mamba2", "gla", "none"])
def test_linear_attention_layer_cu_seqlens(decay):
    m = GatedLinearAttention(16, 2, decay=decay, chunk_size=16, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.PRNGKey(2), (1, 20, 16))
    cu = np.array([0, 7, 20], np.int32)
    y = m(x, cu_seqlens=cu)
    y0, y1 = m(x[:, :7]), m(x[:, 7:])
    np.testing.assert_allclose(np.asarray(y), np.concatenate([y0, y1], 1), rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="decay"):
        GatedLinearAttention(16, 2, decay="bogus", rngs=nnx.Rngs(0))
