"""The Hopper (sm_90) kernels of ``backend="pallas"``, through Pallas' Mosaic GPU backend (TMA
copies into swizzled shared memory, ``wgmma`` with float32 accumulators in registers), split by
stage like the portable kernels of :mod:`gdn_jax.ops.pallas`:

* :mod:`.plan`: which calls they take, their shared-memory budgets and value blocks (plain
  Python; imports no kernel);
* :mod:`.common`: the shared Mosaic GPU helpers (shared-memory tiles, wgmma groups, barriers,
  TMA tile loads and stores);
* :mod:`.wy`: the WY stage, forward and backward (the twin of :mod:`gdn_jax.ops.pallas.wy`);
* :mod:`.state_fwd`: the forward state pass fused with the output, and the backward's recompute
  (the twin of :mod:`gdn_jax.ops.pallas.state_fwd`);
* :mod:`.transition`: the forward state pass in its "transition" form (``fwd_form="transition"``);
* :mod:`.state_bwd`: the reverse state pass (the twin of :mod:`gdn_jax.ops.pallas.state_bwd`);
* :mod:`.grads`: the gradient kernel (the twin of :mod:`gdn_jax.ops.pallas.grads`);
* :mod:`.tuning`: their options (``HopperTuning``, ``KernelConfig(hopper=...)``; plain Python).

Which kernels run a call is the table of :mod:`gdn_jax.ops.pallas.paths`. This package imports
none of its modules, so that importing the planning module loads no kernel.
"""
