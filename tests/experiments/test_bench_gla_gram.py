"""benchmarks/bench_gla_gram.py runs on the CPU: every formulation of the GLA chunk form's decay Gram
it times (the library's at two sub-block sizes, ``form_gram``'s three) gives the library's values and
gradients to 1e-5 (the benchmark asserts it) inside ``gated_linear_attention``'s fwd+bwd."""
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "benchmarks"))


def test_bench_gla_gram_variants_agree(capsys):
    import bench_gla_gram

    bench_gla_gram.main(["--shape", "1x128x2x16", "--reps", "1", "--subs", "16"])
    out = capsys.readouterr().out
    names = [line.split("fwd+bwd")[0].strip() for line in out.splitlines() if "fwd+bwd" in line]
    assert names == ["library", "sub 16", "elementwise 8", "fused 8", "padded 8",
                     "elementwise 16", "fused 16", "padded 16"]


def test_form_gram_matches_the_library_at_chunk_32():
    """The CPU-safe forms at chunk size 32 (two 16-token sub-blocks: where the broadcast "fused" form's
    backward crashes XLA:CPU of jaxlib 0.10.2), values and grads against the library's."""
    import functools

    import jax
    import jax.numpy as jnp
    import numpy as np
    from bench_gla_gram import form_gram

    from gdn_jax.ops import chunk as C_

    rng = np.random.default_rng(3)
    a, b = (jnp.asarray(rng.standard_normal((2, 32, 8)), jnp.float32) for _ in range(2))
    gc = jnp.asarray(np.cumsum(-rng.exponential(0.5, (2, 32, 8)), axis=1), jnp.float32)
    w = jnp.asarray(rng.standard_normal((2, 32, 32)), jnp.float32)
    for form in ("elementwise", "padded"):
        f = lambda gram: jax.value_and_grad(lambda a, b, gc: jnp.sum(gram(a, b, gc) * w), argnums=(0, 1, 2))(a, b, gc)
        (v1, g1), (v2, g2) = f(functools.partial(form_gram, sub=16, form=form)), f(functools.partial(C_.decay_gram_channel, sub=16))
        assert abs(float(v1) - float(v2)) <= 1e-5 * abs(float(v2))
        for x, y in zip(g1, g2):
            np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-4, atol=1e-5)
