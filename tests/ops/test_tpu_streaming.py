"""The TPU kernels stream: lowering for TPU (Mosaic, through ``jax.export`` on this CPU host) of
forward and forward + backward at T = 4K and 128K, and the VMEM budget of every TPU kernel as
traced (``benchmarks/vmem_budget.py``: the kernels' own block shapes and scratch) the same at
T = 4K and 128K and below the default scoped VMEM of v5e (16 MiB) without raising it. Numerics
of the TPU kernels: ``test_pallas.py`` / ``test_gva.py`` (``platform="tpu_interpret"``)."""
import importlib.util
import os

import jax
import jax.numpy as jnp
import pytest

from gdn_jax.ops import KernelConfig, gated_delta_rule

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
F32, BF16 = jnp.float32, jnp.bfloat16
STATE_KERNELS = ("gdn_fwd_h_o_tpu", "gdn_fwd_h_tpu", "gdn_bwd_dh_tpu")


@pytest.fixture(scope="module")
def budget():
    spec = importlib.util.spec_from_file_location("vmem_budget", os.path.join(REPO, "benchmarks", "vmem_budget.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("B,T,H,D", [(4, 4096, 16, 128), (1, 131072, 16, 128), (2, 8192, 8, 256)])  # the shapes
@pytest.mark.parametrize("packed", [False, True], ids=["dense", "packed"])
def test_tpu_lowering_long(B, T, H, D, packed):
    """Mosaic TPU lowering of forward and of forward + backward, bf16 (packed: B = 1, 3 sequences)."""
    B, K, V = (1 if packed else B), D, D
    N = 3 if packed else B
    cu = jnp.asarray([0, T // 3, T // 3 + 100, T], jnp.int32) if packed else None
    sds = [jax.ShapeDtypeStruct(s, d) for s, d in (
        ((B, T, H, K), BF16), ((B, T, H, K), BF16), ((B, T, H, V), BF16), ((B, T, H), F32), ((B, T, H), BF16),
        ((N, H, K, V), F32))]

    def fwd(q, k, v, g, b, s):
        return gated_delta_rule(q, k, v, g, b, initial_state=s, output_final_state=True, backend="pallas",
                                chunk_size=64, cu_seqlens=cu, kernel_config=KernelConfig(platform="tpu"))

    def loss(*a):
        o, S = fwd(*a)
        return jnp.sum(o.astype(F32)) + jnp.sum(S)

    kernels = {"fwd": ("gdn_wy_fwd", "gdn_fwd_h_o_tpu"),
               "fwd+bwd": ("gdn_wy_fwd", "gdn_fwd_h_o_tpu", "gdn_wy_bwd", "gdn_fwd_h_tpu", "gdn_bwd_dh_tpu",
                           "gdn_bwd_dqkvg")}
    for what, f in (("fwd", fwd), ("fwd+bwd", jax.value_and_grad(loss, argnums=tuple(range(6))))):
        mlir = jax.export.export(jax.jit(f), platforms=["tpu"])(*sds).mlir_module()
        assert mlir.count("tpu_custom_call") == len(kernels[what]), what
        assert all(name in mlir for name in kernels[what]), what


@pytest.mark.parametrize("packed", [False, True], ids=["dense", "packed"])
def test_vmem_budget_independent_of_T(budget, packed):
    """Every TPU kernel's blocks and scratch as traced are the same at T = 4K and 128K (only the
    chunk axis of the grid grows), the state passes carry their state in VMEM scratch on a grid
    whose chunk axis is "arbitrary", and each kernel fits the default scoped VMEM of v5e
    (16 MiB) without asking for more."""
    short = budget.kernel_budgets(1, 4096, 2, 128, 128, packed=packed)
    long = budget.kernel_budgets(1, 131072, 2, 128, 128, packed=packed)
    assert set(short) == set(long) and set(STATE_KERNELS) <= set(short)
    for name, b in long.items():
        s = short[name]
        assert b["blocks"] == s["blocks"] and b["scratch"] == s["scratch"], name
        assert b["vmem_bytes"] == s["vmem_bytes"] < budget.DEFAULT_SCOPED["v5e"], name
        assert b["vmem_limit_bytes"] is None, name
        grown = [i for i, (x, y) in enumerate(zip(s["grid"], b["grid"])) if x != y]  # only the chunk axis
        assert len(grown) == 1 and b["grid"][grown[0]] >= 25 * s["grid"][grown[0]], (name, s["grid"], b["grid"])
        if name in STATE_KERNELS:
            assert b["dimension_semantics"] == ("parallel", "parallel", "arbitrary"), name
            assert b["scratch"] == [((128, 128), "float32")], name
