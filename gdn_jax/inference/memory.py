"""Exact decode-cache sizes (bytes) for attention and Gated DeltaNet layers, and the KV-vs-GDN
comparison table of docs/inference.md (**Memory**) for a d_model 2048, 16 heads x 128, 48-layer
model in bf16 (:data:`SEED`, :func:`seed_table`).

Units: ``B`` bytes; ``GiB``/``MiB`` binary (2^30, 2^20); ``GB``/``MB`` decimal (10^9, 10^6).
Every function counts exactly what the arrays hold (no allocator overhead, no activations).

Formulas (L layers, context n, H heads, head dims K, V, batch B, short conv kernel W):

* KV cache (per attention layer, keys and values): ``2 · n · H · K · bytes · B``
* GDN state (per GDN layer): ``H · K · V · bytes · B`` (gdn_jax keeps it in float32 by default: 4
  bytes; ``LMConfig(state_dtype="bfloat16")``: 2 bytes)
* GDN short-conv cache (per GDN layer, q, k and v): ``(W - 1) · (2·H·K + H·V) · bytes · B``
  (compute dtype, e.g. bf16)
"""
from __future__ import annotations

import numbers

from typing import Dict, List

import jax.numpy as jnp

# The comparison's setting (docs/inference.md, Memory): emb 2048, 16 heads x 128, 48 layers, bf16, batch 1.
SEED = dict(d_model=2048, num_heads=16, head_dim=128, num_layers=48, bytes_bf16=2, conv_size=4)
SEED_CONTEXTS = (4096, 32768, 131072)


def kv_cache_bytes(num_layers: int, n_ctx: int, num_heads: int, head_dim: int, *, bytes_per_elem: int = 2,
                   batch: int = 1) -> int:
    """Keys + values of ``num_layers`` attention layers over ``n_ctx`` positions."""
    return 2 * num_layers * n_ctx * num_heads * head_dim * bytes_per_elem * batch


def gdn_state_bytes(num_layers: int, num_heads: int, k_dim: int, v_dim: int = None, *, bytes_per_elem: int = 4,
                    batch: int = 1) -> int:
    """Recurrent states ``[B, H, K, V]`` of ``num_layers`` GDN layers (float32 by default)."""
    v_dim = k_dim if v_dim is None else v_dim
    return num_layers * num_heads * k_dim * v_dim * bytes_per_elem * batch


def conv_cache_bytes(num_layers: int, num_heads: int, k_dim: int, v_dim: int = None, *, conv_size: int = 4,
                     bytes_per_elem: int = 2, batch: int = 1) -> int:
    """Short-conv caches (last ``conv_size - 1`` inputs of the q, k and v convolutions)."""
    v_dim = k_dim if v_dim is None else v_dim
    return num_layers * (conv_size - 1) * (2 * num_heads * k_dim + num_heads * v_dim) * bytes_per_elem * batch


def model_cache_bytes(cfg, batch: int, max_len: int, *, conv_size=None) -> int:
    """Bytes of ``LM(cfg).init_cache(batch, max_len)`` from the formulas (no arrays built): GDN and
    DeltaNet layers with grouped value heads (``num_v_heads``, ``value_head_dim``) and their state
    in ``cfg.state_dtype`` (KDA's too), mamba2 / gla / linear with a float32 state (gla's key dim
    from ``gla_expand_k``), attention layers with their own head counts (``attn_num_heads``,
    ``attn_num_kv_heads`` for GQA, ``attn_head_dim``). ``conv_size`` defaults to ``cfg.conv_size``.
    ValueError unless ``batch``, ``max_len`` and ``conv_size`` are ints >= 1."""
    hd = cfg.head_dim or cfg.d_model // cfg.num_heads
    vd = getattr(cfg, "value_head_dim", None) or hd
    hv = getattr(cfg, "num_v_heads", None) or cfg.num_heads
    conv_size = getattr(cfg, "conv_size", 4) if conv_size is None else conv_size
    attn_heads = getattr(cfg, "attn_num_heads", None) or cfg.num_heads
    kv_heads = getattr(cfg, "attn_num_kv_heads", None) or attn_heads
    attn_hd = getattr(cfg, "attn_head_dim", None) or hd
    nbytes = jnp.dtype(cfg.dtype).itemsize
    state_bytes = jnp.dtype(getattr(cfg, "state_dtype", "float32")).itemsize
    total = 0
    for name, value in (("batch", batch), ("max_len", max_len), ("conv_size", conv_size)):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    H = cfg.num_heads
    expand_k = getattr(cfg, "gla_expand_k", None)
    for m in cfg.layer_mixers():
        if m in ("attention", "gated_attention"):
            total += kv_cache_bytes(1, max_len, kv_heads, attn_hd, bytes_per_elem=nbytes, batch=batch)
            continue
        # recurrent mixers: state [B, Hv, K, V] + the q, k, v short-conv states [B, W-1, .]
        if m in ("gdn", "deltanet"):  # grouped value heads, the cache state in cfg.state_dtype
            heads_v, K, V, sb = hv, hd, vd, state_bytes
        elif m == "kda":  # K = V, one value head per key head, state in cfg.state_dtype
            heads_v, K, V, sb = H, hd, hd, state_bytes
        elif m in ("mamba2", "gla", "linear"):  # float32 state; gla's key dim from gla_expand_k
            K = int(cfg.d_model * expand_k / H) if (m == "gla" and expand_k is not None) else hd
            heads_v, V, sb = H, hd, 4
        else:
            raise ValueError(f"no cache-size formula for mixer {m!r}")
        total += gdn_state_bytes(1, heads_v, K, V, bytes_per_elem=sb, batch=batch)
        if cfg.use_short_conv:
            total += (conv_size - 1) * (2 * H * K + heads_v * V) * nbytes * batch
    return total + 4 * sum(m in ("attention", "gated_attention") for m in cfg.layer_mixers())  # int32 pos


def fmt_bytes(n: int) -> str:
    """``'1,610,612,736 B (1.500 GiB = 1.611 GB)'``: exact bytes, binary and decimal units."""
    if n >= 2 ** 30:
        return f"{n:,} B ({n / 2 ** 30:.3f} GiB = {n / 1e9:.3f} GB)"
    return f"{n:,} B ({n / 2 ** 20:.3f} MiB = {n / 1e6:.3f} MB)"


STATE_DTYPES = {"float32": 4, "bfloat16": 2}  # gdn_jax's decode-state dtypes (LMConfig.state_dtype): bytes


def _state_bytes(state_dtype: str) -> int:
    if state_dtype not in STATE_DTYPES:
        raise ValueError(f"state_dtype must be one of {tuple(STATE_DTYPES)}, got {state_dtype!r}")
    return STATE_DTYPES[state_dtype]


def seed_table(hybrid_every: int = 4, state_dtype: str = "float32") -> List[Dict]:
    """Rows of the comparison in the :data:`SEED` setting (emb 2048, 16x128 heads, 48 layers, bf16,
    batch 1), one per context in :data:`SEED_CONTEXTS`, with gdn_jax's GDN state in ``state_dtype``
    (``"float32"``, the default, or ``"bfloat16"``: ``LMConfig.state_dtype``).

    Keys: ``context``; ``state_dtype``; ``kv_full`` (48 attention layers, bf16); ``gdn_state_bf16``
    (the commonly quoted figure: 48 bf16 states, no conv); ``gdn_state_f32`` (48 float32 states);
    ``gdn_state`` (48 states in ``state_dtype``); ``gdn_conv_bf16`` (gdn_jax's short-conv caches);
    ``gdn_jax_total`` (``gdn_state`` + conv); ``hybrid_kv`` / ``hybrid_gdn`` / ``hybrid_total`` (3:1
    hybrid: every ``hybrid_every``-th layer attention, the rest GDN with the state in
    ``state_dtype`` + bf16 conv cache); the ratios ``ratio_seed`` = kv_full / gdn_state_bf16 and
    ``ratio_gdn_jax`` = kv_full / gdn_jax_total, ``ratio_hybrid`` = kv_full / hybrid_total.
    """
    sb = _state_bytes(state_dtype)
    L, H, d, b, W = SEED["num_layers"], SEED["num_heads"], SEED["head_dim"], SEED["bytes_bf16"], SEED["conv_size"]
    if isinstance(hybrid_every, bool) or not isinstance(hybrid_every, numbers.Integral) or not 1 <= hybrid_every <= L:
        raise ValueError(f"hybrid_every must be an int in [1, {L}] (every hybrid_every-th layer attention), got "
                         f"{hybrid_every!r}")
    n_attn = L // hybrid_every
    n_gdn = L - n_attn
    rows = []
    for n in SEED_CONTEXTS:
        kv = kv_cache_bytes(L, n, H, d, bytes_per_elem=b)
        s16 = gdn_state_bytes(L, H, d, bytes_per_elem=2)
        s32 = gdn_state_bytes(L, H, d, bytes_per_elem=4)
        st = gdn_state_bytes(L, H, d, bytes_per_elem=sb)
        conv = conv_cache_bytes(L, H, d, conv_size=W, bytes_per_elem=b)
        hkv = kv_cache_bytes(n_attn, n, H, d, bytes_per_elem=b)
        hg = gdn_state_bytes(n_gdn, H, d, bytes_per_elem=sb) + conv_cache_bytes(n_gdn, H, d, conv_size=W,
                                                                                 bytes_per_elem=b)
        rows.append(dict(context=n, state_dtype=state_dtype, hybrid_every=hybrid_every, n_attn=n_attn, kv_full=kv, gdn_state_bf16=s16, gdn_state_f32=s32,
                         gdn_state=st, gdn_conv_bf16=conv, gdn_jax_total=st + conv, hybrid_kv=hkv, hybrid_gdn=hg,
                         hybrid_total=hkv + hg, ratio_seed=kv / s16, ratio_gdn_jax=kv / (st + conv),
                         ratio_hybrid=kv / (hkv + hg)))
    return rows


def seed_table_markdown(rows=None, state_dtype: str = None) -> str:
    """:func:`seed_table` as Markdown (exact bytes, GiB/MiB and GB/MB stated), as in docs/inference.md,
    for gdn_jax's state in ``state_dtype`` (default: the rows' own, float32 without rows)."""
    if rows is None:
        rows = seed_table(state_dtype=state_dtype or "float32")
    if not rows:
        raise ValueError("rows is empty (seed_table() gives one row per context)")
    sdt = rows[0].get("state_dtype", "float32")
    if state_dtype is not None and state_dtype != sdt:
        raise ValueError(f"state_dtype {state_dtype!r} does not match the rows' ({sdt!r})")
    short = {"float32": "f32", "bfloat16": "bf16"}[sdt]
    r0 = rows[0]
    every = r0.get("hybrid_every", 4)
    n_attn = r0.get("n_attn", 48 // every)
    hyb_label = f"{every - 1}:1 hybrid" if every > 1 else "all-attention \"hybrid\""
    out = [
        "Setting of the source notes (textbook §6.6.6): emb 2048, 16 heads x 128, 48 layers, bf16 activations/KV, batch 1. "
        f"gdn_jax's GDN state in {sdt}. GiB/MiB = 2^30/2^20 B, GB/MB = 10^9/10^6 B.",
        "",
        f"| context | KV cache, 48 attention layers (bf16) | {hyb_label}: KV of {n_attn} attention layers + "
        f"{48 - n_attn} GDN layers ({short} state + bf16 conv) | KV / hybrid |",
        "|---|---|---|---|",
    ]
    for r in rows:
        out.append(f"| {r['context']:,} | {fmt_bytes(r['kv_full'])} | {fmt_bytes(r['hybrid_total'])} "
                   f"(KV {fmt_bytes(r['hybrid_kv'])}) | {r['ratio_hybrid']:.2f}x |")
    out += [
        "",
        "Pure GDN, 48 layers (independent of the context):",
        "",
        "| cache | bytes | KV / it at 4K | at 32K | at 128K |",
        "|---|---|---|---|---|",
    ]
    items = [("the notes' figure: state in bf16, no conv cache", "gdn_state_bf16"),
             (f"gdn_jax state ({sdt})", "gdn_state" if "gdn_state" in r0 else "gdn_state_f32"),
             ("gdn_jax short-conv cache (bf16, 3 x 3 x 2048 per layer)", "gdn_conv_bf16"),
             (f"gdn_jax total ({sdt} state + bf16 conv)", "gdn_jax_total")]
    for name, key in items:
        ratios = " | ".join("—" if key == "gdn_conv_bf16" else f"{r['kv_full'] / r0[key]:,.1f}x" for r in rows)
        out.append(f"| {name} | {fmt_bytes(r0[key])} | {ratios} |")
    return "\n".join(out)
