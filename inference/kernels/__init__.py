"""Every kernel the model calls, and the one place that chooses among them.

- ``kernel_set``: the seam. ``build_kernels(...) -> KernelSet``, once per worker, from the
  platform (the only ``jax.default_backend()`` call in inference/), dtypes and options
- ``reference``: the plain ``jnp`` ground truth every attention kernel is tested against
- ``xla_attention``: chunked online-softmax attention in ``jnp``, for any platform
- ``cpu_ffi``, ``cpu_isa``: the native CPU kernels (decode, prefill, packed matmul, RoPE + K/V write)
- ``pallas``: the Pallas families as the kernel set calls them, block sizes tuned per shape
- ``flash_prefill``, ``paged_decode``, ``quant_matmul``: the Triton-model kernels (GPU)
- ``tpu_prefill``, ``tpu_decode``, ``tpu_quant_matmul``: the same three for Mosaic (TPU):
  key/page/contraction tiles as grid steps Pallas double-buffers into VMEM
- ``paged_cache``: the KV cache's arrays (layout, bytes, writes, gathers)
- ``projections``, ``rope``: the serving-layout matmuls and RoPE with the K/V write
- ``quant``, ``gptq``: KV-cache int8/fp8 (per block+head scales), weight-only int8/fp8, GPTQ
- ``autotune``: block sizes tuned per shape on the accelerator, cached in JSON

Nothing is imported here, so ``import inference.kernels`` stays cheap.
"""
