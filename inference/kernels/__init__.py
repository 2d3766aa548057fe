"""Attention and quantization kernels (Pallas), each beside a plain ``jnp`` reference.

- ``dispatch.get_backend("reference" | "pallas") -> (prefill_fn, decode_fn)``
- ``flash_prefill``: causal GQA flash attention with ragged offsets/lengths
- ``paged_decode``: one-token decode over the paged cache (bf16/f32, int8, fp8)
- ``quant``: KV-cache int8/fp8 (per block+head scales), weight-only int8/fp8
- ``quant_matmul``: weight-only matmul dequantizing tiles in registers
- ``autotune``: block sizes tuned per shape on the accelerator, cached in JSON
- ``reference``: the plain ``jnp`` ground truth

Nothing is imported here, so ``import inference.kernels`` stays cheap.
"""
