"""A small pre-norm language model with pluggable token mixers."""
from __future__ import annotations

import dataclasses
from typing import Callable, Dict, Optional, Tuple, Union

import jax
import jax.numpy as jnp
from flax import nnx

from ..layers import Attention, GatedDeltaNet, GatedLinearAttention, KimiDeltaAttention
from ..layers.norm import NORM_STYLES, rms_norm
from ..layers._rows import apply_rows
from ..ops import KernelConfig
from ..ops.linear_attention import LA_BACKENDS


def check_unread_options(cfg, mixers, readers: Dict[str, Tuple[str, ...]]) -> None:
    """ValueError when a field of the dataclass ``cfg`` named in ``readers`` (field -> the built-in
    mixers that read it) is set away from its default and none of ``mixers`` reads it: an option that
    would change nothing is refused rather than recorded as if used. Nothing is checked when a mixer
    is not a built-in one (a registered factory may read any field)."""
    if any(MIXERS.get(m) is not _BUILTIN_MIXERS.get(m) for m in mixers):
        return
    defaults = {f.name: f.default for f in dataclasses.fields(cfg)}
    for name, users in readers.items():
        if getattr(cfg, name) != defaults[name] and not set(users) & set(mixers):
            raise ValueError(f"{type(cfg).__name__}.{name} = {getattr(cfg, name)!r} is an option of the "
                             f"{' / '.join(users)} mixer; the layers ({', '.join(sorted(set(mixers)))}) do not "
                             f"read it (it would change nothing): leave it at {defaults[name]!r}")


@dataclasses.dataclass(frozen=True)
class LMConfig:
    """Configuration of :class:`LM`.

    Attributes:
      vocab_size, d_model, num_layers, num_heads: the usual sizes.
      head_dim: per-head key dim (default ``d_model // num_heads``).
      mixer: mixer name for every layer (see ``MIXERS``), or a tuple of names, one per layer.
      hybrid_every: if > 0, layer i uses ``hybrid_mixer`` iff ``(i + 1) % hybrid_every == 0``
        (Qwen3-Next's 3:1 pattern is ``hybrid_every=4``), ``mixer`` otherwise.
      hybrid_mixer: the mixer of those layers (default ``"attention"``).
      mlp_ratio: SwiGLU MLP hidden size as a multiple of d_model; 0 disables the MLP.
      backend, chunk_size: passed to the recurrent mixers' ops (``gdn_jax.ops.gated_delta_rule``;
        the no-delta-rule mixers run ``"pallas"`` as ``"auto"``, docs/baselines.md).
      kernel_config: a ``gdn_jax.ops.KernelConfig`` for the GDN / DeltaNet mixers' Pallas kernels
        (None: the defaults).
      use_short_conv: the short conv of the recurrent mixers.
      decay, decay_per_channel, beta_per_channel, allow_neg_eigval: GatedDeltaNet options
        (``deltanet`` takes beta_per_channel and allow_neg_eigval; README "Layer and models").
      norm_eps: RMSNorm epsilon. embed_init_std: token-embedding init std (tied LM head).
      dtype / param_dtype: computation / parameter dtypes, a name (``"bfloat16"``) or a floating
        dtype (``jnp.bfloat16``), stored by name.

    Options for imported checkpoints (``gdn_jax.hf``; the defaults keep the original model):
      norm_style: ``"standard"`` RMSNorm ``x/rms * w`` or ``"zero_centered"`` ``x/rms * (1 + w)``
        (Qwen3.5 / Qwen3-Next) for the block norms, the final norm and attention's q/k norms (the
        GDN layer's gated output norm is always standard).
      tie_embeddings: False gives a separate ``lm_head`` (d_model -> vocab, no bias).
      mlp_hidden_size: the SwiGLU hidden size (overrides ``mlp_ratio``; > 0 enables the MLP).
      value_head_dim: GDN value head dim (default head_dim).
      num_v_heads: GDN value heads (grouped value heads; default num_heads), passed as
        ``GatedDeltaNet(num_v_heads=...)``.
      attn_num_heads, attn_num_kv_heads, attn_head_dim: the attention mixers' query heads,
        key/value heads (GQA) and head dim (defaults num_heads, attn_num_heads, head_dim).
      rope_theta: RoPE base of the attention mixers.
      rope_fraction: share of each attention head's channels that RoPE rotates, rounded down to an
        even count (``Attention.rot_dim``; default: 1 for
        ``attention``, 1/4 for ``gated_attention``).
      conv_size: kernel size of the recurrent mixers' short conv.

    Baselines as published (docs/baselines.md; the defaults keep gdn_jax's forms):
      attn_bias: biases on the attention mixers' projections, letters from ``"qkvo"`` (``""``:
        none; ``"qkvo"``: Zoology's MHA, Arora et al. 2023; ``"k"``: key bias only).
      pos_embedding: ``"none"`` (default) or ``"learned"``: learned absolute position embeddings
        added to the token embeddings (Zoology's models; init N(0, embed_init_std)), for
        ``max_seq_len`` positions (required then). Use with ``rope_fraction=0`` for Zoology's
        attention without RoPE. Decoding (prefill / decode_step) is not implemented with them.
      la_qk_l2norm: L2 norm of q, k in the no-delta-rule mixers (mamba2, gla, linear): None (their
        default: mamba2 / linear on, gla off), True, False (Mamba2 as published, Dao & Gu 2024).
      mamba2_dt_input: ``mamba2``: scale the state update's input by the step size dt (Mamba2's
        discretised ``dt B x^T``; ``GatedLinearAttention(dt_input=True)``).
      gla_gate_low_rank, gla_gate_normalizer: ``gla``'s gate rank and normaliser tau
        (``log sigmoid(W_2 W_1 x + b) / tau``; the GLA paper's and FLA's 16 and 16).
      gla_expand_k: ``gla``'s total key dim as a share of d_model (None: d_model, i.e. K = V =
        d_model / num_heads); the GLA paper and FLA use 0.5 (K = d_model / (2 num_heads), V =
        d_model / num_heads).
      With ``use_short_conv=False`` the recurrent mixers take q, k, v straight from the projections
      (no conv, no SiLU): the GLA paper's layer.

    Decoding (``decode_step`` / ``generate``; docs/inference.md):
      decode_backend: how the delta-rule mixers (``gdn``, ``deltanet``, ``kda``) decode a token:
        ``"fused_layer"`` (the whole GDN layer between its input and output projections in one
        kernel; KDA declines it), ``"auto"`` (default: the fused layer on a one-device GPU process
        where it applies, else the step op's auto), ``"scan"`` or ``"pallas"`` (the fused step
        kernel), passed to ``gated_delta_rule_step`` with the other ops around it. The no-delta-rule mixers (``mamba2``, ``gla``,
        ``linear``) have no fused step and ignore it, as they run ``backend="pallas"`` as auto.
      state_dtype: dtype of the delta-rule mixers' cached state, ``"float32"`` (default) or
        ``"bfloat16"`` (half the state bytes per step; accumulation stays float32). The no-delta-rule
        mixers keep a float32 state: ``"bfloat16"`` with one of them is a ``ValueError``.
    """

    vocab_size: int = 256
    d_model: int = 64
    num_layers: int = 2
    num_heads: int = 2
    head_dim: Optional[int] = None
    mixer: Union[str, Tuple[str, ...]] = "gdn"
    hybrid_every: int = 0
    hybrid_mixer: str = "attention"
    mlp_ratio: float = 0.0
    backend: str = "auto"
    chunk_size: int = 64
    kernel_config: Optional[KernelConfig] = None
    use_short_conv: bool = True
    decay: str = "mamba2"
    decay_per_channel: bool = False
    beta_per_channel: bool = False
    allow_neg_eigval: bool = False
    norm_eps: float = 1e-6
    embed_init_std: float = 0.02
    dtype: str = "float32"
    param_dtype: str = "float32"
    norm_style: str = "standard"
    tie_embeddings: bool = True
    mlp_hidden_size: Optional[int] = None
    value_head_dim: Optional[int] = None
    num_v_heads: Optional[int] = None
    attn_num_heads: Optional[int] = None
    attn_num_kv_heads: Optional[int] = None
    attn_head_dim: Optional[int] = None
    rope_theta: float = 10000.0
    rope_fraction: Optional[float] = None
    conv_size: int = 4
    decode_backend: str = "auto"
    state_dtype: str = "float32"
    attn_bias: str = ""
    pos_embedding: str = "none"
    max_seq_len: Optional[int] = None
    la_qk_l2norm: Optional[bool] = None
    mamba2_dt_input: bool = False
    gla_gate_low_rank: int = 16
    gla_gate_normalizer: float = 16.0
    gla_expand_k: Optional[float] = None

    def __post_init__(self):
        from ..layers import _checks
        from ..layers.gated_deltanet import DECAY_KINDS
        from ..ops import backends

        for name in ("vocab_size", "d_model", "num_layers", "num_heads", "chunk_size", "conv_size"):
            _checks.positive_int(name, getattr(self, name))
        for name in ("head_dim", "mlp_hidden_size", "value_head_dim", "num_v_heads", "attn_num_heads",
                     "attn_num_kv_heads", "attn_head_dim"):
            if getattr(self, name) is not None:
                _checks.positive_int(name, getattr(self, name))
        _checks.one_of("norm_style", self.norm_style, NORM_STYLES)
        if not isinstance(self.attn_bias, str) or set(self.attn_bias) - set("qkvo") or \
                len(set(self.attn_bias)) != len(self.attn_bias):
            raise ValueError(f"LMConfig.attn_bias must be a string of distinct letters from 'qkvo' (the attention "
                             f"projections with a bias; '' for none, 'qkvo' for Zoology's MHA), got {self.attn_bias!r}")
        _checks.one_of("pos_embedding", self.pos_embedding, POS_EMBEDDINGS)
        if self.max_seq_len is not None:
            _checks.positive_int("max_seq_len", self.max_seq_len)
        if self.pos_embedding == "learned" and self.max_seq_len is None:
            raise ValueError("LMConfig.max_seq_len must be set with pos_embedding='learned' (the number of learned "
                             "positions)")
        if self.la_qk_l2norm is not None:
            _checks.flag("LMConfig.la_qk_l2norm", self.la_qk_l2norm)
        _checks.flag("LMConfig.mamba2_dt_input", self.mamba2_dt_input)
        _checks.positive_int("gla_gate_low_rank", self.gla_gate_low_rank)
        _checks.positive_float("gla_gate_normalizer", self.gla_gate_normalizer)
        if self.gla_expand_k is not None:
            _checks.positive_float("gla_expand_k", self.gla_expand_k)
            k = self.d_model * self.gla_expand_k / self.num_heads
            if k != int(k) or k < 1:
                raise ValueError(f"gla_expand_k: d_model * gla_expand_k / num_heads = {self.d_model} * "
                                 f"{self.gla_expand_k} / {self.num_heads} = {k:g} must be a positive integer "
                                 f"(the gla key head dim)")
        if not isinstance(self.tie_embeddings, bool):
            raise TypeError(f"tie_embeddings must be a bool, got {self.tie_embeddings!r}")
        _checks.positive_float("rope_theta", self.rope_theta)
        if self.rope_fraction is not None and not (
                isinstance(self.rope_fraction, (int, float)) and not isinstance(self.rope_fraction, bool)
                and 0.0 <= self.rope_fraction <= 1.0):
            raise ValueError(f"rope_fraction must be None or a number in [0, 1], got {self.rope_fraction!r}")
        _checks.positive_int("hybrid_every", self.hybrid_every, minimum=0)
        backends.check_name(self.backend)
        backends.check_kernel_config(self.kernel_config, self.backend)
        _checks.one_of("decay", self.decay, DECAY_KINDS)
        _checks.positive_float("norm_eps", self.norm_eps)
        _checks.positive_float("embed_init_std", self.embed_init_std)
        if isinstance(self.mlp_ratio, bool) or not isinstance(self.mlp_ratio, (int, float)) or self.mlp_ratio < 0:
            raise ValueError(f"mlp_ratio must be a number >= 0, got {self.mlp_ratio!r}")
        for name in ("dtype", "param_dtype"):  # stored by name ("bfloat16"): a jnp dtype given is equal to it
            object.__setattr__(self, name, _checks.float_dtype(name, getattr(self, name)).name)
        if not isinstance(self.mixer, (str, tuple, list)) or not isinstance(self.hybrid_mixer, str):
            raise TypeError(f"mixer must be a name or a tuple of names and hybrid_mixer a name, got "
                            f"{self.mixer!r}, {self.hybrid_mixer!r}")
        mixers = self.layer_mixers()  # mixer tuple length
        unknown = sorted(set(mixers) - set(MIXERS))
        if unknown:
            raise ValueError(f"unknown mixer {unknown[0]!r} (mixer / hybrid_mixer); registered: {sorted(MIXERS)}")
        for name in ("use_short_conv", "decay_per_channel", "beta_per_channel", "allow_neg_eigval"):
            _checks.flag(f"LMConfig.{name}", getattr(self, name))
        if self.head_dim is None and self.d_model % self.num_heads:
            raise ValueError(f"d_model {self.d_model} is not divisible by num_heads {self.num_heads}; pass head_dim")
        K = self.head_dim or self.d_model // self.num_heads
        if self.num_v_heads is not None and self.num_v_heads % self.num_heads:
            raise ValueError(f"LMConfig.num_v_heads must be a multiple of num_heads (the key heads, "
                             f"{self.num_heads}) for grouped value heads, got {self.num_v_heads}")
        if "kda" in mixers and (self.num_v_heads is not None or self.value_head_dim is not None):
            raise ValueError("LMConfig.num_v_heads / value_head_dim are gdn / deltanet options; mixer 'kda' "
                             "(Kimi Delta Attention) has K = V and one value head per key head: leave them None")
        if "kda" in mixers and (self.allow_neg_eigval or self.beta_per_channel):
            raise ValueError("LMConfig.allow_neg_eigval / beta_per_channel are gdn / deltanet options; mixer 'kda' "
                             "(Kimi Delta Attention) has one beta in (0, 1) per head: leave them False")
        self._check_unused_options(mixers)
        if "gdn" in mixers and self.decay == "none" and self.decay_per_channel:
            raise ValueError("LMConfig.decay_per_channel=True needs a decay (decay='mamba2' or 'sigmoid'), got "
                             "decay='none'")
        attn = set(mixers) & {"attention", "gated_attention"}
        heads = self.attn_num_heads or self.num_heads
        if attn and self.attn_head_dim is None and self.head_dim is None and self.d_model % heads:
            raise ValueError(f"d_model {self.d_model} is not divisible by the attention heads "
                             f"({'attn_num_heads' if self.attn_num_heads else 'num_heads'} = {heads}); pass "
                             f"attn_head_dim")
        for m in sorted(set(mixers) & {"gdn", "deltanet", "kda"}):
            backends.check_options(self.backend, chunk_size=self.chunk_size, K=K, V=self.value_head_dim or K,
                                   decay_per_channel=self.decay_per_channel or m == "kda",
                                   beta_per_channel=self.beta_per_channel and m != "kda", dtype=self.dtype,
                                   owner=f"LMConfig (mixer {m!r}): ")
        sdt = _checks.decode_options(self.decode_backend, self.state_dtype, K=K, V=self.value_head_dim or K,
                                     dtype=self.dtype, owner="LMConfig: ",
                                     check_kernel=bool(set(mixers) & {"gdn", "deltanet", "kda"}))
        object.__setattr__(self, "state_dtype", jnp.dtype(sdt).name)  # by name, as dtype / param_dtype
        if self.decode_backend == "fused_layer":  # the fused decode layer kernel declines these (by name)
            if "kda" in mixers:
                raise ValueError("LMConfig.decode_backend='fused_layer' does not take mixer 'kda' (Kimi Delta "
                                 "Attention: its low-rank gates need a second matmul before the kernel); use "
                                 "decode_backend='auto' (the per-op decode for KDA)")
            if not self.use_short_conv and set(mixers) & {"gdn", "deltanet"}:
                raise ValueError("LMConfig.decode_backend='fused_layer' needs the short conv (use_short_conv=True); "
                                 "use decode_backend='auto'")
        fixed = sorted(set(mixers) & {"mamba2", "gla", "linear"})
        if sdt != jnp.dtype(jnp.float32) and fixed:
            raise ValueError(f"state_dtype={self.state_dtype!r} is implemented for the delta-rule mixers (gdn, "
                             f"deltanet, kda); mixer {fixed[0]!r} keeps a float32 state")

    @property
    def mlp_hidden(self) -> int:
        """The SwiGLU hidden size (0: no MLP)."""
        if self.mlp_hidden_size is not None:
            return self.mlp_hidden_size
        return int(self.mlp_ratio * self.d_model) if self.mlp_ratio > 0 else 0

    def _check_unused_options(self, mixers) -> None:
        """ValueError for a GDN-layer option set away from its default when no layer of the model
        would read it (e.g. ``mixer="kda", decay="sigmoid"`` or ``mixer="mamba2", value_head_dim=8``
        used to build the default model silently). Skipped when a mixer is not a built-in one: a
        registered factory may read any field, and for attention-only models (no recurrent layer for
        the options to describe; a Hugging Face config carries its linear-attention fields anyway)."""
        if not set(mixers) - {"attention", "gated_attention"}:
            return
        check_unread_options(self, mixers, {"decay": ("gdn",), "decay_per_channel": ("gdn",),
                                            "beta_per_channel": ("deltanet", "gdn"),
                                            "allow_neg_eigval": ("deltanet", "gdn"),
                                            "value_head_dim": ("deltanet", "gdn"), "num_v_heads": ("deltanet", "gdn")})

    def layer_mixers(self) -> Tuple[str, ...]:
        """The mixer name of each layer."""
        if isinstance(self.mixer, (tuple, list)):
            if len(self.mixer) != self.num_layers:
                raise ValueError(f"mixer has {len(self.mixer)} names for num_layers = {self.num_layers}")
            return tuple(self.mixer)
        if self.hybrid_every < 0:
            raise ValueError(f"hybrid_every must be >= 0, got {self.hybrid_every}")
        return tuple(
            self.hybrid_mixer if self.hybrid_every and (i + 1) % self.hybrid_every == 0 else self.mixer
            for i in range(self.num_layers)
        )


POS_EMBEDDINGS = ("none", "learned")

MixerFactory = Callable[[LMConfig, int, nnx.Rngs], nnx.Module]
MIXERS: Dict[str, MixerFactory] = {}


def register_mixer(name: str, factory: Optional[MixerFactory] = None, *, overwrite: bool = False):
    """Register a token mixer: ``factory(cfg, layer_index, rngs) -> nnx.Module``.

    The module is called as ``mixer(x, cu_seqlens=None)`` with ``x [B, T, d_model]`` and returns
    the same shape; for decoding it also needs ``init_cache(batch, max_len)``,
    ``prefill(x, max_len=...) -> (y, cache)`` and ``decode(x_t, cache) -> (y_t, cache)``
    (docs/inference.md). Usable as a decorator.

    Raises:
      ValueError: ``name`` is already registered (a built-in such as ``"gdn"`` included) and
        ``overwrite`` is False: replacing a mixer changes every model built by that name.
      TypeError: ``name`` not a non-empty string, or ``factory`` not callable.
    """
    if not isinstance(name, str) or not name:
        raise TypeError(f"register_mixer: name must be a non-empty string, got {name!r}")
    if name in MIXERS and not overwrite:
        raise ValueError(f"register_mixer: mixer {name!r} is already registered; pass overwrite=True to replace it")

    def deco(f):
        if not callable(f):
            raise TypeError(f"register_mixer: factory must be callable (cfg, layer_index, rngs) -> module, got {f!r}")
        if name in MIXERS and not overwrite:  # checked again: another registration may have come between
            raise ValueError(f"register_mixer: mixer {name!r} is already registered; pass overwrite=True to replace it")
        MIXERS[name] = f
        return f

    return deco(factory) if factory is not None else deco


def _dt(name):
    return jnp.dtype(name)


def _gdn_layer(cfg: LMConfig, rngs: nnx.Rngs, **override):
    kw = dict(decay=cfg.decay, decay_per_channel=cfg.decay_per_channel, beta_per_channel=cfg.beta_per_channel,
              allow_neg_eigval=cfg.allow_neg_eigval, use_short_conv=cfg.use_short_conv,
              conv_size=cfg.conv_size, backend=cfg.backend,
              chunk_size=cfg.chunk_size, kernel_config=cfg.kernel_config, norm_eps=cfg.norm_eps,
              dtype=_dt(cfg.dtype), param_dtype=_dt(cfg.param_dtype), decode_backend=cfg.decode_backend,
              state_dtype=_dt(cfg.state_dtype))
    if cfg.num_v_heads is not None:  # only when set, so that layers without grouped value heads still build
        kw["num_v_heads"] = cfg.num_v_heads
    return GatedDeltaNet(cfg.d_model, cfg.num_heads, cfg.head_dim, cfg.value_head_dim, **{**kw, **override},
                         rngs=rngs)


@register_mixer("gdn")
def _gdn(cfg: LMConfig, i: int, rngs: nnx.Rngs):
    """Gated DeltaNet with the config's gate options."""
    return _gdn_layer(cfg, rngs)


@register_mixer("deltanet")
def _deltanet(cfg: LMConfig, i: int, rngs: nnx.Rngs):
    """DeltaNet (Yang et al. 2024): the GDN layer with g = 0 (no decay parameters)."""
    return _gdn_layer(cfg, rngs, decay="none", decay_per_channel=False)


def _linear_attention_factory(decay: str, doc: str) -> MixerFactory:
    def factory(cfg: LMConfig, i: int, rngs: nnx.Rngs):
        backend = cfg.backend if cfg.backend in LA_BACKENDS else "auto"  # no Pallas kernels: chunk
        head_dim, value_head_dim = cfg.head_dim, None
        if decay == "gla" and cfg.gla_expand_k is not None:  # GLA paper / FLA: expand_k 0.5, expand_v 1
            head_dim = int(cfg.d_model * cfg.gla_expand_k / cfg.num_heads)
            value_head_dim = cfg.head_dim or cfg.d_model // cfg.num_heads
        return GatedLinearAttention(
            cfg.d_model, cfg.num_heads, head_dim, value_head_dim, decay=decay, use_short_conv=cfg.use_short_conv,
            conv_size=cfg.conv_size, use_qk_l2norm=cfg.la_qk_l2norm, dt_input=cfg.mamba2_dt_input and decay == "mamba2",
            **(dict(gate_low_rank=cfg.gla_gate_low_rank, gate_logit_normalizer=cfg.gla_gate_normalizer)
               if decay == "gla" else {}),
            backend=backend, chunk_size=cfg.chunk_size, norm_eps=cfg.norm_eps, dtype=_dt(cfg.dtype),
            param_dtype=_dt(cfg.param_dtype), rngs=rngs,
        )

    factory.__doc__ = doc
    return factory


register_mixer("mamba2", _linear_attention_factory("mamba2", "Mamba2/SSD-style: per-head decay, no delta rule."))
register_mixer("gla", _linear_attention_factory("gla", "GLA: per-key-channel decay, no delta rule."))
register_mixer("linear", _linear_attention_factory("none", "Linear attention: no decay, no delta rule."))


def _attention_layer(cfg: LMConfig, rngs: nnx.Rngs, rope_fraction: float, **kw):
    heads = cfg.attn_num_heads or cfg.num_heads
    head_dim = cfg.attn_head_dim or cfg.head_dim
    frac = rope_fraction if cfg.rope_fraction is None else cfg.rope_fraction
    return Attention(cfg.d_model, heads, head_dim, num_kv_heads=cfg.attn_num_kv_heads, rope_theta=cfg.rope_theta,
                     rope_fraction=frac, norm_eps=cfg.norm_eps, norm_style=cfg.norm_style, bias=cfg.attn_bias,
                     dtype=_dt(cfg.dtype),
                     param_dtype=_dt(cfg.param_dtype), rngs=rngs, **kw)


@register_mixer("attention")
def _attention(cfg: LMConfig, i: int, rngs: nnx.Rngs):
    return _attention_layer(cfg, rngs, 1.0)


@register_mixer("gated_attention")
def _gated_attention(cfg: LMConfig, i: int, rngs: nnx.Rngs):
    """Qwen3-Next's attention: sigmoid output gate, per-head q/k RMSNorm, partial RoPE (1/4)."""
    return _attention_layer(cfg, rngs, 0.25, qk_norm=True, output_gate=True)


@register_mixer("kda")
def _kda(cfg: LMConfig, i: int, rngs: nnx.Rngs):
    """Kimi Delta Attention (Kimi Linear's KDA layer): per-key-channel decay and sigmoid output gate,
    both from low-rank projections (rank head_dim)."""
    return KimiDeltaAttention(cfg.d_model, cfg.num_heads, cfg.head_dim, use_short_conv=cfg.use_short_conv,
                              conv_size=cfg.conv_size, backend=cfg.backend, chunk_size=cfg.chunk_size,
                              kernel_config=cfg.kernel_config, norm_eps=cfg.norm_eps,
                              dtype=_dt(cfg.dtype), param_dtype=_dt(cfg.param_dtype),
                              decode_backend=cfg.decode_backend, state_dtype=_dt(cfg.state_dtype), rngs=rngs)


_BUILTIN_MIXERS: Dict[str, MixerFactory] = dict(MIXERS)  # the factories above, as registered at import


class SwiGLU(nnx.Module):
    """``W_down(silu(W_gate x) * W_up x)``."""

    def __init__(self, d: int, hidden: int, *, dtype, param_dtype, rngs: nnx.Rngs):
        lin = lambda i, o: nnx.Linear(i, o, use_bias=False, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.gate, self.up, self.down = lin(d, hidden), lin(d, hidden), lin(hidden, d)

    def __call__(self, x):
        return self.down(jax.nn.silu(self.gate(x)) * self.up(x))


# mixers that take ``context_axis`` (T sharded over a mesh axis inside shard_map): the recurrent
# layers through their state maps, attention by an all-gather of K and V (docs/context_parallel.md).
CONTEXT_PARALLEL_MIXERS = frozenset({"gdn", "deltanet", "kda", "mamba2", "gla", "linear", "attention",
                                     "gated_attention"})


class Block(nnx.Module):
    """Pre-norm residual block: ``x + mixer(norm(x))`` then ``x + mlp(norm(x))`` (if any)."""

    def __init__(self, cfg: LMConfig, i: int, mixer: str, *, rngs: nnx.Rngs):
        if mixer not in MIXERS:
            raise ValueError(f"unknown mixer {mixer!r}; registered: {sorted(MIXERS)}")
        dt, pdt = _dt(cfg.dtype), _dt(cfg.param_dtype)
        self.mixer_name = mixer
        norm = lambda: rms_norm(cfg.norm_style, cfg.d_model, epsilon=cfg.norm_eps, dtype=dt, param_dtype=pdt,
                                rngs=rngs)
        self.norm1 = norm()
        self.mixer = MIXERS[mixer](cfg, i, rngs)
        if cfg.mlp_hidden > 0:
            self.norm2 = norm()
            self.mlp = SwiGLU(cfg.d_model, cfg.mlp_hidden, dtype=dt, param_dtype=pdt, rngs=rngs)
        else:
            self.norm2 = self.mlp = None

    def __call__(self, x, *, cu_seqlens=None, context_axis=None):
        if context_axis is None:
            return self._mlp(x + self.mixer(self.norm1(x), cu_seqlens=cu_seqlens))
        if self.mixer_name not in CONTEXT_PARALLEL_MIXERS:
            raise NotImplementedError(
                f"mixer {self.mixer_name!r} does not take context parallelism (context_axis); those that do: "
                f"{sorted(CONTEXT_PARALLEL_MIXERS)} (docs/context_parallel.md says what the others would need)")
        return self._mlp(x + self.mixer(self.norm1(x), cu_seqlens=cu_seqlens, context_axis=context_axis))

    def _need(self, name):
        if not hasattr(self.mixer, name):
            raise NotImplementedError(f"mixer {self.mixer_name!r} ({type(self.mixer).__name__}) has no {name}(); "
                                      "decoding needs init_cache/prefill/decode on every mixer")
        return getattr(self.mixer, name)

    def init_cache(self, batch: int, max_len: int):
        return self._need("init_cache")(batch, max_len)

    def _mlp(self, x):
        if self.mlp is not None:
            x = x + self.mlp(self.norm2(x))
        return x

    def prefill(self, x, *, max_len: int):
        y, cache = self._need("prefill")(self.norm1(x), max_len=max_len)
        return self._mlp(x + y), cache

    def decode(self, x_t, cache, view=None):
        """One token; ``view`` the mixer's decode-time weight view (``mixer.decode_view()``) or None."""
        dec = self._need("decode")
        y, cache = dec(self.norm1(x_t), cache) if view is None else dec(self.norm1(x_t), cache, view=view)
        return self._mlp(x_t + y), cache

    def decode_view(self):
        """The mixer's decode-time weight view (None for mixers without one)."""
        fn = getattr(self.mixer, "decode_view", None)
        return None if fn is None else fn()


def _check_token_array(tokens):
    """``tokens``: a non-empty integer array ``[B, T]`` (TypeError / ValueError otherwise)."""
    if not (hasattr(tokens, "ndim") and hasattr(tokens, "dtype")):
        raise TypeError(f"tokens must be an integer array [B, T] (a NumPy or JAX array), got {type(tokens).__name__}")
    if not jnp.issubdtype(tokens.dtype, jnp.integer):
        raise TypeError(f"tokens must be an integer array [B, T], got dtype {tokens.dtype} (shape "
                        f"{tuple(tokens.shape)})")
    if tokens.ndim != 2:
        raise ValueError(f"tokens must be an integer array [B, T], got shape {tuple(tokens.shape)}")
    if 0 in tokens.shape:
        raise ValueError(f"tokens must have B >= 1 and T >= 1 (an empty batch or empty prompt), got shape "
                         f"{tuple(tokens.shape)}")


def _check_token_range(tokens, vocab_size: int):
    """ValueError for concrete token ids outside [0, vocab_size) (traced ids cannot be checked;
    out-of-range ids would silently embed as NaN)."""
    if isinstance(tokens, jax.core.Tracer):
        return
    t = jax.device_get(tokens)
    if t.size and (t.min() < 0 or t.max() >= vocab_size):
        raise ValueError(f"tokens must be in [0, vocab_size={vocab_size}), got ids from {t.min()} to {t.max()}")


class LM(nnx.Module):
    """Token embedding, N pre-norm blocks, final RMSNorm and an LM head (tied by default).

    ``tokens [B, T] int -> logits [B, T, vocab_size]`` (float32); ``cu_seqlens`` (int ``[N + 1]``,
    B = 1): packed sequences, every mixer restarting at each boundary.

    Args:
      cfg: the :class:`LMConfig` (checked when it is made; mixers by name from :data:`MIXERS`).
      rngs: ``nnx.Rngs`` of the initialisation.

    Decoding: :meth:`init_cache`, :meth:`prefill`, :meth:`decode_step` (docs/inference.md).

    Raises (calls):
      TypeError: tokens not an integer array. ValueError: tokens not ``[B, T]`` with B, T >= 1, or
      concrete ids outside ``[0, vocab_size)``; a malformed ``cu_seqlens``.
    """

    def __init__(self, cfg: LMConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        unknown = sorted({m for m in cfg.layer_mixers() if m not in MIXERS})
        if unknown:
            raise ValueError(f"unknown mixer(s) {unknown} in LMConfig.mixer / hybrid_mixer; registered: {sorted(MIXERS)}")
        dt, pdt = _dt(cfg.dtype), _dt(cfg.param_dtype)
        self.embed = nnx.Embed(cfg.vocab_size, cfg.d_model, dtype=dt, param_dtype=pdt,
                               embedding_init=nnx.initializers.normal(cfg.embed_init_std), rngs=rngs)
        if cfg.pos_embedding == "learned":
            self.pos_embed = nnx.Embed(cfg.max_seq_len, cfg.d_model, dtype=dt, param_dtype=pdt,
                                       embedding_init=nnx.initializers.normal(cfg.embed_init_std), rngs=rngs)
        blocks = [Block(cfg, i, m, rngs=rngs) for i, m in enumerate(cfg.layer_mixers())]
        self.blocks = nnx.List(blocks) if hasattr(nnx, "List") else blocks
        self.norm = rms_norm(cfg.norm_style, cfg.d_model, epsilon=cfg.norm_eps, dtype=dt, param_dtype=pdt,
                             rngs=rngs)
        if not cfg.tie_embeddings:
            self.lm_head = nnx.Linear(cfg.d_model, cfg.vocab_size, use_bias=False, dtype=dt, param_dtype=pdt,
                                      rngs=rngs)

    def __call__(self, tokens, *, cu_seqlens=None, context_axis=None):
        return self.logits(self.features(tokens, cu_seqlens=cu_seqlens, context_axis=context_axis))

    def features(self, tokens, *, cu_seqlens=None, context_axis=None):
        """``tokens [B, T] int -> [B, T, d_model]``: the final-normed hidden states that the tied
        head turns into logits (``self(tokens) == self.logits(self.features(tokens))``).

        ``context_axis``: inside ``jax.shard_map`` with T split over that mesh axis (context
        parallelism, docs/context_parallel.md): tokens are this shard's ``[B, T_s]``, ``cu_seqlens``
        the global boundaries; every mixer must be in ``CONTEXT_PARALLEL_MIXERS``
        (NotImplementedError naming it otherwise), ``pos_embedding`` "none"."""
        _check_token_array(tokens)
        _check_token_range(tokens, self.cfg.vocab_size)
        if context_axis is not None:
            self._no_learned_positions("context_axis (a sequence sharded over devices)")
            x = self.embed_tokens(tokens)
            for blk in self.blocks:
                x = blk(x, cu_seqlens=cu_seqlens, context_axis=context_axis)
            return self.norm(x)
        if cu_seqlens is not None:
            from ..layers._checks import cu_seqlens_arg

            cu_seqlens_arg(cu_seqlens, tokens.shape[0], tokens.shape[1])
        x = self.embed_tokens(tokens, cu_seqlens=cu_seqlens)
        for blk in self.blocks:
            x = blk(x, cu_seqlens=cu_seqlens)
        return self.norm(x)

    def embed_tokens(self, tokens, *, cu_seqlens=None):
        """Token embeddings ``[B, T, d_model]``, plus the learned position embeddings of positions
        ``0 .. T-1`` with ``pos_embedding="learned"`` (ValueError if T > max_seq_len)."""
        x = self.embed(tokens)
        if self.cfg.pos_embedding == "learned":
            T = tokens.shape[1]
            if T > self.cfg.max_seq_len:
                raise ValueError(f"sequence of {T} tokens is longer than LMConfig.max_seq_len = "
                                 f"{self.cfg.max_seq_len} (the learned positions)")
            if cu_seqlens is not None:
                raise NotImplementedError("pos_embedding='learned' with cu_seqlens (packed sequences)")
            x = x + self.pos_embed(jnp.arange(T))[None]
        return x

    def _no_learned_positions(self, what: str):
        if self.cfg.pos_embedding != "none":
            raise NotImplementedError(f"{what} with LMConfig.pos_embedding={self.cfg.pos_embedding!r} is not "
                                      "implemented (training and the full forward are)")

    def logits(self, h):
        """The LM head (tied to the embedding, or ``lm_head`` with ``tie_embeddings=False``):
        ``h [..., d_model] -> logits [..., vocab_size]`` (float32). Applying it to a gathered subset
        of positions saves the head's cost where only those are scored."""
        if not self.cfg.tie_embeddings:
            return self.lm_head(h).astype(jnp.float32)
        return self.embed.attend(h).astype(jnp.float32)

    # ------------------------------------------------------------------ inference (decode) path
    def init_cache(self, batch: int, max_len: int) -> tuple:
        """Per-layer empty caches (a tuple): :class:`~gdn_jax.layers.GDNCache` for the recurrent layers
        (GDN and the baselines; fixed size), :class:`~gdn_jax.layers.KVCache` of ``max_len`` slots for
        attention. TypeError / ValueError unless ``batch`` and ``max_len`` are ints >= 1."""
        from ..layers import _checks

        batch, max_len = _checks.positive_int("batch", batch), _checks.positive_int("max_len", max_len)
        return tuple(blk.init_cache(batch, max_len) for blk in self.blocks)

    def prefill(self, tokens, max_len: int):
        """Run the prompt ``tokens [B, T]`` (GDN layers through the chunked / Pallas op) and return
        ``(logits [B, T, vocab] float32, cache)``; attention caches have ``max_len`` slots
        (``ValueError`` if T > max_len). The logits equal ``self(tokens)``."""
        _check_token_array(tokens)
        if max_len is None or tokens.shape[1] > max_len:
            raise ValueError(f"prompt of {tokens.shape[1]} tokens is longer than max_len = {max_len}")
        _check_token_range(tokens, self.cfg.vocab_size)
        self._no_learned_positions("prefill")
        x = self.embed(tokens)
        caches = []
        for blk in self.blocks:
            x, c = blk.prefill(x, max_len=max_len)
            caches.append(c)
        return self.logits(self.norm(x)), tuple(caches)

    def decode_view(self) -> tuple:
        """Per-layer decode-time weight views (a tuple; None for layers without one): the fused GDN
        layers' input projections side by side (:meth:`gdn_jax.layers.GatedDeltaNet.decode_view`).
        Build it once before a token loop and pass it to every :meth:`decode_step` (``generate`` and
        ``decode_loop`` do); the parameters themselves are not changed."""
        return tuple(blk.decode_view() for blk in self.blocks)

    def decode_step(self, token, cache, *, view=None):
        """One token ``token [B]`` (or ``[B, 1]``) int -> ``(logits [B, vocab] float32, new cache)``.
        Jit-able; GDN layers use the single-token recurrence (``cfg.decode_backend``: the fused layer
        kernel by default on a GPU) on their state (``cfg.state_dtype``). ``view``: the result of
        :meth:`decode_view` (None: each fused layer runs its six input projections as separate
        matmuls; ValueError unless a tuple with one entry per layer)."""
        if not (hasattr(token, "ndim") and hasattr(token, "dtype")):
            raise TypeError(f"token must be an integer array [B] or [B, 1] (a NumPy or JAX array), got "
                            f"{type(token).__name__}")
        if token.ndim == 1:
            token = token[:, None]
        if token.ndim != 2 or token.shape[1] != 1 or not jnp.issubdtype(token.dtype, jnp.integer):
            raise ValueError(f"token must be an integer array [B] or [B, 1], got {token.dtype} {tuple(token.shape)}")
        if token.shape[0] == 0:
            raise ValueError("token has batch B = 0; need B >= 1")
        if len(cache) != len(self.blocks):
            raise ValueError(f"cache has {len(cache)} layer entries for {len(self.blocks)} layers")
        _check_token_range(token, self.cfg.vocab_size)
        self._no_learned_positions("decode_step")
        if view is None:
            view = (None,) * len(self.blocks)
        elif not isinstance(view, (tuple, list)) or len(view) != len(self.blocks):
            raise ValueError(f"view must be model.decode_view(), a tuple of {len(self.blocks)} layer entries, got "
                             f"{type(view).__name__}")
        x = self.embed(token)
        new = []
        for blk, c, v in zip(self.blocks, cache, view):
            x, c = blk.decode(x, c, v)
            new.append(c)
        return apply_rows(self.logits, self.norm(x))[:, 0], tuple(new)
