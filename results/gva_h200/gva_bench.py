"""GVA on one GPU: pallas with 16 key / 32 value heads vs 32 ungrouped heads (B4 T4096 D128 bf16)."""
import os, statistics, sys, time
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import jax, jax.numpy as jnp, numpy as np
from gdn_jax.ops import gated_delta_rule
B, T, H, D = 4, 4096, 32, 128
r = np.random.default_rng(0)
bf = jnp.bfloat16
def unit(s):
    a = r.standard_normal(s).astype(np.float32); return a / np.linalg.norm(a, axis=-1, keepdims=True)
v = jnp.asarray(r.standard_normal((B, T, H, D)), bf)
g = jnp.asarray((-np.logaddexp(0.0, -r.standard_normal((B, T, H)))).astype(np.float32) / 4)
b = jnp.asarray(1 / (1 + np.exp(-r.standard_normal((B, T, H)))), bf)
do = jnp.asarray(r.standard_normal((B, T, H, D)), bf)
qk = {hk: (jnp.asarray(r.standard_normal((B, T, hk, D)), bf), jnp.asarray(unit((B, T, hk, D)), bf)) for hk in (16, 32)}
def fns(hk, backend="pallas"):
    q, k = qk[hk]
    fwd = lambda q, k, v, g, b: gated_delta_rule(q, k, v, g, b, backend=backend)[0]
    loss = lambda q, k, v, g, b: jnp.sum(fwd(q, k, v, g, b).astype(jnp.float32) * do.astype(jnp.float32))
    f, fb = jax.jit(fwd), jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4)))
    return (lambda: f(q, k, v, g, b)), (lambda: fb(q, k, v, g, b))
def t(fn, reps=15):
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter(); jax.block_until_ready(fn()); ts.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(ts)
F = {hk: fns(hk) for hk in (16, 32)}
for hk in F:
    for fn in F[hk]:
        for _ in range(3): jax.block_until_ready(fn())
# numerics of the grouped call against the chunk backend (float32 inside)
fc, fbc = fns(16, "chunk")
o_p, o_c = F[16][0](), fc()
(_, gp), (_, gc) = F[16][1](), fbc()
rel = lambda a, c: float(jnp.sqrt(jnp.mean((a.astype(jnp.float32) - c.astype(jnp.float32)) ** 2) / jnp.mean(c.astype(jnp.float32) ** 2)))
print("GVA pallas vs chunk rel_rms: o %.1e" % rel(o_p, o_c), " ".join(f"d{n} {rel(a, c):.1e}" for n, a, c in zip("qkvgb", gp, gc)), flush=True)
res = {hk: ([], []) for hk in F}
for rnd in range(6):
    for hk in ((16, 32) if rnd % 2 == 0 else (32, 16)):
        res[hk][0].append(t(F[hk][0])); res[hk][1].append(t(F[hk][1]))
m = {hk: (statistics.median(res[hk][0]), statistics.median(res[hk][1])) for hk in F}
print(f"\nB{B} T{T} D{D} bf16, 32 value heads      fwd ms   fwd+bwd ms")
print(f"16 key heads (GVA group 2)       {m[16][0]:8.3f}   {m[16][1]:8.3f}")
print(f"32 key heads (no grouping)       {m[32][0]:8.3f}   {m[32][1]:8.3f}")
print(f"GVA / ungrouped                  {m[16][0] / m[32][0]:8.3f}   {m[16][1] / m[32][1]:8.3f}")
