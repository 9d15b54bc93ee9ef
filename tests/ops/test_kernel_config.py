"""``KernelConfig`` in groups (platform and chunks at the top; ``Precision``, ``TritonTuning`` beside the
portable kernels, ``HopperTuning`` with its ``HopperVariants`` beside the Hopper kernels), each validated
when made, and the shim that keeps the flat keywords of earlier releases working with a FutureWarning."""
import dataclasses
import warnings

import jax.numpy as jnp
import pytest

from gdn_jax.cli import parse_kernel_config
from gdn_jax.ops import HopperTuning, KernelConfig, Precision, TritonTuning
from gdn_jax.ops import pallas as P
from gdn_jax.ops.pallas.config import FLAT_NAMES, from_flat_names, resolve
from gdn_jax.ops.pallas.hopper.tuning import HopperVariants

# one value per group, none of them a default
FLAT = dict(mid_dtype="f32", gpu_f32_mm="tf32x3", bv_state=32, merge_state=False, warps_grad=8, save_wy=False,
            wy_inverse="dense", fwd_form="t", state_slots=3, grad_chunks_per_cta=2)
GROUPED = KernelConfig(
    platform="interpret", gpu_kernels="mosaic",
    precision=Precision(mid_dtype="f32", gpu_f32_mm="tf32x3"),
    triton=TritonTuning(bv_state=32, merge_state=False, warps_grad=8),
    hopper=HopperTuning(save_wy=False, wy_inverse="dense", fwd_form="t",
                        variants=HopperVariants(state_slots=3, grad_chunks_per_cta=2)))


def _flat(**kw):
    with pytest.warns(FutureWarning, match="flat keywords are deprecated") as got:
        cfg = KernelConfig(**kw)
    return cfg, got


def test_flat_keywords_shim_warns_and_equals_the_groups():
    """Old flat keywords give the same (equal, same hash) config as the groups, with one FutureWarning
    that names the groups; ``dataclasses.replace`` with a flat keyword and reading a flat name work too."""
    cfg, got = _flat(platform="interpret", gpu_kernels="mosaic", **FLAT)
    assert cfg == GROUPED and hash(cfg) == hash(GROUPED)
    assert len(got) == 1 and got[0].category is FutureWarning
    assert "deprecated" in str(got[0].message) and "HopperTuning(" in str(got[0].message)
    assert got[0].filename == __file__  # points at the caller's line
    with pytest.warns(FutureWarning, match="flat keywords"):
        again = dataclasses.replace(GROUPED, save_wy=True)
    assert again.hopper.save_wy is True and again.hopper.wy_inverse == "dense"  # the rest of the group kept
    with pytest.warns(FutureWarning, match=r"KernelConfig.hopper.variants.state_slots"):
        assert GROUPED.state_slots == 3
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the grouped form and the benchmarks' route do not warn
        KernelConfig(hopper=HopperTuning(save_wy=False))
        assert from_flat_names(platform="interpret", gpu_kernels="mosaic", **FLAT) == GROUPED
        assert parse_kernel_config(["platform=interpret", "gpu_kernels=mosaic", "mid_dtype=f32", "gpu_f32_mm=tf32x3",
                                    "bv_state=32", "merge_state=false", "warps_grad=8", "save_wy=false",
                                    "wy_inverse=dense", "fwd_form=t", "state_slots=3",
                                    "grad_chunks_per_cta=2"]) == GROUPED
    # the resolved call is the same: the kernels see no difference
    kw = dict(platform="interpret", C=64, n=2, BH=2, H=2, K=64, V=64, K0=64, V0=64, scale=0.125,
              in_dt=jnp.bfloat16, packed=False, nseq=1)
    assert resolve(cfg, **kw) == resolve(GROUPED, **kw)


def test_flat_spellings_fail_in_this_suite():
    """setup.cfg's ``filterwarnings`` turns the shim's FutureWarning into an error in the test suite, so a
    flat keyword, a flat ``dataclasses.replace`` or a flat read left in the code base fails CI (the
    shim's own tests catch it with ``pytest.warns``)."""
    with pytest.raises(FutureWarning, match="flat keywords are deprecated"):
        KernelConfig(save_wy=False)
    with pytest.raises(FutureWarning, match="flat keywords are deprecated"):
        dataclasses.replace(GROUPED, bv_state=16)
    with pytest.raises(FutureWarning, match=r"KernelConfig.mid_dtype is deprecated"):
        GROUPED.mid_dtype


def test_every_flat_name_has_one_group():
    """The 39 fields of the groups keep their flat names (with the 4 top-level fields: the 43 of the flat
    KernelConfig), each in exactly one group, and ``TritonTuning.gatefree`` (newer: its own name works
    in ``from_flat_names`` for the benchmarks' command lines); ``seq_split`` and ``keys_unit_norm`` are
    top-level fields of their own (newer than the flat keywords)."""
    fields = [f.name for cls in (Precision, TritonTuning, HopperTuning, HopperVariants)
              for f in dataclasses.fields(cls) if f.name != "variants"]
    assert len(fields) == len(set(fields)) == len(FLAT_NAMES) == 40 and FLAT_NAMES["gatefree"] == "triton"
    assert {f.name for f in dataclasses.fields(KernelConfig)} == {"platform", "fwd_chunk", "bwd_chunk", "gpu_kernels",
                                                                  "precision", "triton", "hopper", "seq_split",
                                                                  "keys_unit_norm"}


@pytest.mark.parametrize("make,err,msg", [
    (lambda: Precision(mid_dtype="f16"), ValueError, "Precision.mid_dtype must be one of"),
    (lambda: TritonTuning(warps_out=3), ValueError, "TritonTuning.warps_out must be a power of two"),
    (lambda: TritonTuning(bv_grad=0), ValueError, "TritonTuning.bv_grad must be a positive int"),
    (lambda: TritonTuning(fuse_output=None), TypeError, "TritonTuning.fuse_output must be True or False"),
    (lambda: HopperTuning(fwd_form="T"), ValueError, "HopperTuning.fwd_form must be one of"),
    (lambda: HopperTuning(state_producer=False, variants=HopperVariants(state_slots=3)), ValueError,
     "needs the state pass's producer"),
    (lambda: HopperVariants(state_warpgroups=3), ValueError, "HopperVariants.state_warpgroups must be one of"),
    (lambda: KernelConfig(hopper=Precision()), TypeError, "KernelConfig.hopper must be a HopperTuning"),
    (lambda: KernelConfig(fwd_chunk=48), ValueError, "KernelConfig.fwd_chunk must be one of"),
    (lambda: KernelConfig(warp_wy=4), TypeError, "unexpected keyword arguments \\['warp_wy'\\]"),
    (lambda: KernelConfig(bv_sate=32), TypeError, "did you mean 'bv_state'"),
    (lambda: KernelConfig(chunk=64), TypeError, r"unexpected keyword arguments \['chunk'\]"),
    (lambda: KernelConfig(chunk_size=32), TypeError, "did you mean 'fwd_chunk' or 'bwd_chunk'"),
])
def test_groups_validated_when_made(make, err, msg):
    with pytest.raises(err, match=msg):
        make()


def test_variants_not_exported():
    """The variants that measured no faster are reachable (for the benchmarks) but not exported."""
    import gdn_jax.ops as ops

    assert not hasattr(ops, "HopperVariants") and "HopperVariants" not in P.__all__
    assert {"Precision", "TritonTuning", "HopperTuning"} <= set(ops.__all__)


def test_flat_warning_spells_the_groups():
    """The FutureWarning gives the grouped spelling of the flat keywords used, which evaluates to the
    same config; a group passed as well (as ``dataclasses.replace`` passes every group) is spelled as a
    change of it, keeping its other fields."""
    import re

    flat = dict(mid_dtype="f32", bv_state=32, save_wy=False, state_slots=3)
    cfg, got = _flat(**flat)
    msg = str(got[0].message)
    spelled = re.search(r"write (KernelConfig\(.*\)) \(HopperVariants", msg).group(1)
    assert spelled.count("=") == 8  # precision, triton, hopper, variants and the four fields
    env = dict(KernelConfig=KernelConfig, Precision=Precision, TritonTuning=TritonTuning,
               HopperTuning=HopperTuning, HopperVariants=HopperVariants)
    assert eval(spelled, env) == cfg == from_flat_names(**flat)
    with pytest.warns(FutureWarning) as rec:
        again = dataclasses.replace(GROUPED, save_wy=True)
    assert rec[0].filename == __file__  # the caller's line, not dataclasses.py
    spelled = re.search(r"write (KernelConfig\(.*\)) \(docs", str(rec[0].message)).group(1)
    assert spelled == "KernelConfig(hopper=dataclasses.replace(hopper, save_wy=True))"
    kept = eval(spelled, dict(env, dataclasses=dataclasses, hopper=GROUPED.hopper))
    assert kept.hopper == again.hopper and kept.hopper.wy_inverse == "dense"


def test_block_error_names_the_group():
    """A Triton block that does not divide the head dim is named by its group's field."""
    q = jnp.zeros((1, 64, 2, 32), jnp.float32)
    g = jnp.zeros((1, 64, 2))
    with pytest.raises(ValueError, match=r"TritonTuning.bv_grad=24 must divide the head dim 32"):
        P.backward_kernels(q, q, q, g, g, kernel_config=KernelConfig(platform="interpret",
                                                                     triton=TritonTuning(bv_grad=24)))


def test_report_says_why_in_words():
    """The not-taken reasons of the Hopper entries: interpret mode names gpu_kernels='mosaic'; the
    default forward form names its rule and this call's K and state-pass CTAs; the transition form is
    opt-in."""
    g = jnp.zeros((1, 256, 2))
    q = jnp.zeros((1, 256, 2, 128), jnp.bfloat16)
    why = dict(P.forward_kernels(q, q, q, g, g, kernel_config=KernelConfig(platform="interpret")).not_taken)
    assert "gpu_kernels='mosaic'" in why["hopper_t"] and "sm_90" not in why["hopper_t"]
    rep = P.forward_kernels(q, q, q, g, g, kernel_config=KernelConfig(platform="gpu", gpu_kernels="mosaic"))
    why = dict(rep.not_taken)
    assert rep.path == "hopper_wu"
    assert "K=128, 16 CTAs" in why["hopper_t"] and "fwd_form='t'" in why["hopper_t"]  # 1 * 2 heads * 128/16
    assert why["hopper_transition"].startswith("opt-in")
    rep = P.forward_kernels(q, q, q, g, g, kernel_config=KernelConfig(
        platform="gpu", gpu_kernels="mosaic", hopper=HopperTuning(fwd_form="t")))
    assert rep.path == "hopper_t" and dict(rep.not_taken)["hopper_wu"].endswith("(HopperTuning.fwd_form='t')")

    brep = P.backward_kernels(q, q, q, g, g, kernel_config=KernelConfig(platform="gpu", gpu_kernels="mosaic"))
    assert brep.path == "hopper"
    assert dict(brep.not_taken)["hopper_blocks"] == ("K=128, V=128: this entry is for K or V above 128 (the 'hopper' "
                                                     "entry takes K, V <= 128)")
