"""Options of the Hopper (Mosaic GPU) kernels of this package: :class:`HopperTuning` (``KernelConfig(hopper=...)``)
and :class:`HopperVariants`, the variants that ran correctly but measured no faster (opt-in, for the
benchmarks). Each field's measurements are in docs/kernels.md ("Options in detail") and
results/hopper_h200/. Plain Python: no kernel is imported here."""
from __future__ import annotations

import dataclasses
from typing import Optional

from ..checks import check_bool, check_choice, check_int, check_one_of_ints

# the Hopper kernels that can place their own barriers (HopperTuning.auto_barriers), and those that do
# by default: all but the reverse pass, which measured 9 % slower without Pallas' barriers
OWN_BARRIER_KERNELS = ("wy", "state", "reverse", "grads")
DEFAULT_OWN_BARRIERS = ("wy", "state", "grads")


@dataclasses.dataclass(frozen=True)
class HopperVariants:
    """Variants of the Hopper kernels that are correct but measured no faster than the defaults
    (H200, results/hopper_h200/); kept for the benchmarks, not part of the documented options.

    Attributes:
      wy_chunks_per_cta: chunks of one head per CTA of the forward WY kernel (None / 1: one; m > 1:
        a loop over m chunks with the next one's tiles in flight). No gain measured.
      grad_chunks_per_cta: the same for the two-warpgroup gradient kernel (needs
        ``grad_warpgroups=2``). Slower (0.59-0.66 vs 0.43 ms at 4x4096x16x128).
      state_warpgroups: compute warpgroups per warp-specialised state-pass CTA, 1 or 2 (2 needs
        ``state_producer``). Slower (0.401 vs 0.320 ms at 1x16384x16x128).
      state_slots: TMA slots of a warp-specialised state pass, 2, 3 or 4 (needs
        ``state_producer``). No gain (0.322 vs 0.320 ms).

    Raises:
      TypeError / ValueError: a field outside its choices, naming it.
    """

    wy_chunks_per_cta: Optional[int] = None
    grad_chunks_per_cta: Optional[int] = None
    state_warpgroups: int = 1
    state_slots: int = 2

    def __post_init__(self):
        for name in ("wy_chunks_per_cta", "grad_chunks_per_cta"):
            object.__setattr__(self, name, check_int("HopperVariants", name, getattr(self, name), optional=True))
        check_one_of_ints("HopperVariants", "state_warpgroups", self.state_warpgroups, (1, 2))
        check_one_of_ints("HopperVariants", "state_slots", self.state_slots, (2, 3, 4))


@dataclasses.dataclass(frozen=True)
class HopperTuning:
    """Options of the Hopper kernels (sm_90, :mod:`gdn_jax.ops.pallas.hopper`); none changes the
    result beyond rounding. Defaults measured on an H200 (docs/kernels.md, results/hopper_h200/).

    Attributes:
      fwd_form: what the forward WY kernel hands the state pass: "wu" (W and U), "t" (T; the state
        pass forms Vn from T and v) or "transition" (opt-in, slower); None: "t" at K > 128 and at
        K = 128 with >= 128 state-pass CTAs, else "wu".
      wide_backward: the backward at K or V above 128: "hopper" (reverse pass and gradient kernel on
        128 x 128 blocks), "hopper_xla" (XLA local gradients) or "triton"; None: "hopper".
      save_wy: the forward keeps Aqk and T for the backward (no second inverse); None: on.
      save_states: the forward keeps the per-chunk states and Vn (no recompute pass); None: on.
      wy_inverse: T = (I + A)^-1 by "blocked" (default: the rounds inside the 16 x 16 diagonal
        blocks on those blocks alone) or "dense" doubling rounds.
      wy_precision: the inverse's products: "bf16" (default), "bf16_blocks" or "bf16x3" (~2^-16).
      wy_compact: the forward WY kernel in fewer shared-memory tiles (K == V). Default True.
      grad_t_phase: the gradient kernel's dA: "direct" (default) or "chain".
      grad_precision: the gradient kernel's T-phase products: "bf16" (default) or "bf16x3".
      grad_warpgroups: warpgroups of the gradient kernel, 2 (default) or 1.
      approx_math: exp as ``ex2.approx.ftz`` (default True).
      auto_barriers: Pallas' automatic barriers: True (all kernels), False (none), None (all but
        the reverse pass place their own: :data:`DEFAULT_OWN_BARRIERS`).
      late_o_store: the forward state pass stores chunk i's output during chunk i+1 (default True).
      state_producer: the state passes warp-specialised, a producer warpgroup issuing the copies
        (default True; GPU only, K <= 128).
      reverse_producer: the reverse pass warp-specialised likewise (default True; GPU only).
      variants: :class:`HopperVariants` (measured no faster; for the benchmarks).

    Raises:
      TypeError / ValueError: a field outside its choices, naming it.
    """

    fwd_form: Optional[str] = None
    wide_backward: Optional[str] = None
    save_wy: Optional[bool] = None
    save_states: Optional[bool] = None
    wy_inverse: str = "blocked"
    wy_precision: str = "bf16"
    wy_compact: bool = True
    grad_t_phase: str = "direct"
    grad_precision: str = "bf16"
    grad_warpgroups: int = 2
    approx_math: bool = True
    auto_barriers: Optional[bool] = None
    late_o_store: bool = True
    state_producer: bool = True
    reverse_producer: bool = True
    variants: HopperVariants = HopperVariants()

    def __post_init__(self):
        own = "HopperTuning"
        for name, ok in (("fwd_form", (None, "wu", "t", "transition")),
                         ("wide_backward", (None, "triton", "hopper_xla", "hopper")),
                         ("wy_inverse", ("dense", "blocked")), ("wy_precision", ("bf16x3", "bf16_blocks", "bf16")),
                         ("grad_precision", ("bf16x3", "bf16")), ("grad_t_phase", ("chain", "direct"))):
            check_choice(own, name, getattr(self, name), ok)
        for name in ("save_wy", "save_states", "auto_barriers"):
            check_bool(own, name, getattr(self, name), optional=True)
        for name in ("wy_compact", "approx_math", "late_o_store", "state_producer", "reverse_producer"):
            check_bool(own, name, getattr(self, name))
        check_one_of_ints(own, "grad_warpgroups", self.grad_warpgroups, (1, 2))
        if not isinstance(self.variants, HopperVariants):
            raise TypeError(f"{own}.variants must be a HopperVariants, got {type(self.variants).__name__}")
        var = self.variants
        for name, ok in (("state_warpgroups", (1, 2)), ("state_slots", (2, 3, 4))):
            if getattr(var, name) != ok[0] and not self.state_producer:
                raise ValueError(f"HopperVariants.{name}={getattr(var, name)} needs the state pass's producer "
                                 f"warpgroup (state_producer=True)")
        if (var.grad_chunks_per_cta or 1) > 1 and self.grad_warpgroups != 2:
            raise ValueError(f"HopperVariants.grad_chunks_per_cta={var.grad_chunks_per_cta} needs the two-warpgroup "
                             f"gradient kernel (grad_warpgroups=2), got grad_warpgroups={self.grad_warpgroups}")

    def own_barriers(self) -> tuple:
        """The kernels compiled without Pallas' automatic barriers (``auto_barriers`` resolved)."""
        if self.auto_barriers is None:
            return DEFAULT_OWN_BARRIERS
        return () if self.auto_barriers else OWN_BARRIER_KERNELS
