"""Sampling with prefill + a compiled decode loop, and a decode-vs-forward drift probe.

``generate`` jits one function per (graph, batch, prompt length, max_new_tokens, max_len, top_k,
greedy or sampling, unroll): the prompt goes through :meth:`LM.prefill` (chunked / Pallas GDN op),
then a loop of :meth:`LM.decode_step` over the new tokens (static trip count: on a GPU no host
round trip per iteration either; ``unroll`` steps per iteration), so the whole token loop runs on
the device in one call and nothing is retraced per token. ``temperature == 0`` is greedy: the loop takes the
argmax of the logits and nothing else; a sampling ``temperature`` is a traced scalar (changing it
does not recompile). The fused GDN layers' decode-time weight views (:meth:`LM.decode_view`) are
built once per call, before the loop.

:func:`decode_loop` is that loop alone, from a given cache (its buffers donated, so the states and
KV caches are updated in place): timing one call and dividing by its tokens gives the per-token
cost inside the loop (``benchmarks/bench_decode.py``). ``generate(..., timings={})`` runs prefill and
the loop as two such calls and reports both times.
"""
from __future__ import annotations

import functools
import math
import time
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ..layers.attention import KVCache

TRACE_COUNT = {"generate": 0, "decode_loop": 0}  # incremented at trace time (tests check there is one trace per shape)


def default_unroll(traced_count: bool = False) -> int:
    """Decode steps per loop iteration when ``unroll`` is None; 1 on the CPU (compile time). On an
    accelerator: a loop of static trip count (``generate``, ``decode_loop``, ``time_decode_loop``):
    2 (XLA knows the trip count, so the GPU runtime launches the body that many times with no host
    round trip, but each iteration still has its own loop bookkeeping; measured on one H100, the
    seed-sized GDN model at batch 1, 1K context, fused decode layer: 0.400 / 0.372 / 0.368 / 0.379
    ms per token at 1 / 2 / 4 / 8 steps per iteration, first call 2.3 / 2.8 / 5.0 / 9.4 s of
    compile; ``results/decode_h100/NOTE.md``). A loop whose count is traced
    (``time_decode_loop(..., traced_count=True)``): 4 (every iteration costs the GPU a
    device-to-host read of the loop condition, and the host waits for it before launching the next
    iteration; unrolled, 4 steps share it)."""
    if jax.default_backend() == "cpu":
        return 1
    return 4 if traced_count else 2


def _check_unroll(unroll, traced_count: bool = False):
    if unroll is None:
        return default_unroll(traced_count)
    if isinstance(unroll, bool) or not isinstance(unroll, (int, np.integer)) or unroll < 1:
        raise ValueError(f"unroll must be an int >= 1 (decode steps per loop iteration) or None, got {unroll!r}")
    return int(unroll)


def _sample(logits, key, temperature, top_k: Optional[int], greedy: bool = False):
    """logits ``[B, vocab]`` float32 -> token ids ``[B]`` int32: the argmax with ``greedy`` (static:
    nothing else is computed); else sampled at ``temperature`` (traced; where it is 0, the argmax)."""
    argmax = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    if greedy:
        return argmax
    z = logits / jnp.maximum(temperature, 1e-6)
    if top_k is not None:
        kth = jax.lax.top_k(z, top_k)[0][:, -1:]
        z = jnp.where(z < kth, -jnp.inf, z)
    sampled = jax.random.categorical(key, z, axis=-1).astype(jnp.int32)
    return jnp.where(temperature > 0, sampled, argmax)


def _loop(model, cache, tok, keys, temperature, top_k, num_steps=None, *, greedy: bool = False, unroll: int = 1):
    """Decode steps on the device: step i feeds ``tok [B]``, chooses the next token from its logits
    (:func:`_sample`, key ``keys[i]``) and writes it to column i of the output ``[B, len(keys)]``
    int32 (columns past the last step stay 0). ``num_steps`` None runs ``len(keys)`` steps (a loop
    of static trip count); a traced int runs that many (``while`` loops: one compile serves any
    count up to ``len(keys)``). Each iteration runs ``unroll`` steps (the last ``num_steps % unroll``
    in a second loop of one step each) and writes their tokens at once. The layers' decode-time
    weight views (:meth:`LM.decode_view`, the fused GDN layers' projection weights side by side) are
    built once, before the loop. Returns (output, cache)."""
    n = keys.shape[0]
    out = jnp.zeros((tok.shape[0], n), jnp.int32)
    if n == 0:  # no step (generate with max_new_tokens=1): the loop body would still be traced
        return out, cache
    view = model.decode_view() if hasattr(model, "decode_view") else None
    unroll = max(1, min(unroll, n))  # more steps per iteration than the loop has slots: never run

    def steps(u):
        def body(carry):
            i, cache, tok, out = carry
            toks = []
            for j in range(u):
                lg, cache = model.decode_step(tok, cache) if view is None else model.decode_step(tok, cache, view=view)
                tok = _sample(lg, None if greedy else keys[i + j], temperature, top_k, greedy)
                toks.append(tok)
            out = jax.lax.dynamic_update_slice_in_dim(out, jnp.stack(toks, axis=1), i, axis=1)
            return i + u, cache, tok, out
        return body

    carry = (jnp.asarray(0, jnp.int32), cache, tok, out)
    if num_steps is None:  # static count: n // unroll iterations, then the rest unrolled once
        blocks, rest = divmod(n, unroll)
        if blocks:
            carry = jax.lax.fori_loop(0, blocks, lambda _, c: steps(unroll)(c), carry)
        if rest:
            carry = steps(rest)(carry)
    else:
        if unroll > 1:
            carry = jax.lax.while_loop(lambda c: c[0] + unroll <= num_steps, steps(unroll), carry)
        carry = jax.lax.while_loop(lambda c: c[0] < num_steps, steps(1), carry)
    _, cache, _, out = carry
    return out, cache


def _prefill_sample(model, prompt, key0, temperature, top_k, max_len, greedy=False):
    logits, cache = model.prefill(prompt, max_len)
    return _sample(logits[:, -1], key0, temperature, top_k, greedy), cache


@functools.partial(jax.jit, static_argnums=(0,), static_argnames=("max_new_tokens", "max_len", "top_k", "greedy",
                                                                   "unroll"))
def _generate(graphdef, state, prompt, key, temperature, *, max_new_tokens: int, max_len: int, top_k, greedy: bool,
              unroll: int):
    TRACE_COUNT["generate"] += 1
    model = nnx.merge(graphdef, state)
    keys = jax.random.split(key, max_new_tokens)
    tok, cache = _prefill_sample(model, prompt, keys[0], temperature, top_k, max_len, greedy)
    rest, _ = _loop(model, cache, tok, keys[1:], temperature, top_k, greedy=greedy, unroll=unroll)
    return jnp.concatenate([tok[:, None], rest], axis=1)


@functools.partial(jax.jit, static_argnums=(0,), static_argnames=("max_len", "top_k", "greedy"))
def _prefill_jit(graphdef, state, prompt, key0, temperature, *, max_len: int, top_k, greedy: bool):
    return _prefill_sample(nnx.merge(graphdef, state), prompt, key0, temperature, top_k, max_len, greedy)


@functools.partial(jax.jit, static_argnums=(0,), static_argnames=("top_k", "greedy", "unroll"), donate_argnums=(2,))
def _decode_loop(graphdef, state, cache, tok, keys, temperature, num_steps, *, top_k, greedy: bool, unroll: int):
    TRACE_COUNT["decode_loop"] += 1
    return _loop(nnx.merge(graphdef, state), cache, tok, keys, temperature, top_k, num_steps, greedy=greedy,
                 unroll=unroll)


def _check_sampling(model, temperature, top_k):
    try:
        if isinstance(temperature, (bool, str, bytes)) or np.ndim(temperature) != 0:
            raise TypeError
        t = float(temperature)
    except (TypeError, ValueError):
        raise TypeError(f"temperature must be a real number (0 for greedy), got {temperature!r}") from None
    if not (math.isfinite(t) and t >= 0):
        raise ValueError(f"temperature must be finite and >= 0 (0 for greedy), got {temperature}")
    vocab = model.cfg.vocab_size
    if top_k is not None:
        if isinstance(top_k, bool) or not isinstance(top_k, (int, np.integer)):
            raise TypeError(f"top_k must be an int in [1, {vocab}] or None, got {top_k!r}")
        if not 1 <= int(top_k) <= vocab:
            raise ValueError(f"top_k must be in [1, {vocab}], got {top_k}")


def _key_or_greedy(key, temperature, fn: str):
    """``key``, or a fixed key where decoding is greedy (``temperature == 0``: no randomness is used);
    TypeError naming ``fn`` when sampling (``temperature > 0``) has no key."""
    if key is not None:
        return key
    if float(temperature) > 0:
        raise TypeError(f"{fn}: sampling (temperature={float(temperature):g} > 0) needs key=jax.random.key(seed); "
                        f"greedy decoding (temperature=0, the default) needs none")
    return jax.random.key(0)


def _check_room(cache, num_tokens: int):
    """Every attention layer's KV cache must have ``num_tokens`` free slots after ``pos`` (checked
    where ``pos`` is concrete; past the end the cache cannot hold the new keys)."""
    for c in jax.tree_util.tree_leaves(cache, is_leaf=lambda x: isinstance(x, KVCache)):
        if isinstance(c, KVCache) and not isinstance(c.pos, jax.core.Tracer):
            pos, max_len = int(c.pos), c.k.shape[1]
            if pos + num_tokens > max_len:
                raise ValueError(f"{num_tokens} decode steps from position {pos} need {pos + num_tokens} attention "
                                 f"cache slots, the cache has max_len = {max_len} (prefill / init_cache with a "
                                 f"larger max_len)")


def _check_token(token, cache):
    """``token`` (``[B]``, or ``[B, 1]`` as :meth:`LM.decode_step` takes it) as an integer ``[B]``
    array whose B is the batch of ``cache`` (the leading dim of its arrays; scalars such as
    ``KVCache.pos`` have none)."""
    token = jnp.asarray(token)
    if token.ndim == 2 and token.shape[1] == 1:
        token = token[:, 0]
    if token.ndim != 1 or not jnp.issubdtype(token.dtype, jnp.integer):
        raise ValueError(f"token must be an integer array [B] or [B, 1], got {token.dtype} {tuple(token.shape)}")
    batches = sorted({x.shape[0] for x in jax.tree_util.tree_leaves(cache) if np.ndim(x) >= 1})
    if batches and batches != [token.shape[0]]:
        got = batches[0] if len(batches) == 1 else batches
        raise ValueError(f"token has batch B = {token.shape[0]} (shape {tuple(token.shape)}), the cache has batch "
                         f"{got}: token must be [B] with the cache's B (model.init_cache(B, ...) / model.prefill)")
    return token


def _check_ids(name, ids, model):
    """ValueError for concrete ids outside [0, vocab_size) (an out-of-range id embeds as NaN, or wraps
    around, and samples garbage); traced ids cannot be checked."""
    vocab = getattr(getattr(model, "cfg", None), "vocab_size", None)
    if vocab is None or isinstance(ids, jax.core.Tracer) or ids.size == 0:
        return
    lo, hi = int(jnp.min(ids)), int(jnp.max(ids))
    if lo < 0 or hi >= vocab:
        raise ValueError(f"{name} ids must be in [0, vocab_size={vocab}), got ids from {lo} to {hi}")


def _check_count(name, n):
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 0:
        raise ValueError(f"{name} must be a non-negative int, got {n!r}")
    return int(n)


def decode_loop(model, cache, token, num_tokens: int, *, key=None, temperature: float = 0.0,
                top_k: Optional[int] = None, unroll: Optional[int] = None):
    """``num_tokens`` decode steps from ``cache`` in one device call (``while`` loops inside one jit).

    Step i feeds the current token (``token`` first) through :meth:`LM.decode_step` and samples the
    next one from its logits (key ``jax.random.split(key, num_tokens)[i]``; greedy where
    ``temperature == 0``). The cache is **donated**: its buffers are reused for the new cache (the
    GDN states and the attention KV caches are updated in place, as a serving loop would), so the
    ``cache`` passed in must not be used afterwards. One compile per (graph, cache shapes, batch,
    num_tokens, top_k, greedy or not, unroll): the step count is static, so that XLA knows the
    loop's trip count (on a GPU: no device-to-host read of the loop condition per iteration). Timing one call (``jax.block_until_ready``) and
    dividing by ``num_tokens`` gives the per-token cost inside the loop: no host round trip per
    token, one dispatch per call. Greedy decoding (``temperature == 0``) compiles a loop that only
    takes the argmax (no random draws); a sampling temperature is traced (changing it does not
    recompile). Fused GDN layers (:meth:`gdn_jax.layers.GatedDeltaNet.uses_fused_decode`) get their
    decode-time weight views built once per call, before the first step.

    Args:
      model: an :class:`gdn_jax.models.LM`.
      cache: its cache (``model.init_cache`` / ``model.prefill``, or arrays of the same shapes and
        dtypes); an attention layer must have ``num_tokens`` free slots after ``pos``.
      token: int ``[B]`` (or ``[B, 1]``), the last token already in the context (its logits are not
        yet computed).
      num_tokens: steps to run (>= 0).
      key, temperature, top_k: as in :func:`generate`.
      unroll: decode steps per loop iteration (None: :func:`default_unroll`, 2 for this loop of
        static count on an accelerator, 1 on the CPU); the tokens are the same for every value.

    Returns:
      (int32 ``[B, num_tokens]``: the token sampled after each step, the cache after the last step).

    Raises:
      ValueError: a non-integer ``token`` not of shape ``[B]`` / ``[B, 1]`` or whose B is not the cache's batch,
        concrete ``token`` ids outside ``[0, vocab_size)`` (a traced one cannot be checked: an
        id past the table gives NaN logits), a negative ``num_tokens``, a negative or non-finite ``temperature``, an out-of-range
        ``top_k``, an attention cache with fewer than ``num_tokens`` free slots after ``pos``, an
        ``unroll`` that is not an int >= 1 or None.
      TypeError: ``temperature`` not a real number, ``top_k`` not an int.
    """
    unroll = _check_unroll(unroll)
    token = _check_token(token, cache)
    _check_ids("token", token, model)
    num_tokens = _check_count("num_tokens", num_tokens)
    _check_sampling(model, temperature, top_k)
    key = _key_or_greedy(key, temperature, "decode_loop")
    _check_room(cache, num_tokens)
    if num_tokens == 0:
        return jnp.zeros((token.shape[0], 0), jnp.int32), cache
    graphdef, state = nnx.split(model)
    return _decode_loop(graphdef, state, cache, token.astype(jnp.int32), jax.random.split(key, num_tokens),
                        jnp.asarray(temperature, jnp.float32), None,
                        top_k=None if top_k is None else int(top_k), greedy=float(temperature) == 0, unroll=unroll)


def time_decode_loop(model, cache, token, num_tokens: int, *, reps: int = 3, key=None, unroll: Optional[int] = None,
                     traced_count: bool = False):
    """Per-token cost of the decode loop measured inside it (greedy; docs/inference.md).

    Compiles :func:`decode_loop`'s loops of ``num_tokens`` and ``2 * num_tokens`` steps (static
    counts, as ``generate`` and ``decode_loop`` run them; ``traced_count=True``: one loop of
    ``2 * num_tokens`` slots whose step count is a traced argument, the protocol of earlier
    versions, whose every iteration reads its condition back to the host on a GPU), runs each once
    (warm-up: compile + run; ``first_call_s`` is the n-step one's), then ``reps`` times for
    ``num_tokens`` and for ``2 * num_tokens`` steps, each call synchronised
    (``jax.block_until_ready``) and timed on the host clock. The cache is donated to every call (in
    place) and the last one is returned; an attention layer needs ``num_tokens * (3 + 3 * reps)``
    free slots after its ``pos`` (``num_tokens * (1 + 3 * reps)`` with ``traced_count``).

    Returns a dict (seconds): ``per_token_s`` = median over reps of ``t(2n) / 2n`` (total loop time
    over its tokens, one dispatch included); ``slope_s`` = median of ``(t(2n) - t(n)) / n`` (the
    cost of one more step: dispatch and fixed costs cancel); ``call_s`` / ``call2_s`` (the
    ``t(n)`` / ``t(2n)`` of each rep); ``first_call_s``; ``tokens`` (n); ``cache`` (after the last
    call). ``unroll`` as in :func:`decode_loop` (None: :func:`default_unroll`). Raises ValueError for ``num_tokens < 1`` or
    ``reps < 1``, or a ``token`` or ``unroll`` as :func:`decode_loop` rejects it.
    """
    unroll = _check_unroll(unroll, bool(traced_count))
    num_tokens = _check_count("num_tokens", num_tokens)
    reps = _check_count("reps", reps)
    if num_tokens < 1 or reps < 1:
        raise ValueError(f"num_tokens and reps must be >= 1, got {num_tokens}, {reps}")
    token = _check_token(token, cache).astype(jnp.int32)
    graphdef, state = nnx.split(model)
    keys = jax.random.split(jax.random.key(0) if key is None else key, 2 * num_tokens)
    temp = jnp.asarray(0.0, jnp.float32)
    steps = {m: jnp.asarray(m * num_tokens, jnp.int32) for m in (1, 2)}

    def call(m, cache):
        ks, n = (keys, steps[m]) if traced_count else (keys[:m * num_tokens], None)
        t0 = time.perf_counter()
        out, cache = jax.block_until_ready(_decode_loop(graphdef, state, cache, token, ks, temp, n, top_k=None,
                                                        greedy=True, unroll=unroll))
        return time.perf_counter() - t0, cache

    first, cache = call(1, cache)
    if not traced_count:
        _, cache = call(2, cache)  # the 2n-step loop's compile
    t1, t2 = [], []
    for _ in range(reps):
        a, cache = call(1, cache)
        b, cache = call(2, cache)
        t1.append(a)
        t2.append(b)
    t1, t2 = np.asarray(t1), np.asarray(t2)
    return dict(per_token_s=float(np.median(t2 / (2 * num_tokens))), slope_s=float(np.median((t2 - t1) / num_tokens)),
                call_s=t1.tolist(), call2_s=t2.tolist(), first_call_s=first, tokens=num_tokens, cache=cache)


def generate(model, prompt, max_new_tokens: int, *, key=None, temperature: float = 0.0,
             top_k: Optional[int] = None, max_len: Optional[int] = None, timings: Optional[dict] = None,
             unroll: Optional[int] = None):
    """Sample ``max_new_tokens`` tokens after ``prompt``.

    Args:
      model: an :class:`gdn_jax.models.LM` (every mixer must have ``init_cache/prefill/decode``).
      prompt: int ``[B, T]``, T >= 1: B prompts of the same length. There is no attention mask:
        every token of every row is context, so a padded row (left or right) is generated from its
        pad tokens too; batch prompts of one length, or call once per length.
      max_new_tokens: number of tokens to produce (>= 0; 0 returns ``[B, 0]`` and, with
        ``timings``, zeros and nan).
      key: a PRNG key (same key, same tokens); needed only to sample (``temperature > 0``): greedy
        decoding (the default) takes none.
      temperature: softmax temperature (>= 0); 0 means greedy argmax (a loop that computes only the
        argmax: one compile for greedy decoding, one for sampling, whose temperature is traced).
      top_k: keep only the k most likely tokens before sampling (``None``: all).
      max_len: attention KV-cache slots (default ``T + max_new_tokens``, the least that fits).
      timings: ``None`` (default): prefill and the token loop run in one jitted call. A dict: they
        run as two synchronised calls (prefill + first token, then :func:`decode_loop` on the donated
        cache; the same tokens) and the dict receives ``prefill_s``, ``decode_s`` (seconds, wall
        clock of each call), ``decode_tokens`` (``max_new_tokens - 1``: the loop's steps) and
        ``per_token_s`` (``decode_s / decode_tokens``; nan without loop steps). The first call of a
        shape includes its compilation: time the second.
      unroll: decode steps per loop iteration, as in :func:`decode_loop`.

    Returns:
      int32 ``[B, max_new_tokens]``: the new tokens only.

    Raises:
      ValueError: empty or non-integer prompt, negative max_new_tokens, a negative or non-finite
        temperature, top_k outside [1, vocab], ``T + max_new_tokens > max_len``, or prompt ids
        outside [0, vocab_size), an ``unroll`` that is not an int >= 1 or None.
      TypeError: ``temperature`` not a real number, ``top_k`` not an int; ``key`` None with
        ``temperature > 0`` (sampling needs a key).
    """
    unroll = _check_unroll(unroll)
    prompt = jnp.asarray(prompt)
    if prompt.ndim != 2 or not jnp.issubdtype(prompt.dtype, jnp.integer):
        raise ValueError(f"prompt must be an integer array [B, T], got {prompt.dtype} {tuple(prompt.shape)}")
    B, T = prompt.shape
    if T == 0:
        raise ValueError("empty prompt (T = 0): generate needs at least one prompt token")
    if B == 0:
        raise ValueError(f"prompt has batch B = 0 (shape {tuple(prompt.shape)}); need B >= 1")
    max_new_tokens = _check_count("max_new_tokens", max_new_tokens)
    if max_len is None:
        max_len = T + int(max_new_tokens)
    if T > max_len:
        raise ValueError(f"prompt of {T} tokens is longer than the attention cache's max_len = {max_len}")
    if T + max_new_tokens > max_len:
        raise ValueError(f"prompt ({T}) + max_new_tokens ({max_new_tokens}) = {T + max_new_tokens} "
                         f"exceeds the attention cache's max_len = {max_len}")
    _check_sampling(model, temperature, top_k)
    key = _key_or_greedy(key, temperature, "generate")
    _check_ids("prompt", prompt, model)
    if max_new_tokens == 0:
        if timings is not None:  # nothing ran: no stale numbers of an earlier call left in the dict
            timings.update(prefill_s=0.0, decode_s=0.0, decode_tokens=0, per_token_s=float("nan"))
        return jnp.zeros((B, 0), jnp.int32)
    graphdef, state = nnx.split(model)
    temp, top_k = jnp.asarray(temperature, jnp.float32), None if top_k is None else int(top_k)
    greedy = float(temperature) == 0
    if timings is None:
        return _generate(graphdef, state, prompt, key, temp, max_new_tokens=max_new_tokens, max_len=int(max_len),
                         top_k=top_k, greedy=greedy, unroll=unroll)
    keys = jax.random.split(key, max_new_tokens)
    t0 = time.perf_counter()
    tok, cache = jax.block_until_ready(_prefill_jit(graphdef, state, prompt, keys[0], temp, max_len=int(max_len),
                                                    top_k=top_k, greedy=greedy))
    t1 = time.perf_counter()
    n = max_new_tokens - 1
    if n == 0:  # the prefill's token only: no loop steps
        timings.update(prefill_s=t1 - t0, decode_s=0.0, decode_tokens=0, per_token_s=float("nan"))
        return tok[:, None]
    rest, cache = jax.block_until_ready(_decode_loop(graphdef, state, cache, tok, keys[1:], temp,
                                                     None, top_k=top_k, greedy=greedy,
                                                     unroll=unroll))
    t2 = time.perf_counter()
    timings.update(prefill_s=t1 - t0, decode_s=t2 - t1, decode_tokens=n, per_token_s=(t2 - t1) / n if n else float("nan"))
    return jnp.concatenate([tok[:, None], rest], axis=1)


@functools.partial(jax.jit, static_argnums=(0,), static_argnames=("n_prompt",))
def _teacher_forced_decode(graphdef, state, tokens, *, n_prompt: int):
    model = nnx.merge(graphdef, state)
    T = tokens.shape[1]
    _, cache = model.prefill(tokens[:, :n_prompt], T)
    view = model.decode_view()  # the fused layers' weight views, built once before the steps

    def body(cache, tok):
        lg, cache = model.decode_step(tok, cache, view=view)
        return cache, lg

    cache, lg = jax.lax.scan(body, cache, jnp.moveaxis(tokens[:, n_prompt:], 1, 0))
    return jnp.moveaxis(lg, 0, 1), cache


def teacher_forced_logits(model, tokens, *, n_prompt: int = 1):
    """Prefill ``tokens[:, :n_prompt]``, then decode ``tokens[:, n_prompt:]`` one at a time (teacher
    forcing: a jitted ``lax.scan`` of :meth:`LM.decode_step`). Returns (logits ``[B, T - n_prompt,
    vocab]`` float32, the logits of each decode step, i.e. of positions ``n_prompt .. T-1``; the
    cache after the last token). ValueError unless ``tokens`` is an integer ``[B, T]`` array and
    ``1 <= n_prompt <= T`` (``n_prompt == T``: no decode step, empty logits)."""
    tokens = jnp.asarray(tokens)
    if tokens.ndim != 2 or not jnp.issubdtype(tokens.dtype, jnp.integer):
        raise ValueError(f"tokens must be an integer array [B, T], got {tokens.dtype} {tuple(tokens.shape)}")
    T = tokens.shape[1]
    if isinstance(n_prompt, bool) or not isinstance(n_prompt, (int, np.integer)) or not 1 <= n_prompt <= T:
        raise ValueError(f"n_prompt must be an int in [1, T = {T}] (the prefilled tokens), got {n_prompt!r}")
    graphdef, state = nnx.split(model)
    return _teacher_forced_decode(graphdef, state, tokens, n_prompt=int(n_prompt))


def rel_rms_per_step(a, b):
    """Per-step RMS-relative error ``||a - b|| / ||b||`` over batch and vocab of logits
    ``[B, S, vocab]``: numpy float64 ``[S]``."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.sqrt(((a - b) ** 2).mean(axis=(0, 2)) / (b ** 2).mean(axis=(0, 2)))


def decode_drift(model, tokens, *, n_prompt: int = 1, reference=None):
    """Drift of step-by-step decoding against a reference over the same tokens.

    Prefills ``tokens[:, :n_prompt]``, then decodes ``tokens[:, n_prompt:]`` one at a time
    (:func:`teacher_forced_logits`) and compares each step's logits with the reference at the same
    position: ``model(tokens)`` (one parallel, chunked forward) by default, or ``reference``, the
    ``[B, T - n_prompt, vocab]`` logits of another decode (e.g. the float32-state run of a
    bfloat16-state model).

    Returns:
      (rel ``[T - n_prompt]`` numpy float64: per-step RMS-relative logit error
      ``||l_dec - l_ref|| / ||l_ref||`` over batch and vocab, decode cache after the last token).
    """
    lg, cache = teacher_forced_logits(model, tokens, n_prompt=n_prompt)
    ref = model(tokens)[:, n_prompt:] if reference is None else reference
    if tuple(np.shape(ref)) != tuple(lg.shape):
        raise ValueError(f"reference must have the decode logits' shape {tuple(lg.shape)}, got {tuple(np.shape(ref))}")
    return rel_rms_per_step(lg, ref), cache
