"""Attention and quantization kernels (Pallas), each beside a plain ``jnp`` reference.

- ``dispatch.get_backend("reference" | "pallas") -> (prefill_fn, decode_fn)``
- ``flash_prefill``: causal GQA flash attention with ragged offsets/lengths (Triton model: GPU)
- ``paged_decode``: one-token decode over the paged cache (bf16/f32, int8, fp8) (GPU)
- ``quant``: KV-cache int8/fp8 (per block+head scales), weight-only int8/fp8
- ``quant_matmul``: weight-only matmul dequantizing tiles in registers (GPU)
- ``tpu_prefill``, ``tpu_decode``, ``tpu_quant_matmul``: the same three for Mosaic (TPU):
  key/page/contraction tiles as grid steps Pallas double-buffers into VMEM
- ``autotune``: block sizes tuned per shape on the accelerator, cached in JSON
- ``reference``: the plain ``jnp`` ground truth

Nothing is imported here, so ``import inference.kernels`` stays cheap.
"""
