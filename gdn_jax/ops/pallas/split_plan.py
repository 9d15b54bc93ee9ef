"""Planning of the sequence split (``KernelConfig.seq_split``), in plain Python: how many pieces
each sequence is cut into, or why it is not cut. The split itself is :mod:`gdn_jax.ops.seq_split`.

The state passes run one program (CTA) per (batch row, value head, block of value columns), each a
chain of dependent chunk steps over the whole sequence. With few, long sequences those programs
leave most of the GPU's SMs idle. The split cuts every sequence into P pieces run as extra batch
rows: one kernel call gives every piece's affine map ``[M | N]`` (augmented values of width K + V),
a float32 scan composes them into each piece's entering state, and a second call runs the pieces
from those states (``../shared/REFERENCE.md`` section 10, "Sequence split").
"""
from __future__ import annotations

import math
from typing import Optional, Tuple

BLOCK = 64  # value columns per state-pass CTA in the cost model (the anchors' unit, REFERENCE section 10)
DEFAULT_SMS = 132  # an H100 SXM / H200: the SM count where no GPU is present
AUTO_PIECES = (2, 4, 8, 16)  # the piece counts "auto" considers
MIN_CHUNKS = 2  # every piece at least this many chunks (an explicit piece count)
AUTO_MIN_CHUNKS = 4  # "auto": pieces of at least this many chunks
AUTO_GAIN = 0.8  # "auto" splits only where the model's state-pass time falls to this fraction or below

# Measured (the tuning record "auto" reads): the split against the unsplit op where the Hopper
# (Mosaic GPU) kernels run, one H100, JAX 0.11.2, bf16, pipelined ms, benchmarks/bench_seq_split.py
# (results/kernel_race_h100/NOTE.md). Speed-up = unsplit / split; below 1 the split loses.
# The model above picks P = 4 at both shapes (modelled 0.75 of the unsplit state-pass time); the
# Hopper state passes are fast enough that the maps pass and the rerun cost more than the idle SMs.
MEASURED_HOPPER = {
    # (B, T, H, D): {P: (fwd speed-up, fwd+bwd speed-up)}
    (1, 16384, 16, 128): {2: (0.73, 0.63), 4: (0.75, 0.55), 8: (0.65, 0.48)},
    (1, 32768, 16, 128): {2: (0.75, 0.62), 4: (0.80, 0.55), 8: (0.72, 0.50)},
}


def waves(ctas: int, sms: int) -> int:
    """Waves of ``ctas`` programs on ``sms`` SMs (one resident state-pass CTA per SM)."""
    return -(-ctas // sms)


def state_pass_cost(B: int, H: int, K: int, V: int, T: int, pieces: int, sms: int) -> float:
    """The model's state-pass time in units of one chunk step, for sequences of T tokens cut into
    ``pieces``: unsplit, ``waves(B H ceil(V / 64)) T``; split, the maps pass over the first P - 1
    pieces at width K + V plus the rerun of the P pieces, each a chain of T / P steps:
    ``(waves(B H (P - 1) ceil((K + V) / 64)) + waves(B H P ceil(V / 64))) T / P``."""
    if pieces == 1:
        return waves(B * H * math.ceil(V / BLOCK), sms) * T
    maps = waves(B * H * (pieces - 1) * math.ceil((K + V) / BLOCK), sms)
    rerun = waves(B * H * pieces * math.ceil(V / BLOCK), sms)
    return (maps + rerun) * T / pieces


def auto_pieces(B: int, H: int, K: int, V: int, T: int, chunk: int, sms: int = DEFAULT_SMS) -> int:
    """The piece count of ``seq_split="auto"`` (1: no split).

    Rule: the P of :data:`AUTO_PIECES` (pieces of at least :data:`AUTO_MIN_CHUNKS` chunks) that
    minimises :func:`state_pass_cost` (the smallest on ties), taken only where it cuts the cost to
    :data:`AUTO_GAIN` of the unsplit one or below. The cost counts chunk steps of the state passes'
    dependent chains times the waves of CTAs they need: a CTA count below the SM count leaves SMs
    idle, so cutting the chain by P is nearly free until the P-fold CTAs (and the maps pass's
    (P - 1) (K + V) / V-fold ones) fill the SMs. On 132 SMs, K = V = 128: B H = 16 (1 x 16384 x 16
    x 128; 32 CTAs of 64 columns) gives P = 4 (maps 192 CTAs = 2 waves, rerun 128 = 1 wave: cost
    0.75 T against T); B H = 128 (8 x 2048 x 16 x 128; 256 CTAs, two waves already) gives no split
    (P = 2 would need 4 + 4 waves of T / 2); B H = 64 (4 x 4096) no split (2T at P = 2 against T).
    P = 2 never helps on its own: it replaces one chain of T by two of T / 2 (maps, rerun).
    The model ignores the scan, the maps pass's extra WY / output work and the backward, whose
    passes split the same way (docs/kernels.md, "Sequence split"). Where the Hopper kernels run it
    was wrong at both measured shapes (:data:`MEASURED_HOPPER`), so :func:`decide` does not use it
    there; on the Triton / TPU kernels it is unmeasured."""
    base = state_pass_cost(B, H, K, V, T, 1, sms)
    best, best_cost = 1, base
    for p in AUTO_PIECES:
        if T < p * AUTO_MIN_CHUNKS * chunk:
            break
        c = state_pass_cost(B, H, K, V, T, p, sms)
        if c < best_cost:
            best, best_cost = p, c
    return best if best_cost <= AUTO_GAIN * base else 1


def sm_count(platform: str) -> int:
    """SMs of JAX's first device on platform "gpu" (``core_count``), else :data:`DEFAULT_SMS`."""
    if platform == "gpu":
        try:
            import jax

            n = getattr(jax.devices()[0], "core_count", None)
            if isinstance(n, int) and n > 0:
                return n
        except RuntimeError:
            pass
    return DEFAULT_SMS


def decide(seq_split, *, B: int, T: int, H: int, K: int, V: int, chunk: int, platform: str,
           beta_per_channel: bool = False, g_per_channel: bool = False,
           sms: Optional[int] = None, hopper: bool = False) -> Tuple[int, Optional[str]]:
    """``(pieces, reason)`` for a call: ``pieces`` 1 (no split) or the piece count; ``reason`` None
    where the split runs or was not asked for (``seq_split`` None), else why it does not run (a
    decline by name, or "auto" choosing 1). ``chunk``: the call's ``chunk_size`` (pieces are whole
    multiples of it); ``sms``: the SM count (None: :func:`sm_count` of ``platform``); ``hopper``:
    the Hopper (Mosaic GPU) kernels run the call -- there "auto" never splits, because every
    measured split lost (:data:`MEASURED_HOPPER`); an explicit piece count still splits."""
    if seq_split is None:
        return 1, None
    if beta_per_channel:
        return 1, "per-value-channel beta [B,T,H,V] (one state map per value column)"
    if g_per_channel:
        return 1, "per-key-channel g [B,T,H,K] (the Pallas kernels decline it)"
    if seq_split == "auto":
        if hopper:
            return 1, ("auto: the Hopper kernels run the call, and there every measured split was slower "
                       "than the unsplit op (split_plan.MEASURED_HOPPER: at best 0.80x forward, 0.63x "
                       "forward+backward); ask for a piece count to split anyway")
        sms = sm_count(platform) if sms is None else sms
        p = auto_pieces(B, H, K, V, T, chunk, sms)
        if p == 1:
            return 1, (f"auto: no piece count in {AUTO_PIECES} of >= {AUTO_MIN_CHUNKS} chunks cuts the state "
                       f"passes' modelled time to {AUTO_GAIN} (B*H={B * H}, V={V}, T={T}, {sms} SMs)")
        return p, None
    if T < seq_split * MIN_CHUNKS * chunk:
        return 1, (f"T={T} too short for {seq_split} pieces of >= {MIN_CHUNKS} chunks of {chunk} "
                   f"(needs T >= {seq_split * MIN_CHUNKS * chunk})")
    return int(seq_split), None


def piece_length(T: int, pieces: int, chunk: int) -> int:
    """Tokens per piece: ``ceil(T / pieces)`` rounded up to a multiple of ``chunk`` (the last piece
    is padded with tokens that leave the state unchanged)."""
    return -(-T // (pieces * chunk)) * chunk
