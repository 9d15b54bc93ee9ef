"""Exact cache-size formulas (the docs/inference.md memory table: d 2048, 16 x 128 heads, 48 layers,
bf16) and their agreement with real caches."""
import pytest
from flax import nnx

from gdn_jax.inference import cache_nbytes
from gdn_jax.inference.memory import (conv_cache_bytes, fmt_bytes, gdn_state_bytes, kv_cache_bytes,
                                      model_cache_bytes, seed_table, seed_table_markdown)
from gdn_jax.models import LM, LMConfig


def test_seed_numbers_exact():
    assert kv_cache_bytes(48, 4096, 16, 128, bytes_per_elem=2) == 1_610_612_736
    assert kv_cache_bytes(48, 32768, 16, 128) == 12 * 2 ** 30
    assert kv_cache_bytes(48, 131072, 16, 128) == 48 * 2 ** 30
    assert gdn_state_bytes(48, 16, 128, bytes_per_elem=2) == 25_165_824
    assert gdn_state_bytes(48, 16, 128) == 50_331_648  # float32 by default, as gdn_jax keeps it
    assert conv_cache_bytes(48, 16, 128, conv_size=4, bytes_per_elem=2) == 1_769_472
    rows = seed_table()
    assert [r["context"] for r in rows] == [4096, 32768, 131072]
    assert rows[2]["ratio_seed"] == 2048 and rows[2]["ratio_gdn_jax"] == pytest.approx(51539607552 / 52101120)
    # 3:1 hybrid: 12 attention layers + 36 GDN layers
    assert rows[0]["hybrid_kv"] == 1_610_612_736 // 4
    assert rows[0]["hybrid_gdn"] == 36 * (16 * 128 * 128 * 4 + 3 * 3 * 2048 * 2)


def test_seed_table_bf16_state():
    """The seed table with gdn_jax's state in bfloat16 (LMConfig.state_dtype): half the state bytes."""
    r32, r16 = seed_table()[0], seed_table(state_dtype="bfloat16")[0]
    assert r16["gdn_state"] == r16["gdn_state_bf16"] == 25_165_824 and r32["gdn_state"] == 50_331_648
    assert r16["gdn_jax_total"] == 25_165_824 + 1_769_472
    assert r16["hybrid_gdn"] == 36 * (16 * 128 * 128 * 2 + 3 * 3 * 2048 * 2)
    md = seed_table_markdown(state_dtype="bfloat16")
    assert "gdn_jax total (bfloat16 state + bf16 conv) | 26,935,296 B" in md and "(bf16 state + bf16 conv)" in md
    with pytest.raises(ValueError, match="state_dtype"):
        seed_table(state_dtype="float16")


def test_units_are_stated():
    assert fmt_bytes(1_610_612_736) == "1,610,612,736 B (1.500 GiB = 1.611 GB)"
    assert fmt_bytes(25_165_824) == "25,165,824 B (24.000 MiB = 25.166 MB)"
    md = seed_table_markdown()
    for s in ("1,610,612,736 B", "25,165,824 B", "50,331,648 B", "1,769,472 B", "GiB", "GB", "2,048.0x"):
        assert s in md


@pytest.mark.parametrize("kw", [dict(mixer="gdn"), dict(mixer="attention", dtype="bfloat16"),
                                dict(num_layers=4, hybrid_every=4, hybrid_mixer="gated_attention", dtype="bfloat16"),
                                dict(use_short_conv=False),
                                dict(num_layers=4, hybrid_every=4, hybrid_mixer="gated_attention", state_dtype="bfloat16"),
                                dict(num_layers=4, hybrid_every=4, hybrid_mixer="gated_attention", num_v_heads=4,
                                     value_head_dim=8, attn_num_heads=4, attn_num_kv_heads=2, attn_head_dim=8,
                                     conv_size=3),
                                dict(mixer="deltanet", num_v_heads=4), dict(mixer="kda", state_dtype="bfloat16"),
                                dict(mixer="mamba2", dtype="bfloat16"), dict(mixer="gla", gla_expand_k=0.5),
                                dict(mixer="linear", use_short_conv=False)])
def test_formula_matches_real_cache(kw):
    cfg = LMConfig(d_model=32, num_heads=2, **kw)
    cache = LM(cfg, rngs=nnx.Rngs(0)).init_cache(2, 37)
    assert cache_nbytes(cache) == model_cache_bytes(cfg, 2, 37)


def test_cache_formula_arguments():
    cfg = LMConfig(d_model=32, num_heads=2)
    for args in ((-1, 8), (1, -5), (1.5, 8)):
        with pytest.raises(ValueError, match="batch|max_len"):
            model_cache_bytes(cfg, *args)


def test_memory_script_checks_arguments_first(tmp_path):
    """experiments/memory.py refuses bad flags before it measures anything (no output folder made)."""
    import importlib.util
    import os

    path = os.path.join(os.path.dirname(__file__), "..", "..", "experiments", "memory.py")
    spec = importlib.util.spec_from_file_location("memory_script", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = tmp_path / "out"
    for argv in (["--contexts", "128x"], ["--contexts", "8", "--reps", "20"], ["--reps", "0"], ["--dtype", "float33"]):
        with pytest.raises(SystemExit):
            mod.main([*argv, "--out", str(out)])
    assert not out.exists()


def test_seed_table_arguments_and_label():
    for h in (0, -1, 49):
        with pytest.raises(ValueError, match="hybrid_every"):
            seed_table(hybrid_every=h)
    with pytest.raises(ValueError, match="empty"):
        seed_table_markdown([])
    assert "1:1 hybrid: KV of 24 attention layers + 24 GDN layers" in seed_table_markdown(seed_table(hybrid_every=2))
