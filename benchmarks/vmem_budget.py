"""VMEM budget of every TPU Pallas kernel of ``backend="pallas"``, read from the kernels as traced.

Traces (``jax.make_jaxpr``, CPU, nothing runs) ``jax.value_and_grad`` of the op with
``KernelConfig(platform="tpu")`` (and the unfused forward, ``fuse_output=False``) and reads each
``pallas_call`` equation's ``grid_mapping``: the grid, every block (block shape, dtype, memory
space) and the scratch buffers. Per kernel:

* pipelined VMEM blocks, each padded to the TPU tile (last dim to 128 lanes, second-to-last to
  8 sublanes x 32 / dtype bits) and counted twice (the pipeline double-buffers every block);
* VMEM scratch (the state passes' carried state), counted once;
* SMEM blocks apart (the packed-sequence flags), unpadded;
* arrays left in HBM (memory space ANY: the packed path's per-sequence states, copied by window
  into the scratch) are listed but take no VMEM.

Packed rows (``cu_seqlens``, 4 sequences) trace the same tokens as one row: B = 1, T = B * T.

Not counted: the compiler's own temporaries for in-kernel values (of size C x C, C x K and K x bv
per chunk, independent of T). The default scoped VMEM limit is 16 MiB on v5e and 32 MiB on v6e;
``vmem_limit_bytes`` is what the kernel asks for (None: the default, not raised).

Usage::

    python benchmarks/vmem_budget.py [--out results/tpu_vmem_cpu]
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from gdn_jax.ops import KernelConfig, TritonTuning, gated_delta_rule  # noqa: E402

# (B, T, H, D): the five benchmark shapes and T = 128K
SHAPES = [(4, 4096, 16, 128), (8, 2048, 16, 128), (1, 16384, 16, 128), (2, 8192, 16, 64), (2, 8192, 8, 256),
          (1, 131072, 16, 128)]
DEFAULT_SCOPED = {"v5e": 16 * 2**20, "v6e": 32 * 2**20}


def _pallas_eqns(jaxpr):
    for e in jaxpr.eqns:
        if e.primitive.name == "pallas_call":
            yield e
        for p in e.params.values():
            for sub in (p if isinstance(p, (list, tuple)) else [p]):
                if hasattr(sub, "jaxpr") and hasattr(sub.jaxpr, "eqns"):
                    yield from _pallas_eqns(sub.jaxpr)
                elif hasattr(sub, "eqns"):
                    yield from _pallas_eqns(sub)


def _padded_bytes(shape, dtype) -> int:
    """Bytes of a VMEM buffer of ``shape`` in the TPU tiled layout."""
    item = jnp.dtype(dtype).itemsize
    shape = [1] * max(0, 2 - len(shape)) + [int(d) for d in shape]
    shape[-1] = -(-shape[-1] // 128) * 128
    sub = 8 * max(1, 4 // item)
    shape[-2] = -(-shape[-2] // sub) * sub
    n = 1
    for d in shape:
        n *= d
    return n * item


def _space(aval) -> str:
    """"smem", "hbm" (memory space ANY / HBM: not brought into VMEM; the kernel copies windows of
    it by DMA into its scratch) or "vmem"."""
    s = str(getattr(aval, "memory_space", None)).lower()
    return "smem" if "smem" in s else "hbm" if ("any" in s or "hbm" in s) else "vmem"


def kernel_budgets(B, T, H, K, V, *, dtype=jnp.bfloat16, chunk_size=64, packed=False):
    """{kernel name: budget dict} of the TPU kernels of one call's forward and backward.

    Each budget: ``grid``, ``blocks`` [(origin, block shape, dtype, space)], ``scratch`` [(shape,
    dtype)], ``vmem_bytes`` (2 x padded blocks + scratch), ``smem_bytes``, ``vmem_limit_bytes``."""
    f32 = jnp.float32
    N = 4 if packed else B
    cu = jnp.linspace(0, T, N + 1).astype(jnp.int32) if packed else None
    sds = [jax.ShapeDtypeStruct(s, d) for s, d in (
        ((B, T, H, K), dtype), ((B, T, H, K), dtype), ((B, T, H, V), dtype), ((B, T, H), f32), ((B, T, H), dtype),
        ((N, H, K, V), f32))]
    out = {}
    for cfg in (KernelConfig(platform="tpu"), KernelConfig(platform="tpu", triton=TritonTuning(fuse_output=False))):
        def loss(q, k, v, g, b, s, cfg=cfg):
            o, S = gated_delta_rule(q, k, v, g, b, initial_state=s, output_final_state=True, backend="pallas",
                                    chunk_size=chunk_size, cu_seqlens=cu, kernel_config=cfg)
            return jnp.sum(o.astype(f32)) + jnp.sum(S)

        jx = jax.make_jaxpr(jax.value_and_grad(loss, argnums=tuple(range(6))))(*sds)
        for e in _pallas_eqns(jx.jaxpr):
            name = str(e.params.get("name") or e.params.get("name_and_src_info"))
            if name in out:
                continue
            gm = e.params["grid_mapping"]
            blocks, vmem, smem = [], 0, 0
            for bm in gm.block_mappings:
                shape = tuple(int(d) for d in bm.block_aval.shape)
                dt = jnp.dtype(bm.block_aval.dtype)
                space = _space(bm.block_aval)
                blocks.append((str(bm.origin), shape, dt.name, space))
                if space == "hbm":
                    continue
                if space == "smem":  # scalars: unpadded, double-buffered
                    n = 1
                    for d in shape:
                        n *= d
                    smem += 2 * n * dt.itemsize
                else:
                    vmem += 2 * _padded_bytes(shape, dt)
            scratch = []
            for a in gm.scratch_avals:
                if "sem" in str(a).lower():  # DMA semaphores
                    continue
                shape = tuple(int(d) for d in a.shape)
                scratch.append((shape, jnp.dtype(a.dtype).name))
                vmem += _padded_bytes(shape, a.dtype)
            cp = e.params.get("compiler_params")
            cp = cp.get("mosaic_tpu", cp) if isinstance(cp, dict) else cp
            out[name] = dict(grid=tuple(int(g) for g in gm.grid), blocks=blocks, scratch=scratch, vmem_bytes=vmem,
                             smem_bytes=smem,
                             dimension_semantics=tuple(getattr(cp, "dimension_semantics", None) or ()),
                             vmem_limit_bytes=getattr(cp, "vmem_limit_bytes", None))
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="folder for budget.json and budget.txt")
    args = ap.parse_args(argv)
    rows, lines = [], []
    for B, T, H, D in SHAPES:
        for packed in (False, True):
            if packed:
                B, T = 1, B * T
            budgets = kernel_budgets(B, T, H, D, D, packed=packed)
            for name, b in budgets.items():
                rows.append(dict(B=B, T=T, H=H, D=D, packed=packed, kernel=name, **b))
                fits = ", ".join(f"{chip} {'ok' if b['vmem_bytes'] <= lim else 'OVER'}"
                                 for chip, lim in DEFAULT_SCOPED.items())
                line = (f"B{B} T{T} H{H} D{D}{' packed' if packed else ''}  {name:22s} grid={b['grid']}  "
                        f"VMEM {b['vmem_bytes'] / 2**20:6.2f} MiB  SMEM {b['smem_bytes']} B  "
                        f"limit={b['vmem_limit_bytes']}  [{fits}]")
                lines.append(line)
                print(line, flush=True)
    worst = max(r["vmem_bytes"] for r in rows)
    summary = (f"largest kernel VMEM budget: {worst / 2**20:.2f} MiB over {len(rows)} (shape, kernel) rows; "
               f"default scoped VMEM: v5e 16 MiB, v6e 32 MiB; kernels asking for a raise: "
               f"{sorted({r['kernel'] for r in rows if r['vmem_limit_bytes']})}")
    print(summary)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "budget.json"), "w") as f:
            json.dump(dict(jax_version=jax.__version__, rows=rows, summary=summary), f, indent=1)
        with open(os.path.join(args.out, "budget.txt"), "w") as f:
            f.write("\n".join(lines + [summary]) + "\n")


if __name__ == "__main__":
    main()
