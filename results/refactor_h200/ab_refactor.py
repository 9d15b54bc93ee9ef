"""Interleaved A/B on one GPU: the pallas backend at commit 67e6ea5 (gdn_base) vs the refactor (gdn_jax)."""
import importlib, os, statistics, sys, time
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import jax, jax.numpy as jnp, numpy as np
new = importlib.import_module("gdn_jax.ops.gated_delta_rule").gated_delta_rule
old = importlib.import_module("gdn_base.ops.gated_delta_rule").gated_delta_rule
SHAPES = [(4, 4096, 16, 128), (8, 2048, 16, 128), (1, 16384, 16, 128), (2, 8192, 16, 64), (2, 8192, 8, 256)]
def inputs(shape):
    B, T, H, D = shape
    r = np.random.default_rng(0)
    q = r.standard_normal((B, T, H, D), np.float32); k = r.standard_normal((B, T, H, D), np.float32)
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    v = r.standard_normal((B, T, H, D), np.float32)
    g = (-np.logaddexp(0.0, -r.standard_normal((B, T, H)))).astype(np.float32) / 4
    b = (1 / (1 + np.exp(-r.standard_normal((B, T, H))))).astype(np.float32)
    do = r.standard_normal((B, T, H, D), np.float32)
    bf = jnp.bfloat16
    return [jnp.asarray(q, bf), jnp.asarray(k, bf), jnp.asarray(v, bf), jnp.asarray(g), jnp.asarray(b, bf)], jnp.asarray(do, bf)
def fns(op, a, do):
    fwd = lambda q, k, v, g, b: op(q, k, v, g, b, backend="pallas", chunk_size=64)[0]
    loss = lambda q, k, v, g, b, do: jnp.sum(fwd(q, k, v, g, b).astype(jnp.float32) * do.astype(jnp.float32))
    f, fb = jax.jit(fwd), jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4)))
    return (lambda: f(*a)), (lambda: fb(*a, do))
def t(fn, reps):
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter(); jax.block_until_ready(fn()); ts.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(ts)
print(jax.__version__, jax.devices())
rows = []
for shape in SHAPES:
    a, do = inputs(shape)
    F = {"old": fns(old, a, do), "new": fns(new, a, do)}
    for n in F:
        for fn in F[n]:
            for _ in range(3): jax.block_until_ready(fn())
    o_old, o_new = F["old"][0](), F["new"][0]()
    same = bool(jnp.all(o_old == o_new))
    res = {n: ([], []) for n in F}
    for rnd in range(6):
        order = ("old", "new") if rnd % 2 == 0 else ("new", "old")
        for n in order:
            res[n][0].append(t(F[n][0], 15)); res[n][1].append(t(F[n][1], 15))
    m = {n: (statistics.median(res[n][0]), statistics.median(res[n][1])) for n in F}
    rows.append((shape, m, same))
    print(shape, "o bitwise equal:", same, {n: [f"{x:.3f}" for x in m[n]] for n in m}, flush=True)
print("\nshape             old fwd / f+b ms     new fwd / f+b ms     new/old fwd   new/old f+b   o equal")
for shape, m, same in rows:
    print(f"{'x'.join(map(str, shape)):<17} {m['old'][0]:7.3f} / {m['old'][1]:7.3f}   {m['new'][0]:7.3f} / {m['new'][1]:7.3f}   "
          f"{m['new'][0] / m['old'][0]:11.3f}   {m['new'][1] / m['old'][1]:11.3f}   {same}")
