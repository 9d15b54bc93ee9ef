"""Validation helpers of the kernel options' records (:class:`~.config.KernelConfig` and its groups):
each raises ``TypeError`` / ``ValueError`` naming the option as ``owner.name`` and what it takes."""
from __future__ import annotations

import numbers

import numpy as np


def check_choice(owner: str, name: str, val, ok: tuple) -> None:
    """``val`` one of ``ok`` (strings, and None where ``ok`` has it)."""
    if val is not None and not isinstance(val, str):
        raise TypeError(f"{owner}.{name} must be one of {ok}, got {type(val).__name__} {val!r}")
    if val not in ok:
        raise ValueError(f"{owner}.{name} must be one of {ok}, got {val!r}")


def check_bool(owner: str, name: str, val, optional: bool = False) -> None:
    """``val`` True or False (or None with ``optional``)."""
    if not (isinstance(val, bool) or (val is None and optional)):
        want = "None, True or False" if optional else "True or False"
        raise TypeError(f"{owner}.{name} must be {want}, got {val!r}")


def check_int(owner: str, name: str, val, optional: bool = False):
    """``val`` a positive int (or None with ``optional``); returns it as a Python int (NumPy ints
    too: hash, repr, static arguments)."""
    if val is None and optional:
        return None
    want = f"a positive int{' or None' if optional else ''}"
    if isinstance(val, (bool, np.bool_)) or not isinstance(val, numbers.Integral):
        raise TypeError(f"{owner}.{name} must be {want}, got {val!r}")
    if val < 1:
        raise ValueError(f"{owner}.{name} must be {want}, got {val!r}")
    return int(val)


def check_one_of_ints(owner: str, name: str, val, ok: tuple) -> None:
    """``val`` an int among ``ok`` (not a bool)."""
    if isinstance(val, bool) or not isinstance(val, int):
        raise TypeError(f"{owner}.{name} must be one of {ok}, got {val!r}")
    if val not in ok:
        raise ValueError(f"{owner}.{name} must be one of {ok}, got {val!r}")
