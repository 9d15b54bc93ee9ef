"""Cost of the Pallas kernels' partitioning wrapper (``gdn_jax/ops/pallas/partition.py``).

Times ``gated_delta_rule(..., backend="pallas")`` forward and forward+backward (jitted, bf16, the
inputs of ``bench_pallas.py``) with the wrapper on (the library as it is) and off (the kernels
called directly, as before the wrapper existed), alternating on / off ``--rounds`` times in one
process, and reports the medians. In a process with one device the library runs the kernels
unwrapped (``partition.run_sharded``), so both programs are the same there; what one GPU can show
is the op's time against a tree from before the wrapper (``bench_pallas.py`` on both trees in one
call): the wrapper came with a change of the glue around the kernels (batch and heads kept apart in
``vjp.to_kernel_inputs``). On a host with several devices the wrapper is active and inlined when a
one-device program is lowered: the times should agree to noise and the outputs bit for bit (checked). ``--mesh-devices N`` also times the same calls with the batch split over N devices
(``NamedSharding(mesh, P("data"))``): on, each device runs its own rows; off, the kernels'
operands are gathered and every device runs the whole batch (the all-gathers are counted in the
compiled HLO).

Usage:  python benchmarks/bench_sharding_wrapper.py [--shapes 0,1,2,3,4 | BxTxHxD,...] [--reps 25]
        [--rounds 3] [--mesh-devices N]
Default: the five benchmark shapes of ``bench_pallas.py`` on a GPU, two tiny ones in interpret
mode on a CPU (a smoke test).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_pallas as bp  # noqa: E402  (sets the memory fraction before jax starts)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

from gdn_jax.ops import gated_delta_rule  # noqa: E402
from gdn_jax.ops.pallas import partition  # noqa: E402

WRAPPED = partition.run_sharded


def _unwrapped(fn, static, args, *_, **__):
    """The kernels called directly: what the op did before the partitioning wrapper."""
    return tuple(fn(static, *args))


def fns(x, chunk, wrapper: bool, sharding=None):
    """(fwd, fwd+bwd) closures, jitted and traced with the wrapper on or off."""
    partition.run_sharded = WRAPPED if wrapper else _unwrapped
    try:
        def fwd(q, k, v, g, beta):
            return gated_delta_rule(q, k, v, g, beta, backend="pallas", chunk_size=chunk)[0]

        def loss(q, k, v, g, beta, do):
            return jnp.sum(fwd(q, k, v, g, beta).astype(jnp.float32) * do.astype(jnp.float32))

        a = [x[n] for n in ("q", "k", "v", "g", "beta", "do")]
        if sharding is not None:
            a = [jax.device_put(t, sharding) for t in a]
        f, fb = jax.jit(fwd), jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4)))
        gathers = fb.lower(*a).compile().as_text().count("all-gather(")
        out = (f(*a[:5]), fb(*a))  # traced (and compiled) here, with this wrapper setting
        return (lambda: f(*a[:5])), (lambda: fb(*a)), out, gathers
    finally:
        partition.run_sharded = WRAPPED


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="", help="indices into bench_pallas's shapes or BxTxHxD, comma-separated")
    ap.add_argument("--reps", type=int, default=25)
    ap.add_argument("--rounds", type=int, default=3, help="on / off alternations (medians over the rounds)")
    ap.add_argument("--chunk", type=int, default=64)
    ap.add_argument("--mesh-devices", type=int, default=0, help="also time with the batch split over this many devices")
    args = ap.parse_args(argv)
    on_gpu = jax.default_backend() == "gpu"
    shapes = bp.parse_shapes(args.shapes, on_gpu)
    reps = args.reps if on_gpu else min(args.reps, 3)
    bp.log(f"jax {jax.__version__}, {jax.devices()[0].device_kind} x {jax.device_count()}, shapes {shapes}, "
           f"reps {reps}, rounds {args.rounds}")
    placements = [("1 device", None)]
    nd = args.mesh_devices
    if nd > 1:
        if nd > jax.device_count():
            raise SystemExit(f"--mesh-devices {nd}: only {jax.device_count()} devices")
        mesh = Mesh(np.array(jax.devices()[:nd]), ("data",))
        placements.append((f"batch over {nd}", NamedSharding(mesh, P("data"))))
    rows = []
    for shape in shapes:
        x = bp.make_inputs(shape)
        for where, sh in placements:
            if sh is not None and shape[0] % nd:
                bp.log(f"{shape} {where}: B not divisible, skipped")
                continue
            built = {w: fns(x, args.chunk, w, sh) for w in (True, False)}
            if sh is None:  # one device: the same program, the same bits
                for a, b in zip(jax.tree.leaves(built[True][2]), jax.tree.leaves(built[False][2])):
                    assert np.array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32)), shape
            ms = {(w, d): [] for w in (True, False) for d in (0, 1)}
            for _ in range(args.rounds):
                for w in (True, False):
                    for d in (0, 1):
                        ms[(w, d)].append(bp.time_fn(built[w][d], reps))
            med = {k: statistics.median(v) for k, v in ms.items()}
            rows.append((shape, where, med, built[True][3], built[False][3]))
            bp.log(f"{shape} {where}: fwd on {med[(True, 0)]:.3f} off {med[(False, 0)]:.3f} ms, fwd+bwd on "
                   f"{med[(True, 1)]:.3f} off {med[(False, 1)]:.3f} ms, all-gathers on {built[True][3]} "
                   f"off {built[False][3]}")
    bp.log("\nshape               placement        fwd on   fwd off  ratio | f+b on   f+b off  ratio | gathers on/off")
    for shape, where, med, g_on, g_off in rows:
        bp.log(f"{'x'.join(map(str, shape)):19s} {where:15s} {med[(True, 0)]:8.3f} {med[(False, 0)]:8.3f} "
               f"{med[(True, 0)] / med[(False, 0)]:6.3f} | {med[(True, 1)]:8.3f} {med[(False, 1)]:8.3f} "
               f"{med[(True, 1)] / med[(False, 1)]:6.3f} | {g_on}/{g_off}")


if __name__ == "__main__":
    main()
