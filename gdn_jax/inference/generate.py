"""Sampling with prefill + a compiled decode loop, and a decode-vs-forward drift probe.

``generate`` jits one function per (graph, batch, prompt length, max_new_tokens, max_len, top_k):
the prompt goes through :meth:`LM.prefill` (chunked / Pallas GDN op), then a ``lax.scan`` of
:meth:`LM.decode_step` over the new tokens, so nothing is retraced per token. ``temperature`` is a
traced scalar (changing it does not recompile); ``temperature == 0`` is greedy (argmax).
"""
from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

TRACE_COUNT = {"generate": 0}  # incremented at trace time (tests check there is one trace per shape)


def _sample(logits, key, temperature, top_k: Optional[int]):
    """logits ``[B, vocab]`` float32 -> token ids ``[B]`` int32; greedy where temperature == 0."""
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    z = logits / jnp.maximum(temperature, 1e-6)
    if top_k is not None:
        kth = jax.lax.top_k(z, top_k)[0][:, -1:]
        z = jnp.where(z < kth, -jnp.inf, z)
    sampled = jax.random.categorical(key, z, axis=-1).astype(jnp.int32)
    return jnp.where(temperature > 0, sampled, greedy)


@functools.partial(jax.jit, static_argnums=(0,), static_argnames=("max_new_tokens", "max_len", "top_k"))
def _generate(graphdef, state, prompt, key, temperature, *, max_new_tokens: int, max_len: int, top_k):
    TRACE_COUNT["generate"] += 1
    model = nnx.merge(graphdef, state)
    keys = jax.random.split(key, max_new_tokens)
    logits, cache = model.prefill(prompt, max_len)
    tok = _sample(logits[:, -1], keys[0], temperature, top_k)

    def body(carry, k):
        cache, tok = carry
        lg, cache = model.decode_step(tok, cache)
        nxt = _sample(lg, k, temperature, top_k)
        return (cache, nxt), nxt

    _, rest = jax.lax.scan(body, (cache, tok), keys[1:])
    return jnp.concatenate([tok[:, None], jnp.moveaxis(rest, 0, 1)], axis=1)


def generate(model, prompt, max_new_tokens: int, *, key, temperature: float = 0.0,
             top_k: Optional[int] = None, max_len: Optional[int] = None):
    """Sample ``max_new_tokens`` tokens after ``prompt``.

    Args:
      model: an :class:`gdn_jax.models.LM` (every mixer must have ``init_cache/prefill/decode``).
      prompt: int ``[B, T]``, T >= 1.
      max_new_tokens: number of tokens to produce (>= 0).
      key: a PRNG key (same key, same tokens).
      temperature: softmax temperature (>= 0); 0 means greedy argmax. Traced: no recompilation.
      top_k: keep only the k most likely tokens before sampling (``None``: all).
      max_len: attention KV-cache slots (default ``T + max_new_tokens``, the least that fits).

    Returns:
      int32 ``[B, max_new_tokens]``: the new tokens only.

    Raises:
      ValueError: empty or non-integer prompt, negative max_new_tokens, negative temperature,
        top_k outside [1, vocab], or ``T + max_new_tokens > max_len``.
    """
    prompt = jnp.asarray(prompt)
    if prompt.ndim != 2 or not jnp.issubdtype(prompt.dtype, jnp.integer):
        raise ValueError(f"prompt must be an integer array [B, T], got {prompt.dtype} {tuple(prompt.shape)}")
    B, T = prompt.shape
    if T == 0:
        raise ValueError("empty prompt (T = 0): generate needs at least one prompt token")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be a non-negative int, got {max_new_tokens!r}")
    if max_len is None:
        max_len = T + int(max_new_tokens)
    if T > max_len:
        raise ValueError(f"prompt of {T} tokens is longer than the attention cache's max_len = {max_len}")
    if T + max_new_tokens > max_len:
        raise ValueError(f"prompt ({T}) + max_new_tokens ({max_new_tokens}) = {T + max_new_tokens} "
                         f"exceeds the attention cache's max_len = {max_len}")
    if float(temperature) < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    vocab = model.cfg.vocab_size
    if top_k is not None and not (1 <= int(top_k) <= vocab):
        raise ValueError(f"top_k must be in [1, {vocab}], got {top_k}")
    if max_new_tokens == 0:
        return jnp.zeros((B, 0), jnp.int32)
    graphdef, state = nnx.split(model)
    return _generate(graphdef, state, prompt, key, jnp.asarray(temperature, jnp.float32),
                     max_new_tokens=int(max_new_tokens), max_len=int(max_len),
                     top_k=None if top_k is None else int(top_k))


@functools.partial(jax.jit, static_argnums=(0,), static_argnames=("n_prompt",))
def _teacher_forced_decode(graphdef, state, tokens, *, n_prompt: int):
    model = nnx.merge(graphdef, state)
    T = tokens.shape[1]
    _, cache = model.prefill(tokens[:, :n_prompt], T)

    def body(cache, tok):
        lg, cache = model.decode_step(tok, cache)
        return cache, lg

    cache, lg = jax.lax.scan(body, cache, jnp.moveaxis(tokens[:, n_prompt:], 1, 0))
    return jnp.moveaxis(lg, 0, 1), cache


def decode_drift(model, tokens, *, n_prompt: int = 1):
    """Drift of step-by-step decoding against one parallel (chunked) forward over the same tokens.

    Prefills ``tokens[:, :n_prompt]``, then decodes ``tokens[:, n_prompt:]`` one at a time
    (teacher forcing, a jitted ``lax.scan``) and compares each step's logits with ``model(tokens)``
    at the same position.

    Returns:
      (rel ``[T - n_prompt]`` numpy float64: per-step RMS-relative logit error
      ``||l_dec - l_fwd|| / ||l_fwd||`` over batch and vocab, decode cache after the last token).
    """
    graphdef, state = nnx.split(model)
    lg, cache = _teacher_forced_decode(graphdef, state, tokens, n_prompt=n_prompt)
    ref = model(tokens)[:, n_prompt:]
    d = np.asarray(lg, np.float64) - np.asarray(ref, np.float64)
    rel = np.sqrt((d ** 2).mean(axis=(0, 2)) / (np.asarray(ref, np.float64) ** 2).mean(axis=(0, 2)))
    return rel, cache
