"""Dump ``str(jax.make_jaxpr(jax.value_and_grad(loss of the pallas op)))`` for every kernel path
(GPU Triton, the Hopper paths with ``gpu_kernels="mosaic"`` forced, TPU, CPU interpret), one file
per case, plus which kernels ran (``forward_kernels`` / ``backward_kernels``) in ``kernels.txt``:
run it on two trees and ``diff -r`` the folders to show that a change leaves the kernels unchanged.

Cases (tracing only, CPU, about a minute):

* B 1, T 200, H 2, K = V = 128, chunk 64; float32 and bf16; dense, packed ``cu_seqlens``, grouped
  value heads, unfused forward; platforms "gpu" (Triton), "gpu" with ``gpu_kernels="mosaic"``
  (the W/U form, the T form), "tpu", "interpret";
* the transition form (K = V = 64) and the wide backward (K = V = 256: "hopper" blocks,
  "hopper_xla", "triton") on "gpu" with ``gpu_kernels="mosaic"``, bf16;
* the five benchmark shapes of ``benchmarks/bench_pallas.py`` (bf16) on "gpu" (Triton default),
  "gpu" with ``gpu_kernels="mosaic"`` and "tpu";
* where the tree has it, the final-state-only entry (``gdn_jax.ops.gated_delta_rule.final_state``,
  the maps' pass of ``state_map``) at every case but the benchmark shapes: files ``*_finalonly.txt``
  (``value_and_grad`` of a loss of the final state), plus the gate-free path (bf16, unit keys).

With ``--values`` it also saves the interpret-mode outputs and gradients of a few small cases
(Triton semantics and Mosaic GPU's interpreter) in ``values.npz``, to compare bit for bit::

    PYTHONPATH=. python benchmarks/dump_gpu_jaxprs.py OUT_DIR [--values]
"""
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

from gdn_jax.ops import KernelConfig, gated_delta_rule

try:  # options named by their flat names (fwd_form=..., fuse_output=...) on either tree compared
    from gdn_jax.ops.pallas.config import from_flat_names as config_from_names
except ImportError:  # a tree from before KernelConfig's groups: its flat keywords
    config_from_names = KernelConfig
from gdn_jax.ops import pallas as P

try:  # the final-state-only entry, where the tree has one
    from gdn_jax.ops.gated_delta_rule import final_state
except ImportError:
    final_state = None

out = sys.argv[1]
values = "--values" in sys.argv[2:]
os.makedirs(out, exist_ok=True)
F32, BF16 = jnp.float32, jnp.bfloat16
BENCH = [(4, 4096, 16, 128), (8, 2048, 16, 128), (1, 16384, 16, 128), (2, 8192, 16, 64), (2, 8192, 8, 256)]
MOSAIC = {"gpu_kernels": "mosaic"}

cases = []  # (name, config kwargs, dtype, form, (B, T, H, K))
small = (1, 200, 2, 128)
for plat, extra in (("gpu", {}), ("gpu", MOSAIC), ("gpu", dict(MOSAIC, fwd_form="t")), ("tpu", {}),
                    ("interpret", {})):
    for dt in (F32, BF16):
        for form in ("plain", "packed", "gva", "unfused"):
            cases.append((plat, extra, dt, form, small))
cases.append(("gpu", dict(MOSAIC, fwd_form="transition"), BF16, "plain", (1, 200, 2, 64)))
cases.append(("gpu", dict(MOSAIC, fwd_form="transition"), BF16, "packed", (1, 200, 2, 64)))
for wide in (None, "hopper_xla", "triton"):
    extra = dict(MOSAIC, **({"wide_backward": wide} if wide else {}))
    cases.append(("gpu", extra, BF16, "plain", (1, 200, 2, 256)))
cases.append(("gpu", MOSAIC, BF16, "packed", (1, 200, 2, 256)))
for shape in BENCH:
    for plat, extra in (("gpu", {}), ("gpu", MOSAIC), ("tpu", {})):
        cases.append((plat, extra, BF16, "bench", shape))


def make(plat, extra, form):
    kw = dict(platform=plat, **extra)
    if form == "unfused":
        kw.update(fuse_output=False, merge_state=False)
    return config_from_names(**kw)


def inputs(dt, form, shape):
    B, T, H, K = shape
    V = K
    G = 2 if form == "gva" else 1
    cu = jnp.asarray([0, 50, 120, T], jnp.int32) if form == "packed" else None
    N = 3 if form == "packed" else B
    key = jax.random.split(jax.random.PRNGKey(0), 5)
    q = jax.random.normal(key[0], (B, T, H, K), F32).astype(dt)
    k = jax.random.normal(key[1], (B, T, H, K), F32).astype(dt)
    v = jax.random.normal(key[2], (B, T, H * G, V), F32).astype(dt)
    g = -jax.nn.softplus(jax.random.normal(key[3], (B, T, H * G), F32))
    b = jax.nn.sigmoid(jax.random.normal(key[4], (B, T, H * G), F32)).astype(dt)
    s = jnp.zeros((N, H * G, K, V), F32) + 0.01
    return (q, k, v, g, b, s), cu


def loss_fn(c, cu):
    def loss(q, k, v, g, b, s):
        o, S = gated_delta_rule(q, k, v, g, b, initial_state=s, output_final_state=True, backend="pallas",
                                chunk_size=64, cu_seqlens=cu, kernel_config=c, use_qk_l2norm=True)
        return jnp.sum(o.astype(F32) * jnp.cos(jnp.arange(o.shape[-1], dtype=F32))) + jnp.sum(S)
    return loss


def label(plat, extra, dt, form, shape):
    ex = "_" + "_".join(f"{a}-{b}" for a, b in extra.items()) if extra else ""
    sh = "" if shape == small else "_" + "x".join(map(str, shape))
    return f"{plat}{ex}_{jnp.dtype(dt).name}_{form}{sh}"


n = 0
report = []
for plat, extra, dt, form, shape in cases:
    c = make(plat, extra, form)
    name = label(plat, extra, dt, form, shape)
    args, cu = inputs(dt, form, shape) if form != "bench" else (
        tuple(jax.ShapeDtypeStruct(s, d) for s, d in (
            (shape, dt), (shape, dt), (shape, dt), (shape[:3], F32), (shape[:3], dt), ((shape[0], shape[2], shape[3], shape[3]), F32))),
        None)
    try:
        txt = str(jax.make_jaxpr(jax.value_and_grad(loss_fn(c, cu), argnums=(0, 1, 2, 3, 4, 5)))(*args))
    except Exception as e:
        txt = f"ERROR {type(e).__name__}: {e}"
    open(os.path.join(out, name + ".txt"), "w").write(txt)
    got = []
    try:  # traced, so that the benchmark shapes need no arrays
        jax.make_jaxpr(lambda q, k, v, g, b, s: got.extend(
            fn(q, k, v, g, b, chunk_size=64, cu_seqlens=cu, kernel_config=c)
            for fn in (P.forward_kernels, P.backward_kernels)) or 0)(*args)
        report.append(f"{name}: fwd {tuple(got[0])[:2]} bwd {tuple(got[1])[:2]}")
    except Exception as e:
        report.append(f"{name}: ERROR {type(e).__name__}: {e}")
    n += 1

def final_loss_fn(c, cu):
    def loss(q, k, v, g, b, s):
        S = final_state(q, k, v, g, b, initial_state=s, backend="pallas", chunk_size=64, cu_seqlens=cu, kernel_config=c,
                        use_qk_l2norm=True)
        return jnp.sum(S * jnp.cos(jnp.arange(S.shape[-1], dtype=F32)))
    return loss


if final_state is not None:
    finals = [c for c in cases if c[3] != "bench"]
    finals += [("gpu", {"gpu_kernels": "triton", "gatefree": True}, BF16, "plain", small),
               ("interpret", {"gatefree": True}, BF16, "packed", small)]
    for plat, extra, dt, form, shape in finals:
        name = label(plat, extra, dt, form, shape) + "_finalonly"
        args, cu = inputs(dt, form, shape)
        try:
            txt = str(jax.make_jaxpr(jax.value_and_grad(final_loss_fn(make(plat, extra, form), cu),
                                                        argnums=(0, 1, 2, 3, 4, 5)))(*args))
        except Exception as e:
            txt = f"ERROR {type(e).__name__}: {e}"
        open(os.path.join(out, name + ".txt"), "w").write(txt)
        n += 1
open(os.path.join(out, "kernels.txt"), "w").write("\n".join(report) + "\n")
print("dumped", n)

if values:
    res = {}
    for plat, extra, dt, form, shape in (("interpret", {}, F32, "plain", (1, 128, 2, 32)),
                                         ("interpret", {}, BF16, "packed", (1, 128, 2, 64)),
                                         ("interpret", {"fuse_output": False}, F32, "gva", (1, 128, 2, 32)),
                                         ("interpret", MOSAIC, BF16, "plain", (1, 128, 2, 64)),
                                         ("interpret", dict(MOSAIC, fwd_form="t"), BF16, "plain", (1, 128, 2, 64)),
                                         ("tpu_interpret", {}, F32, "plain", (1, 128, 2, 32))):
        c = make(plat, extra, form)
        args, cu = inputs(dt, form, shape)
        val, grads = jax.jit(jax.value_and_grad(loss_fn(c, cu), argnums=(0, 1, 2, 3, 4, 5)))(*args)
        name = label(plat, extra, dt, form, shape)
        res[name + "/loss"] = np.asarray(val)
        for i, x in enumerate(grads):
            res[f"{name}/d{i}"] = np.asarray(x.astype(F32))
        print("values", name, flush=True)
    np.savez(os.path.join(out, "values.npz"), **res)
