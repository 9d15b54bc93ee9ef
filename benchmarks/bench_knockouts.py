"""Knockouts of a Hopper (Mosaic GPU) kernel: the kernel's source with parts removed or simplified
(text edits of ``hopper/wy.py``, ``hopper/state_fwd.py`` / ``hopper/grads.py``, exec'd as a sibling module), each variant timed
alone on real inputs (pipelined device ms) and its outputs compared with the unmodified kernel's
(RMS relative). What a kernel spends its time on, without a profiler: e.g. the forward WY's
inverse rounds, its W / U products, the bf16x3 terms of its products, or the gradient kernel's T
phase. A knocked-out variant computes wrong values on purpose (its error column says how wrong);
only its time is the measurement. GPU (sm_90); ``--interpret`` runs tiny shapes in Mosaic GPU's
interpret mode on CPU (a smoke test: the edits still apply to today's kernel source).

    python benchmarks/bench_knockouts.py --kernel wy      # forward WY + T, 4x4096x16x128
    python benchmarks/bench_knockouts.py --kernel grads   # the two-warpgroup gradient kernel
    python benchmarks/bench_knockouts.py --kernel state --shape 1x16384x16x128   # forward state pass
    python benchmarks/bench_knockouts.py --kernel wy --interpret

Used for results/hopper_h200/ (the WY knockouts).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import types

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

# (old, new) text edits per variant; an edit whose old text occurs twice applies to the last
# occurrence (the two-warpgroup gradient kernel comes after the one-warpgroup kernel)
WY_EDITS = {
    "base": [],
    "no inverse rounds": [("        if blocked:  # the rounds inside", "        if False:  # the rounds inside"),
                          ("        while (1 << lg) < C:", "        while False:")],
    "no W / U": [("        if compact:  # W leaves through", "        if True:\n            pass\n        elif compact:  # W leaves through"),
                 ("        else:\n            write_w_u(tw, tu, k_s, v_s, q_s,", "        elif False:\n            write_w_u(tw, tu, k_s, v_s, q_s,")],
    "W / U with T hi only": [("                (Xm,) = mmas([((C, min(128, N)), pair, (xc, xc))], interp)",
                              "                (Xm,) = mmas([((C, min(128, N)), pair[0], xc)], interp)")],
}
WY_EDITS["no rounds, no W / U"] = WY_EDITS["no inverse rounds"] + WY_EDITS["no W / U"]

GRAD_EDITS = {
    "base": [],
    # (the default grad_t_phase="direct": the T phase in warpgroup 1; x_hi / x_lo then go unwritten)
    "no T phase": [("                m = _t_phase(C, k_s, vn_s, dvn_s, th_s, tl_s, None, x_lo, x_hi, beta_r, masks,\n"
                    "                             lambda mask: gamma(mask, gam_r[0]), interp, hp=call.grad_precision == \"bf16x3\",\n"
                    "                             direct=True, y=y, V=V)",
                    "                m = jnp.zeros((C, C), F32) if interp else plgpu.layout_cast(jnp.zeros((C, C), F32), WG)")],
    # T^T dVn also feeds the direct dA and dX = -(T^T dVn) S^T (hopper.grads._dx)
    "T^T dVn (so dX, dA) with T hi only": [
        ("dkd, dvb = mmas([((C, K), vn_s, Transposed(dh_s)), ((C, V), (Transposed(th_s), Transposed(tl_s)), (dvn_s, dvn_s))], interp)",
         "dkd, dvb = mmas([((C, K), vn_s, Transposed(dh_s)), ((C, V), (Transposed(th_s),), (dvn_s,))], interp)")],
}
# the two-warpgroup kernel's HBM traffic: its tile loads (and their waits) or its result stores
# removed -- one chunk per CTA, one CTA per SM, so a chunk's loads do not overlap its compute
_G_NO_LOADS = [("            for i in which:\n                plgpu.copy_gmem_to_smem(srcs[i], dsts[i], bars.at[i])",
                "            for i in ():\n                plgpu.copy_gmem_to_smem(srcs[i], dsts[i], bars.at[i])"),
               ("                    plgpu.barrier_wait(bars.at[i])\n                    waited.add(i)",
                "                    waited.add(i)")]
_G_NO_STORES = [("            plgpu.copy_smem_to_gmem(q_s, dq_ref.at[b, rows, hh])", "            pass"),
                ("            plgpu.copy_smem_to_gmem(k_s, dk_ref.at[b, rows, hh])\n"
                 "            plgpu.copy_smem_to_gmem(sc_s, sc_ref.at[bh, c])", "            pass"),
                ("            plgpu.copy_smem_to_gmem(v_s, dv_ref.at[b, rows, hh])", "            pass")]
GRAD_EDITS.update({"no tile loads (garbage in)": _G_NO_LOADS, "no result stores": _G_NO_STORES,
                   "no loads, no stores (compute only)": _G_NO_LOADS + _G_NO_STORES})

# the forward state pass ("wu" form, K <= 128), one chunk step = S -> s_s -> W S, Q S -> Vn -> vn_s,
# vs_s -> Aqk Vn, K^T vs -> S': which part of the ~2 us per step is the chain, which the rest
_NO_OUT = [("                ws, qs = mmas([((C, bv), x_s, s_s), ((C, bv), q_s if one_q else q_s.at[slot], s_s)],\n"
            "                               interp, between=prev)",
            "                (ws,) = mmas([((C, bv), x_s, s_s)], interp, between=prev)\n                qs = ws"),
           ("            o, S = mmas([(o0, a_s.at[slot], vn_s), (S * g_end, Transposed(k_s.at[slot]), vs_s)], interp)",
            "            (S,) = mmas([(S * g_end, Transposed(k_s.at[slot]), vs_s)], interp)\n            o = o0")]
_NO_O_STORE = [("            tile_out(o, o_s, o_ref.at[b, pl.ds(j * C, C), h, vsl])",
                "            plgpu.wait_smem_to_gmem(0, wait_read_only=True)")]  # the store's wait stays
_NO_WAIT = [("            wait_slot(slot)\n            if one_q:", "            if one_q:")]
_NO_FETCH = [("            if fetch is not None:\n                pl.when(i + 1 < n)(lambda: fetch(i + 1, 1 - slot))\n",
              "")] + _NO_WAIT
STATE_EDITS = {
    "base": [],
    "no o store": _NO_O_STORE,
    "no Q S, Aqk Vn (chain + store)": _NO_OUT,
    "S chain only (no Q S, Aqk Vn, o)": _NO_OUT + _NO_O_STORE,
    "no loads after the first": _NO_FETCH,
    "S chain only, no loads": _NO_OUT + _NO_O_STORE + _NO_FETCH,
    "no S store (W S reads stale)": [("            s_s[...] = S.astype(BF16)\n            plgpu.commit_smem()\n"
                                      "            if keep:\n                plgpu.copy_smem_to_gmem(s_s, h_ref",
                                      "            if keep:\n                plgpu.copy_smem_to_gmem(s_s, h_ref")],
    "no Vn stores (stale vn_s, vs_s)": [("            if vn_s is not None:\n                vn_s[...] = vn.astype(BF16)\n"
                                         "            vs_s[...] = (vn * bcast(e_end, vn.shape)).astype(BF16)\n"
                                         "            plgpu.commit_smem()\n", "")],
    # last: reading slots whose copies were never waited for can crash the GPU (it did at 4x4096,
    # once), which ends the run
    "no slot waits": _NO_WAIT,
}
# the loads' knockouts edit the one-warpgroup pass's own copies; with the producer warpgroup
# (--producer) only the others apply
_PRODUCER_SKIP = ("no loads after the first", "S chain only, no loads", "no slot waits")


def edited_module(module, edits, name):
    """``module``'s source with ``edits`` applied, exec'd as a module of the same package; raises
    ValueError when an edit's old text is not in the source (the kernel changed: update the edit)."""
    with open(module.__file__) as f:
        src = f.read()
    for old, new in edits:
        if old not in src:
            raise ValueError(f"knockout {name!r}: text not found in {os.path.basename(module.__file__)}: {old[:70]!r}")
        i = src.rindex(old)
        src = src[:i] + new + src[i + len(old):]
    mod = types.ModuleType(f"{module.__package__}._knockout")
    mod.__package__ = module.__package__
    exec(compile(src, f"{module.__file__} [{name}]", "exec"), mod.__dict__)
    return mod


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kernel", choices=("wy", "grads", "state"), default="wy")
    ap.add_argument("--shape", default=None, help="BxTxHxD (K = V = D); default 4x4096x16x128 on the GPU, 1x128x1x64 "
                                                  "with --interpret")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--interpret", action="store_true", help="CPU smoke test (times meaningless)")
    ap.add_argument("--producer", action="store_true",
                    help="--kernel state: the warp-specialised pass (HopperTuning.state_producer, the default) "
                         "instead of the one-warpgroup pass, without the loads' knockouts")
    args = ap.parse_args(argv)
    if args.reps is not None and args.reps < 1:
        ap.error(f"--reps must be >= 1, got {args.reps}")

    import jax
    import jax.numpy as jnp

    import bench_pallas as bp
    from gdn_jax.ops import KernelConfig
    from gdn_jax.ops.pallas import vjp as V
    from gdn_jax.ops.pallas.hopper import grads as HG, state_bwd as HR, state_fwd as HS, wy as HW

    shape = args.shape or ("1x128x1x64" if args.interpret else "4x4096x16x128")
    if "," in shape:
        ap.error(f"--shape: one BxTxHxD, got {shape!r}")
    (shape,) = bp.parse_shapes(shape, on_gpu=True, flag="--shape")
    x = bp.make_inputs(shape)
    base = dict(platform="interpret", gpu_kernels="mosaic") if args.interpret else {}
    prep = V.to_kernel_inputs(x["q"], x["k"], x["v"], x["g"], x["beta"], chunk_size=64, config=KernelConfig(**base))
    names = ("q", "k", "v", "beta", "gc", "gr", "eg", "ekd", "dec", "h0", "fl")
    if args.kernel == "wy":
        call, kargs = prep.kernel_args("fwd")
        A = dict(zip(names, kargs))
        module, edits, keys = HW, WY_EDITS, ("w", "u", "t_hi")

        def run(M):
            return M.wy_forward(call, A["q"], A["k"], A["v"], A["beta"], A["gc"], A["eg"], save_t=True)
    elif args.kernel == "state":  # the forward state pass, from the forward WY's W, U, Aqk
        call, kargs = prep.kernel_args("fwd")
        call = dataclasses.replace(call, state_prod=args.producer)
        if args.producer:
            STATE_EDITS_RUN = {k: v for k, v in STATE_EDITS.items() if k not in _PRODUCER_SKIP}
        A = dict(zip(names, kargs))
        A.update(jax.jit(lambda A: HW.wy_forward(call, A["q"], A["k"], A["v"], A["beta"], A["gc"], A["eg"]))(A))
        module, edits, keys = HS, (STATE_EDITS_RUN if args.producer else STATE_EDITS), ("o", "final")

        def run(M):
            return M.forward_states_and_output(call, A["w"], A["u"], A["k"], A["ekd"], A["dec"], A["h0"], A["fl"],
                                               A["q"], A["eg"], A["aqk"])
    else:
        call, kargs = prep.kernel_args("bwd")
        A = dict(zip(names, kargs))
        pad = call.Tp - x["do"].shape[1]
        A.update(do=jnp.pad(x["do"], ((0, 0), (0, pad), (0, 0), (0, 0))), dfin=jnp.zeros(A["h0"].shape, jnp.float32))
        A.update(jax.jit(lambda A: HW.wy_backward(call, A["q"], A["k"], A["v"], A["do"], A["beta"], A["gc"], A["eg"]))(A))
        A.update(jax.jit(lambda A: HS.recompute_states(call, A["w"], A["u"], A["k"], A["ekd"], A["dec"], A["h0"],
                                                       A["fl"]))(A))
        A.update(jax.jit(lambda A: HR.reverse_states(call, A["q"], A["k"], A["w"], A["dvl"], A["do"], A["eg"], A["ekd"],
                                                     A["dec"], A["dfin"], A["h"], A["fl"]))(A))
        module, edits, keys = HG, GRAD_EDITS, ("dq", "dk", "dv", "dbeta", "dgam")

        def run(M):
            return M.chunk_grads(call, A["q"], A["k"], A["v"], A["do"], A["beta"], A["gc"], A["eg"], A["ekd"], A["h"],
                                 A["dh"], A["vn"], A["dvn"], A["t_hi"], A["t_lo"])
    on = prep.paths[0].startswith("hopper") if args.kernel in ("wy", "state") else prep.paths[1] == "hopper"
    print(jax.__version__, jax.devices()[0].device_kind, shape, args.kernel, "on the Hopper kernels:", on, flush=True)
    if not on:
        return 1
    rows, ref = [], None
    for name, ed in edits.items():
        M = edited_module(module, ed, name)
        fn = jax.jit(lambda A, M=M: run(M))
        out = jax.block_until_ready(fn(A))
        ref = out if ref is None else ref
        err = {}
        for k in keys:
            a, b = out[k].astype(jnp.float32), ref[k].astype(jnp.float32)
            err[k] = float(jnp.sqrt(jnp.mean((a - b) ** 2) / jnp.mean(b ** 2)))
        ms = 0.0 if args.interpret else bp.time_fn_pipelined(lambda: fn(A), args.reps)
        rows.append((name, ms, err))
        print(f"  {name:<32} {ms:.3f} ms  " + " ".join(f"{k} {v:.1e}" for k, v in err.items()), flush=True)
    print(f"=== knockouts of the {args.kernel} kernel at {shape} (pipelined ms; RMS relative difference from base)")
    for name, ms, err in rows:
        print(f"{name:<32} {ms:7.3f}  " + " ".join(f"{k} {v:.1e}" for k, v in err.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
