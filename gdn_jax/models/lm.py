"""A small pre-norm language model with pluggable token mixers."""
from __future__ import annotations

import dataclasses
from typing import Callable, Dict, Optional, Tuple, Union

import jax
import jax.numpy as jnp
from flax import nnx

from ..layers import Attention, GatedDeltaNet, GatedLinearAttention
from ..ops import KernelConfig
from ..ops.linear_attention import LA_BACKENDS


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
        the no-delta-rule mixers run ``"pallas"`` as ``"auto"``, README "Baseline mixers").
      kernel_config: a ``gdn_jax.ops.KernelConfig`` for the GDN / DeltaNet mixers' Pallas kernels
        (None: the defaults).
      use_short_conv: the short conv of the recurrent mixers.
      decay, decay_per_channel, beta_per_channel, allow_neg_eigval: GatedDeltaNet options
        (``deltanet`` takes beta_per_channel and allow_neg_eigval; README "Layer and models").
      norm_eps: RMSNorm epsilon. embed_init_std: token-embedding init std (tied LM head).
      dtype / param_dtype: computation / parameter dtypes.
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

    def __post_init__(self):
        from ..layers import _checks
        from ..layers.gated_deltanet import DECAY_KINDS
        from ..ops.gated_delta_rule import BACKENDS

        for name in ("vocab_size", "d_model", "num_layers", "num_heads", "chunk_size"):
            _checks.positive_int(name, getattr(self, name))
        if self.head_dim is not None:
            _checks.positive_int("head_dim", self.head_dim)
        _checks.positive_int("hybrid_every", self.hybrid_every, minimum=0)
        _checks.one_of("backend", self.backend, BACKENDS)
        _checks.kernel_config(self.kernel_config, self.backend)
        _checks.one_of("decay", self.decay, DECAY_KINDS)
        _checks.positive_float("norm_eps", self.norm_eps)
        _checks.positive_float("embed_init_std", self.embed_init_std)
        if isinstance(self.mlp_ratio, bool) or not isinstance(self.mlp_ratio, (int, float)) or self.mlp_ratio < 0:
            raise ValueError(f"mlp_ratio must be a number >= 0, got {self.mlp_ratio!r}")
        for name in ("dtype", "param_dtype"):
            _checks.float_dtype(name, getattr(self, name))
        if not isinstance(self.mixer, (str, tuple, list)) or not isinstance(self.hybrid_mixer, str):
            raise TypeError(f"mixer must be a name or a tuple of names and hybrid_mixer a name, got "
                            f"{self.mixer!r}, {self.hybrid_mixer!r}")
        self.layer_mixers()  # mixer tuple length

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


MixerFactory = Callable[[LMConfig, int, nnx.Rngs], nnx.Module]
MIXERS: Dict[str, MixerFactory] = {}


def register_mixer(name: str, factory: Optional[MixerFactory] = None):
    """Register a token mixer: ``factory(cfg, layer_index, rngs) -> nnx.Module``.

    The module is called as ``mixer(x, cu_seqlens=None)`` with ``x [B, T, d_model]`` and returns
    the same shape; for decoding it also needs ``init_cache(batch, max_len)``,
    ``prefill(x, max_len=...) -> (y, cache)`` and ``decode(x_t, cache) -> (y_t, cache)`` (README
    "Inference"). Usable as a decorator.
    """

    def deco(f):
        MIXERS[name] = f
        return f

    return deco(factory) if factory is not None else deco


def _dt(name):
    return jnp.dtype(name)


def _gdn_layer(cfg: LMConfig, rngs: nnx.Rngs, **override):
    kw = dict(decay=cfg.decay, decay_per_channel=cfg.decay_per_channel, beta_per_channel=cfg.beta_per_channel,
              allow_neg_eigval=cfg.allow_neg_eigval, use_short_conv=cfg.use_short_conv, backend=cfg.backend,
              chunk_size=cfg.chunk_size, kernel_config=cfg.kernel_config, norm_eps=cfg.norm_eps,
              dtype=_dt(cfg.dtype), param_dtype=_dt(cfg.param_dtype))
    return GatedDeltaNet(cfg.d_model, cfg.num_heads, cfg.head_dim, **{**kw, **override}, rngs=rngs)


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
        return GatedLinearAttention(
            cfg.d_model, cfg.num_heads, cfg.head_dim, decay=decay, use_short_conv=cfg.use_short_conv,
            backend=backend, chunk_size=cfg.chunk_size, norm_eps=cfg.norm_eps, dtype=_dt(cfg.dtype),
            param_dtype=_dt(cfg.param_dtype), rngs=rngs,
        )

    factory.__doc__ = doc
    return factory


register_mixer("mamba2", _linear_attention_factory("mamba2", "Mamba2/SSD-style: per-head decay, no delta rule."))
register_mixer("gla", _linear_attention_factory("gla", "GLA: per-key-channel decay, no delta rule."))
register_mixer("linear", _linear_attention_factory("none", "Linear attention: no decay, no delta rule."))


@register_mixer("attention")
def _attention(cfg: LMConfig, i: int, rngs: nnx.Rngs):
    return Attention(cfg.d_model, cfg.num_heads, cfg.head_dim, norm_eps=cfg.norm_eps,
                     dtype=_dt(cfg.dtype), param_dtype=_dt(cfg.param_dtype), rngs=rngs)


@register_mixer("gated_attention")
def _gated_attention(cfg: LMConfig, i: int, rngs: nnx.Rngs):
    """Qwen3-Next's attention: sigmoid output gate, per-head q/k RMSNorm, partial RoPE (1/4)."""
    return Attention(cfg.d_model, cfg.num_heads, cfg.head_dim, qk_norm=True, output_gate=True,
                     rope_fraction=0.25, norm_eps=cfg.norm_eps, dtype=_dt(cfg.dtype),
                     param_dtype=_dt(cfg.param_dtype), rngs=rngs)


class SwiGLU(nnx.Module):
    """``W_down(silu(W_gate x) * W_up x)``."""

    def __init__(self, d: int, hidden: int, *, dtype, param_dtype, rngs: nnx.Rngs):
        lin = lambda i, o: nnx.Linear(i, o, use_bias=False, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.gate, self.up, self.down = lin(d, hidden), lin(d, hidden), lin(hidden, d)

    def __call__(self, x):
        return self.down(jax.nn.silu(self.gate(x)) * self.up(x))


class Block(nnx.Module):
    """Pre-norm residual block: ``x + mixer(norm(x))`` then ``x + mlp(norm(x))`` (if any)."""

    def __init__(self, cfg: LMConfig, i: int, mixer: str, *, rngs: nnx.Rngs):
        if mixer not in MIXERS:
            raise ValueError(f"unknown mixer {mixer!r}; registered: {sorted(MIXERS)}")
        dt, pdt = _dt(cfg.dtype), _dt(cfg.param_dtype)
        self.mixer_name = mixer
        self.norm1 = nnx.RMSNorm(cfg.d_model, epsilon=cfg.norm_eps, dtype=dt, param_dtype=pdt, rngs=rngs)
        self.mixer = MIXERS[mixer](cfg, i, rngs)
        if cfg.mlp_ratio > 0:
            self.norm2 = nnx.RMSNorm(cfg.d_model, epsilon=cfg.norm_eps, dtype=dt, param_dtype=pdt, rngs=rngs)
            self.mlp = SwiGLU(cfg.d_model, int(cfg.mlp_ratio * cfg.d_model), dtype=dt, param_dtype=pdt, rngs=rngs)
        else:
            self.norm2 = self.mlp = None

    def __call__(self, x, *, cu_seqlens=None):
        return self._mlp(x + self.mixer(self.norm1(x), cu_seqlens=cu_seqlens))

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

    def decode(self, x_t, cache):
        y, cache = self._need("decode")(self.norm1(x_t), cache)
        return self._mlp(x_t + y), cache


def _check_token_array(tokens):
    if tokens.ndim != 2 or not jnp.issubdtype(tokens.dtype, jnp.integer):
        raise ValueError(f"tokens must be an integer array [B, T], got {tokens.dtype} {tuple(tokens.shape)}")


def _check_token_range(tokens, vocab_size: int):
    """ValueError for concrete token ids outside [0, vocab_size) (traced ids cannot be checked;
    out-of-range ids would silently embed as NaN)."""
    if isinstance(tokens, jax.core.Tracer):
        return
    t = jax.device_get(tokens)
    if t.size and (t.min() < 0 or t.max() >= vocab_size):
        raise ValueError(f"tokens must be in [0, vocab_size={vocab_size}), got ids from {t.min()} to {t.max()}")


class LM(nnx.Module):
    """Token embedding, N pre-norm blocks, final RMSNorm and a tied LM head.

    ``tokens [B, T] int -> logits [B, T, vocab_size]`` (float32).
    """

    def __init__(self, cfg: LMConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        unknown = sorted({m for m in cfg.layer_mixers() if m not in MIXERS})
        if unknown:
            raise ValueError(f"unknown mixer(s) {unknown} in LMConfig.mixer / hybrid_mixer; registered: {sorted(MIXERS)}")
        dt, pdt = _dt(cfg.dtype), _dt(cfg.param_dtype)
        self.embed = nnx.Embed(cfg.vocab_size, cfg.d_model, dtype=dt, param_dtype=pdt,
                               embedding_init=nnx.initializers.normal(cfg.embed_init_std), rngs=rngs)
        blocks = [Block(cfg, i, m, rngs=rngs) for i, m in enumerate(cfg.layer_mixers())]
        self.blocks = nnx.List(blocks) if hasattr(nnx, "List") else blocks
        self.norm = nnx.RMSNorm(cfg.d_model, epsilon=cfg.norm_eps, dtype=dt, param_dtype=pdt, rngs=rngs)

    def __call__(self, tokens, *, cu_seqlens=None):
        return self.logits(self.features(tokens, cu_seqlens=cu_seqlens))

    def features(self, tokens, *, cu_seqlens=None):
        """``tokens [B, T] int -> [B, T, d_model]``: the final-normed hidden states that the tied
        head turns into logits (``self(tokens) == self.logits(self.features(tokens))``)."""
        _check_token_array(tokens)
        _check_token_range(tokens, self.cfg.vocab_size)
        if cu_seqlens is not None:
            from ..layers._checks import cu_seqlens_arg

            cu_seqlens_arg(cu_seqlens, tokens.shape[0])
        x = self.embed(tokens)
        for blk in self.blocks:
            x = blk(x, cu_seqlens=cu_seqlens)
        return self.norm(x)

    def logits(self, h):
        """The tied LM head: ``h [..., d_model] -> logits [..., vocab_size]`` (float32). Applying it
        to a gathered subset of positions saves the head's cost where only those are scored."""
        return self.embed.attend(h).astype(jnp.float32)

    # ------------------------------------------------------------------ inference (decode) path
    def init_cache(self, batch: int, max_len: int) -> tuple:
        """Per-layer empty caches (a tuple): :class:`~gdn_jax.layers.GDNCache` for the recurrent layers
        (GDN and the baselines; fixed size), :class:`~gdn_jax.layers.KVCache` of ``max_len`` slots for
        attention."""
        return tuple(blk.init_cache(batch, max_len) for blk in self.blocks)

    def prefill(self, tokens, max_len: int):
        """Run the prompt ``tokens [B, T]`` (GDN layers through the chunked / Pallas op) and return
        ``(logits [B, T, vocab] float32, cache)``; attention caches have ``max_len`` slots
        (``ValueError`` if T > max_len). The logits equal ``self(tokens)``."""
        _check_token_array(tokens)
        if tokens.shape[1] == 0:
            raise ValueError("empty prompt: tokens has T = 0; prefill needs at least one token")
        if max_len is None or tokens.shape[1] > max_len:
            raise ValueError(f"prompt of {tokens.shape[1]} tokens is longer than max_len = {max_len}")
        x = self.embed(tokens)
        caches = []
        for blk in self.blocks:
            x, c = blk.prefill(x, max_len=max_len)
            caches.append(c)
        return self.logits(self.norm(x)), tuple(caches)

    def decode_step(self, token, cache):
        """One token ``token [B]`` (or ``[B, 1]``) int -> ``(logits [B, vocab] float32, new cache)``.
        Jit-able; GDN layers use the single-token recurrence on their float32 state."""
        if token.ndim == 1:
            token = token[:, None]
        if token.ndim != 2 or token.shape[1] != 1 or not jnp.issubdtype(token.dtype, jnp.integer):
            raise ValueError(f"token must be an integer array [B] or [B, 1], got {token.dtype} {tuple(token.shape)}")
        if len(cache) != len(self.blocks):
            raise ValueError(f"cache has {len(cache)} layer entries for {len(self.blocks)} layers")
        x = self.embed(token)
        new = []
        for blk, c in zip(self.blocks, cache):
            x, c = blk.decode(x, c)
            new.append(c)
        return self.logits(self.norm(x))[:, 0], tuple(new)
