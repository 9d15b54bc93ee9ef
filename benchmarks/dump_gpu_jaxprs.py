"""Dump ``str(jax.make_jaxpr(jax.value_and_grad(loss of the pallas op)))`` for the GPU and CPU
interpret code paths, one file per case, to show that a change to the TPU kernels leaves them
unchanged: run it on two trees and ``diff -r`` the folders.

Cases: platform "gpu" (Triton), "gpu" with ``gpu_kernels="mosaic"`` (and ``fwd_form="t"``), and
"interpret"; float32 and bf16; dense, packed ``cu_seqlens``, grouped value heads, unfused forward
(B 1, T 200, H 2, K = V = 128, chunk 64). Tracing only (CPU, seconds)::

    PYTHONPATH=. python benchmarks/dump_gpu_jaxprs.py OUT_DIR
"""
import os
import sys

import jax
import jax.numpy as jnp
from gdn_jax.ops import KernelConfig, gated_delta_rule

out = sys.argv[1]
os.makedirs(out, exist_ok=True)
F32, BF16 = jnp.float32, jnp.bfloat16
cases = []
for plat, extra in (("gpu", {}), ("gpu", {"gpu_kernels": "mosaic"}), ("gpu", {"gpu_kernels": "mosaic", "fwd_form": "t"}), ("interpret", {})):
    for dt in (F32, BF16):
        for form in ("plain", "packed", "gva", "unfused"):
            cases.append((plat, extra, dt, form))

def cfg(plat, extra, form):
    kw = dict(platform=plat, **extra)
    if form == "unfused":
        kw.update(fuse_output=False, merge_state=False)
    try:
        return KernelConfig(**kw)
    except TypeError as e:
        return None

n = 0
for plat, extra, dt, form in cases:
    c = cfg(plat, extra, form)
    if c is None:
        continue
    B, T, H, K, V = 1, 200, 2, 128, 128
    G = 2 if form == "gva" else 1
    cu = jnp.asarray([0, 50, 120, 200], jnp.int32) if form == "packed" else None
    N = 3 if form == "packed" else B
    q = jnp.ones((B, T, H, K), dt); k = q; v = jnp.ones((B, T, H * G, V), dt)
    g = -jnp.ones((B, T, H * G), F32); b = jnp.ones((B, T, H * G), dt) * 0.5
    s = jnp.zeros((N, H * G, K, V), F32)
    def loss(q, k, v, g, b, s):
        o, S = gated_delta_rule(q, k, v, g, b, initial_state=s, output_final_state=True, backend="pallas",
                                chunk_size=64, cu_seqlens=cu, kernel_config=c)
        return jnp.sum(o.astype(F32)) + jnp.sum(S)
    name = f"{plat}{'_'+'_'.join(f'{a}-{b}' for a, b in extra.items()) if extra else ''}_{jnp.dtype(dt).name}_{form}.txt"
    try:
        txt = str(jax.make_jaxpr(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4, 5)))(q, k, v, g, b, s))
    except Exception as e:
        txt = f"ERROR {type(e).__name__}: {e}"
    open(os.path.join(out, name), "w").write(txt)
    n += 1
print("dumped", n)
