"""Context parallelism against the unsharded op: a script run in its own process (it sets the
number of simulated CPU devices before JAX starts), used by tests/ops/test_context_parallel.py
and experiments/context_parallel_grid.py.

    python tests/ops/cp_check.py --devices 4 --cases '[{"backend": "chunk", "packed": true}]'

prints one JSON line per case: the case and, for o, the final state and the gradient of every
input, max |sharded - unsharded| / max |unsharded| (the gradients also per shard of T).
"""
import argparse
import json
import os
import sys
import time

DEFAULT = dict(op="gdn", backend="chunk", B=1, T=32, Hk=2, H=2, K=16, V=16, g_pc=False, packed=False, init=True,
               chunk=16, dtype="float32", l2norm=False, seed=0, platform=None)
# documents crossing the shard boundaries of 2, 4 and 8 shards of T = 32, one empty, one starting on a boundary
PACKED_CU = [0, 5, 5, 14, 19, 24, 27, 32]


def _setup(devices: int, x64: bool):
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f]
    os.environ["XLA_FLAGS"] = " ".join(flags + [f"--xla_force_host_platform_device_count={devices}"])
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax

    if x64:
        jax.config.update("jax_enable_x64", True)
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    if repo not in sys.path:
        sys.path.insert(0, repo)
    jax.config.update("jax_compilation_cache_dir", os.path.join(repo, ".jax_cache", "cp"))


def run_case(case: dict, devices: int) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh

    from jax.sharding import PartitionSpec as P

    from gdn_jax.ops import gated_delta_rule, gated_linear_attention
    from gdn_jax.ops.context_parallel import context_parallel_linear_attention, shard_gated_delta_rule

    c = dict(DEFAULT, **case)
    dt = jnp.dtype(c["dtype"])
    rng = np.random.default_rng(c["seed"])
    B, T, Hk, H, K, V = (c[n] for n in ("B", "T", "Hk", "H", "K", "V"))
    cu = jnp.asarray(PACKED_CU, jnp.int32) if c["packed"] else None
    if c["packed"]:
        assert B == 1 and T == PACKED_CU[-1]
    n0 = len(PACKED_CU) - 1 if c["packed"] else B
    r = lambda *s: jnp.asarray(rng.standard_normal(s), dt)
    q, k, v = r(B, T, Hk, K), r(B, T, Hk, K), r(B, T, H, V)
    if not c["l2norm"]:
        k = k / jnp.linalg.norm(k, axis=-1, keepdims=True)
    g = -jnp.asarray(rng.uniform(0.01, 0.5, (B, T, H) + ((K,) if c["g_pc"] else ())), dt)
    beta = jnp.asarray(rng.uniform(0.1, 0.95, (B, T, H)), dt)
    s0 = r(n0, H, K, V) if c["init"] else None
    wo, wf = r(B, T, H, V), r(n0, H, K, V)
    kw = dict(output_final_state=True, backend=c["backend"], chunk_size=c["chunk"], cu_seqlens=cu,
              use_qk_l2norm=c["l2norm"])
    if c["platform"]:  # the Pallas kernels of another platform, e.g. "tpu_interpret" (TPU semantics on the CPU)
        from gdn_jax.ops import KernelConfig

        kw["kernel_config"] = KernelConfig(platform=c["platform"])
    mesh = Mesh(np.array(jax.devices()[:devices]), ("seq",))

    def loss(fn):
        def f(q, k, v, g, beta, s0):
            o, fin = fn(q, k, v, g, beta, s0)
            return jnp.sum(o * wo) + jnp.sum(fin * wf), (o, fin)
        return jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2, 3, 4, 5) if c["init"] else (0, 1, 2, 3, 4),
                                          has_aux=True))

    if c["op"] == "la":  # gated_linear_attention: g per head (mamba2), per key channel (gla) or none
        kw.pop("cu_seqlens")
        gate = (lambda g: None) if c.get("no_decay") else (lambda g: g)
        ref = loss(lambda q, k, v, g, b, s: gated_linear_attention(q, k, v, gate(g), initial_state=s, cu_seqlens=cu,
                                                                   **kw))
        seq, st = P(None, "seq"), P()

        def sharded(q, k, v, g, b, s):
            body = lambda q, k, v, g, s, cu: context_parallel_linear_attention(
                q, k, v, gate(g), axis_name="seq", initial_state=s, cu_seqlens=cu, **kw)
            return jax.shard_map(body, mesh=mesh, in_specs=(seq,) * 4 + (st if s is not None else None,
                                                                         P() if cu is not None else None),
                                 out_specs=(seq, st))(q, k, v, g, s, cu)
        cp = loss(sharded)
    else:
        ref = loss(lambda q, k, v, g, b, s: gated_delta_rule(q, k, v, g, b, initial_state=s, **kw))
        cp = loss(lambda q, k, v, g, b, s: shard_gated_delta_rule(q, k, v, g, b, mesh=mesh, axis="seq",
                                                                  initial_state=s, **kw))
    t0 = time.perf_counter()
    (_, (o0, f0)), g0 = ref(q, k, v, g, beta, s0)
    (_, (o1, f1)), g1 = cp(q, k, v, g, beta, s0)
    jax.block_until_ready(g1)
    rel = lambda a, b: float(jnp.max(jnp.abs(a - b)) / jnp.maximum(jnp.max(jnp.abs(a)), 1e-30))
    out = dict(case=c, devices=devices, o=rel(o0, o1), final=rel(f0, f1))
    names = ["dq", "dk", "dv", "dg", "dbeta", "ds0"]
    Ts = T // devices
    for name, a, b in zip(names, g0, g1):
        if c["op"] == "la" and name in ("dbeta",) + (("dg",) if c.get("no_decay") else ()):
            continue  # not an input of that op
        out[name] = rel(a, b)
        if name != "ds0":  # every shard's gradient (FLA #1115: wrong gradients on non-last shards)
            out[name + "_per_shard"] = [float(jnp.max(jnp.abs(a[:, i * Ts:(i + 1) * Ts] - b[:, i * Ts:(i + 1) * Ts]))
                                              / jnp.maximum(jnp.max(jnp.abs(a)), 1e-30)) for i in range(devices)]
            out[name + "_shard_norms"] = [float(jnp.max(jnp.abs(a[:, i * Ts:(i + 1) * Ts]))) for i in range(devices)]
    out["seconds"] = round(time.perf_counter() - t0, 2)
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--devices", type=int, required=True)
    p.add_argument("--cases", required=True, help="JSON list of case dicts (keys of DEFAULT)")
    p.add_argument("--x64", action="store_true")
    a = p.parse_args(argv)
    _setup(a.devices, a.x64)
    for case in json.loads(a.cases):
        print(json.dumps(run_case(case, a.devices)), flush=True)


if __name__ == "__main__":
    main()
