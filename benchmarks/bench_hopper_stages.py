"""Each Hopper (Mosaic GPU) kernel of ``backend="pallas"`` timed alone on its real inputs, pipelined
device time and per synchronised call, plus the whole op and (when importable) jax-linear-attention
at the same shape. GPU (sm_90) only.

    python benchmarks/bench_hopper_stages.py --shapes 0,3 --reps 20 [--blocks 64,32,16] [--no-jla]

Also times the forward WY with ``KernelConfig(wy_inverse="dense")`` (the default is "blocked"), ``save_wy``'s kernels (the
forward WY + T, the backward's WY from the saved Aqk and T), and the whole op by default, with the
dense inverse, without ``save_wy``, with the one-warpgroup gradient kernel
(``KernelConfig(grad_warpgroups=1)``, also timed alone; the default is 2) and with ``save_states``
(the forward's state pass also writing h_n and Vn: timed alone as "fwd state pass + h, Vn", with
the backward's WY stage it leaves, "bwd dVl from saved").

Shapes are ``bench_pallas.SHAPES`` indices. ``--blocks`` times the forward state pass at each value
block (``KernelCall.bv_mosaic``) besides the default. One line per kernel, flushed as it goes (a
device call's time limit keeps what was printed). Used for results/hopper_h200/stages_*.txt.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="0", help="comma-separated bench_pallas.SHAPES indices")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--blocks", default="", help="extra value blocks of the forward state pass, e.g. 32,16")
    ap.add_argument("--no-jla", action="store_true")
    ap.add_argument("--only", default="",
                    help="comma-separated substrings: time only the lines whose name contains one, e.g. "
                         "'kernel,WG,pallas' (default: every line)")
    args = ap.parse_args(argv)
    only = [o for o in args.only.split(",") if o]

    def wanted(name):
        return not only or any(o in name for o in only)

    import jax
    import jax.numpy as jnp

    import bench_pallas as bp
    from gdn_jax.ops import KernelConfig
    from gdn_jax.ops.pallas import hopper as HF, hopper_bwd as HB, vjp as V

    print(jax.__version__, jax.devices()[0].device_kind, flush=True)

    def t(f):
        jf = jax.jit(f)
        jax.block_until_ready(jf())
        return f"{bp.time_fn_pipelined(jf, args.reps):.3f} (per call {bp.time_fn(jf, args.reps):.3f})"

    for si in (int(s) for s in args.shapes.split(",")):
        shape = bp.SHAPES[si]
        try:
            x = bp.make_inputs(shape)
            prep = V.to_kernel_inputs(x["q"], x["k"], x["v"], x["g"], x["beta"], chunk_size=64, config=KernelConfig())
            cf, (q, k, v, beta, gc, gr, eg, ekd, dec, h0, fl) = prep.kernel_args("fwd")
            print(shape, "fwd: mosaic", cf.mosaic_fwd, "C", cf.C, "value block", cf.bv_mosaic, flush=True)
            if not cf.mosaic_fwd:
                print("  not on the Hopper kernels:", HF.covers(cf) or "not an sm_90 GPU", flush=True)
                continue
            wy = jax.jit(lambda: HF.wy_forward(cf, q, k, v, beta, gc, eg))()
            if wanted("fwd WY"):
                print(f"  fwd WY               {t(lambda: HF.wy_forward(cf, q, k, v, beta, gc, eg))} ms", flush=True)
            cfd = dataclasses.replace(cf, wy_inverse="dense")  # KernelConfig.wy_inverse="dense"
            if wanted("fwd WY, dense inv."):
                print(f"  fwd WY, dense inv.   {t(lambda: HF.wy_forward(cfd, q, k, v, beta, gc, eg))} ms", flush=True)
            blocks = [cf.bv_mosaic] + [int(b) for b in args.blocks.split(",") if b and int(b) != cf.bv_mosaic]
            for bv in blocks:
                c2 = dataclasses.replace(cf, bv_mosaic=bv)
                f = lambda c2=c2: HF.forward_states_and_output(c2, wy["w"], wy["u"], k, ekd, dec, h0, fl, q, eg, wy["aqk"])
                if wanted(f"fwd state pass bv{bv}"):
                    print(f"  fwd state pass bv{bv:<3d} {t(f)} ms", flush=True)
            f = lambda: HF.forward_states_and_output(cf, wy["w"], wy["u"], k, ekd, dec, h0, fl, q, eg, wy["aqk"],
                                                     save_states=True)  # KernelConfig.save_states
            if wanted("fwd state pass + h, Vn"):
                print(f"  fwd state pass + h, Vn {t(f)} ms", flush=True)
            cb, (q, k, v, beta, gc, gr, eg, ekd, dec, h0, fl) = prep.kernel_args("bwd")
            if cb.mosaic_bwd:
                do, dfin = x["do"], jnp.zeros(h0.shape, jnp.float32)
                wyb = jax.jit(lambda: HB.wy_backward(cb, q, k, v, do, beta, gc, eg))()
                st = jax.jit(lambda: HB.recompute_states(cb, wyb["w"], wyb["u"], k, ekd, dec, h0, fl))()
                rs = jax.jit(lambda: HB.reverse_states(cb, q, k, wyb["w"], wyb["dvl"], do, eg, ekd, dec, dfin,
                                                       st["h"], fl))()
                steps = [
                    ("bwd WY", lambda: HB.wy_backward(cb, q, k, v, do, beta, gc, eg)),
                    ("bwd recompute", lambda: HB.recompute_states(cb, wyb["w"], wyb["u"], k, ekd, dec, h0, fl)),
                    ("bwd reverse pass", lambda: HB.reverse_states(cb, q, k, wyb["w"], wyb["dvl"], do, eg, ekd, dec,
                                                                   dfin, st["h"], fl)),
                    ("bwd gradient kernel", lambda: HB.chunk_grads(cb, q, k, v, do, beta, gc, eg, ekd, st["h"],
                                                                   rs["dh"], st["vn"], rs["dvn"], wyb["t_hi"],
                                                                   wyb["t_lo"])),
                ]
                c1w = dataclasses.replace(cb, grad_wgs=1)  # KernelConfig.grad_warpgroups=1 (the default is 2)
                steps.insert(4, ("bwd grads, 1 WG", lambda: HB.chunk_grads(c1w, q, k, v, do, beta, gc, eg, ekd,
                                                                           st["h"], rs["dh"], st["vn"], rs["dvn"],
                                                                           wyb["t_hi"], wyb["t_lo"])))
                if cb.C == cf.C:  # KernelConfig.save_wy: the backward's WY from the forward's Aqk and T
                    sv = jax.jit(lambda: HF.wy_forward(cb, q, k, v, beta, gc, eg, save_t=True))()
                    steps.insert(1, ("bwd dVl from saved", lambda: HB.dvl_from_saved(cb, do, sv["aqk"])))
                    steps.insert(1, ("bwd WY from saved", lambda: HB.wy_from_saved(
                        cb, k, v, do, beta, eg, sv["aqk"], sv["t_hi"], sv["t_lo"])))
                    steps.insert(0, ("fwd WY + T (save_wy)", lambda: HF.wy_forward(cb, q, k, v, beta, gc, eg,
                                                                                   save_t=True)))
                for name, fn in [s for s in steps if wanted(s[0])]:
                    print(f"  {name:<20} {t(fn)} ms", flush=True)
            else:
                print("  backward not on the Hopper kernels:", HB.covers(cb) or "not an sm_90 GPU", flush=True)
            for label, kc in (("pallas", KernelConfig()), ("dense inv", KernelConfig(wy_inverse="dense")),
                              ("no save_wy", KernelConfig(save_wy=False)),
                              ("grads 1 WG", KernelConfig(grad_warpgroups=1)),
                              ("save states", KernelConfig(save_states=True))):
                if not wanted(label):
                    continue
                f, fb = bp.jax_fns("pallas", x, 64, kc)
                print(f"  {label:<10} fwd {t(f)}  fwd+bwd {t(fb)} ms", flush=True)
            if not args.no_jla and wanted("jla"):
                try:
                    jf, jfb, _ = bp.jla_fns(x)
                    print(f"  jla    fwd {t(jf)}  fwd+bwd {t(jfb)} ms", flush=True)
                except Exception as e:  # not installed / fails: say so, keep going
                    print(f"  jla: {type(e).__name__}: {str(e)[:200]}", flush=True)
        except Exception:
            traceback.print_exc()


if __name__ == "__main__":
    main()
