"""Kimi Linear's KDA layer: gdn_jax.layers.KimiDeltaAttention against transformers' KimiLinearDeltaAttention."""
from __future__ import annotations

import numpy as np
import pytest

from _hf_common import perturb_, rms_rel, torch, transformers

import jax
import jax.numpy as jnp

from gdn_jax import hf
from gdn_jax.hf import CheckpointError

modeling = pytest.importorskip("transformers.models.kimi_linear.modeling_kimi_linear")


def _config():
    return transformers.KimiLinearConfig(hidden_size=32, linear_num_heads=2, linear_head_dim=8, num_hidden_layers=1,
                                         num_attention_heads=2, rms_norm_eps=1e-5, linear_conv_kernel_dim=4)


@pytest.fixture(scope="module")
def kda():
    cfg = _config()
    torch.manual_seed(0)
    layer = modeling.KimiLinearDeltaAttention(cfg, 0).eval()
    with torch.no_grad():  # forget_gate.A_log / dt_bias are torch.empty until a model's init runs
        layer.forget_gate.A_log.copy_(torch.empty(1, 1, 2, 1).uniform_(0.5, 3.0).log())
        layer.forget_gate.dt_bias.copy_(torch.randn(16))
    perturb_(layer, 1)
    sd = {k: v.detach().numpy() for k, v in layer.state_dict().items()}
    return layer, sd, cfg.to_dict()


def _x(T=37, B=2):
    return np.random.default_rng(2).standard_normal((B, T, 32)).astype(np.float32)


def test_kda_layer_matches_transformers(kda):
    layer, sd, cfg = kda
    x = _x()
    with torch.no_grad():
        ref = layer(torch.as_tensor(x)).numpy()
    for backend in ("chunk", "scan"):
        ours = hf.kda_from_hf(sd, cfg, chunk_size=16, backend=backend)
        err = rms_rel(ours(jnp.asarray(x)), ref)
        assert err <= 1e-5, f"{backend}: {err:.2e}"


def test_kda_prefill_decode_matches_transformers(kda):
    """Prefill of T - 1 tokens and one decode step equal transformers' full forward at the last token."""
    layer, sd, cfg = kda
    x = _x(T=21)
    with torch.no_grad():
        ref = layer(torch.as_tensor(x)).numpy()
    ours = hf.kda_from_hf(sd, cfg, chunk_size=16)
    y, cache = ours.prefill(jnp.asarray(x[:, :-1]))
    y_t, _ = ours.decode(jnp.asarray(x[:, -1:]), cache)
    assert rms_rel(y, ref[:, :-1]) <= 1e-5
    assert rms_rel(y_t[:, 0], ref[:, -1]) <= 1e-5


def test_kda_roundtrip_and_original_names(kda):
    layer, sd, cfg = kda
    ours = hf.kda_from_hf(sd, cfg)
    back = hf.kda_to_hf(ours)
    assert sorted(back) == sorted(sd)
    for k in sd:
        assert np.array_equal(np.asarray(back[k]), sd[k]), k
    # the original checkpoints' names (forget-gate tensors on the layer, three convs), under a prefix
    C = 16
    orig = {"model.layers.0.self_attn." + k.replace("forget_gate.", ""): v for k, v in sd.items() if k != "conv1d.weight"}
    for i, c in enumerate("qkv"):
        orig[f"model.layers.0.self_attn.{c}_conv1d.weight"] = sd["conv1d.weight"][i * C:(i + 1) * C]
    orig["model.layers.0.mlp.w1.weight"] = np.zeros((3, 3), np.float32)  # other keys are ignored
    x = jnp.asarray(_x(T=9))
    b = hf.kda_from_hf(orig, cfg, prefix="model.layers.0.self_attn.")
    np.testing.assert_array_equal(np.asarray(b(x)), np.asarray(ours(x)))


def test_kda_negative_control_silu_gate(kda):
    """GDN's SiLU output gate in place of Kimi's sigmoid must fail the comparison."""
    layer, sd, cfg = kda
    x = _x()
    with torch.no_grad():
        ref = layer(torch.as_tensor(x)).numpy()
    ours = hf.kda_from_hf(sd, cfg, chunk_size=16)
    B, T = x.shape[:2]
    o, _ = ours._sequence(jnp.asarray(x), with_cache=True)
    gate = ours.g_b_proj(ours.g_a_proj(jnp.asarray(x))).reshape(B, T, 2, 8)
    # rebuild the output with silu instead of sigmoid
    from gdn_jax.ops import gated_delta_rule
    q, k, v, _ = ours._qkv(jnp.asarray(x))
    g, beta = ours.gates(jnp.asarray(x))
    core, _ = gated_delta_rule(q, k, v, g, beta, use_qk_l2norm=True, chunk_size=16)
    wrong = ours.o_proj((ours.o_norm(core) * jax.nn.silu(gate)).reshape(B, T, -1))
    assert rms_rel(o, ref) <= 1e-5 and rms_rel(wrong, ref) > 1e-2


def test_kda_bad_tensors(kda):
    _, sd, cfg = kda
    bad = dict(sd)
    del bad["g_b_proj.weight"]
    with pytest.raises(CheckpointError, match=r"missing tensor 'g_b_proj.weight' \(expected shape \(16, 8\)\)"):
        hf.kda_from_hf(bad, cfg)
    bad = dict(sd, **{"b_proj.weight": np.zeros((3, 32), np.float32)})
    with pytest.raises(CheckpointError, match=r"'b_proj.weight' has shape \(3, 32\), expected \(2, 32\)"):
        hf.kda_from_hf(bad, cfg)
    with pytest.raises(CheckpointError, match="unexpected tensor 'extra'"):
        hf.kda_from_hf(dict(sd, extra=np.zeros(2, np.float32)), cfg)


def test_kda_mixer_in_lm_decodes():
    """The registry's "kda" mixer: prefill + one step equals the full forward."""
    from flax import nnx
    from gdn_jax.models import LM, LMConfig

    model = LM(LMConfig(vocab_size=50, d_model=32, num_layers=1, num_heads=2, mixer="kda", chunk_size=8),
               rngs=nnx.Rngs(0))
    tok = jnp.asarray(np.random.default_rng(0).integers(0, 50, (2, 12)), jnp.int32)
    full = model(tok)
    _, cache = model.prefill(tok[:, :-1], max_len=12)
    step, _ = model.decode_step(tok[:, -1], cache)
    assert rms_rel(step, full[:, -1]) <= 1e-5


def test_kda_to_hf_refuses_layer_without_conv():
    """Kimi Linear's layer always has the short convolutions: a layer without them has no checkpoint
    form (it used to fail with an AttributeError)."""
    from flax import nnx

    from gdn_jax.hf import CheckpointError, kda_to_hf
    from gdn_jax.layers import KimiDeltaAttention

    with pytest.raises(CheckpointError, match="use_short_conv=False has no Kimi Linear counterpart"):
        kda_to_hf(KimiDeltaAttention(32, 2, use_short_conv=False, rngs=nnx.Rngs(0)))
