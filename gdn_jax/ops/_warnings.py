"""Warnings of the ops where a call is legal but likely not what the caller meant.

* :class:`HeadFirstLayoutWarning`: a direct call of :func:`gdn_jax.ops.gated_delta_rule` or
  :func:`gdn_jax.ops.gated_linear_attention` whose ``q`` ``[B, T, H, K]`` has ``1 < T < H``: more
  heads than tokens suggests a head-first ``[B, H, T, K]`` array (FLA's layout with
  ``head_first=True``) read as ``[B, T, H, K]``, which computes a recurrence over the heads without
  an error (FLA warns likewise). The layers, prefill and decode call the ops inside
  :func:`internal_call` and never warn (their ``[B, T, H, D]`` comes from their own projections;
  a short prompt with many heads is legitimate there).
* :class:`PallasInterpreterWarning`: ``backend="pallas"`` on a CPU (no ``KernelConfig.platform``
  chosen) runs the Pallas kernels in the interpreter, correct but several times slower than
  ``backend="chunk"`` (measured 4.5x in a small MQAR run).

Each is issued once per process (:func:`reset` shows them again) with ``warnings.warn`` and a
``stacklevel`` that names the caller of the op; silence one with
``warnings.filterwarnings("ignore", category=...)``.
"""
from __future__ import annotations

import contextlib
import contextvars
import warnings
from typing import Iterator

__all__ = ["HeadFirstLayoutWarning", "PallasInterpreterWarning", "internal_call", "reset", "warn_head_first",
           "warn_pallas_interpreter"]


class HeadFirstLayoutWarning(UserWarning):
    """``[B, T, H, D]`` inputs with ``1 < T < H``: perhaps a head-first ``[B, H, T, D]`` array."""


class PallasInterpreterWarning(UserWarning):
    """``backend="pallas"`` on a CPU: the Pallas kernels run in the (slow) interpreter."""


_INTERNAL = contextvars.ContextVar("gdn_jax_ops_internal_call", default=False)
_SHOWN: set = set()


@contextlib.contextmanager
def internal_call() -> Iterator[None]:
    """Within this context the ops do not check the layout (:class:`HeadFirstLayoutWarning`): for
    the library's own calls (layers, prefill, decode), whose shapes are right by construction."""
    token = _INTERNAL.set(True)
    try:
        yield
    finally:
        _INTERNAL.reset(token)


def reset() -> None:
    """Forget which warnings were shown (each shows again once)."""
    _SHOWN.clear()


def _once(category, message: str, stacklevel: int) -> None:
    if category in _SHOWN:
        return
    _SHOWN.add(category)
    warnings.warn(message, category, stacklevel=stacklevel + 1)


def warn_head_first(op: str, q, *, stacklevel: int = 2) -> None:
    """:class:`HeadFirstLayoutWarning` (once) when ``q [B, T, H, K]`` has ``1 < T < H``, unless
    inside :func:`internal_call`. ``stacklevel`` 2 names the caller of the function that calls this."""
    if _INTERNAL.get() or len(getattr(q, "shape", ())) != 4:
        return
    T, H = q.shape[1], q.shape[2]
    if 1 < T < H:
        _once(HeadFirstLayoutWarning,
              f"{op}: q has shape {tuple(q.shape)}, read as [B, T, H, K] = T {T} tokens of H {H} heads; fewer "
              f"tokens than heads suggests a head-first [B, H, T, K] array (transpose it: jnp.swapaxes(x, 1, 2)); "
              f"the ops take [B, T, H, K]. Shown once; silence with warnings.filterwarnings('ignore', "
              f"category=gdn_jax.ops.HeadFirstLayoutWarning)", stacklevel + 1)


def warn_pallas_interpreter(kernel_config, *, stacklevel: int = 2) -> None:
    """:class:`PallasInterpreterWarning` (once) when the Pallas kernels will run in the interpreter
    because JAX's default backend is the CPU and ``kernel_config`` chose no platform (an explicit
    ``KernelConfig(platform="interpret")`` is a choice, not a mistake: no warning)."""
    import jax

    if getattr(kernel_config, "platform", None) is not None or jax.default_backend() != "cpu":
        return
    _once(PallasInterpreterWarning,
          "backend='pallas' on the CPU runs the Pallas kernels in the interpreter: correct, but several times slower "
          "than backend='chunk' (the chunked form in XLA, which backend='auto' picks on CPU). Shown once",
          stacklevel + 1)
