// RoPE on one layer's queries and keys, and its keys and values written into the paged KV cache,
// as one native call (XLA FFI, see cpu_ffi.py), for float32 on CPU.
//
// Why: XLA fuses RoPE's cos and sin into each layer's rotation of q and of k and evaluates them
// per head element, 8 layers x 12 heads (bench model) times over: 2.8 ms of a 77 ms prefill call
// of 2 x 128 tokens and 0.69 of an 18.4 ms batch-32 decode step (profiled thunks). Tables
// computed once per call behind an optimization barrier do not survive XLA:CPU (the barrier is
// removed before fusion); as a native call's operands they are computed once. The same call
// writes the rotated k and the v into their cache slots, which the jnp path does as two scatters
// fed by reshape copies (2.2 ms of that prefill call, 0.19 of that decode step).
//
// Measured (bench_decode's batch-32 run, our side alone, this call on against off, quiet, best of
// 4): 2.594 -> 2.476 s; prefill 0.926 -> 0.872 s, decode 1.661 -> 1.595 s; a batch-32 decode step
// (contexts ~150) 17.9 -> 17.0 ms. Same greedy tokens.
//
// Contract: qkv [R, (H + 2 KV) D] (the fused projection: q | k | v), cos / sin [R, D/2] (of each
// row's position times the inverse frequencies), slots [R] int32 (flat cache slot block * BS +
// offset; one outside 0 .. N*BS-1 is padding and written nowhere), k_cache / v_cache [N, BS, KV,
// D], aliased to the outputs  ->  q [R, H, D] rotated, k_cache and v_cache with row r's rotated
// k and its v at slots[r]. Rotation: the HF rotate_half layout, x1 = x[:D/2], x2 = x[D/2:],
// out = (x1 c - x2 s, x2 c + x1 s).

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "cpu_parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kRowsPerTask = 32;

inline void rotate(const float* x, const float* c, const float* s, int64_t half, float* out) {
  for (int64_t i = 0; i < half; ++i) {
    const float x1 = x[i], x2 = x[i + half];
    out[i] = x1 * c[i] - x2 * s[i];
    out[i + half] = x2 * c[i] + x1 * s[i];
  }
}

ffi::Error RopeWriteImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> qkv, ffi::Buffer<ffi::F32> cos,
                         ffi::Buffer<ffi::F32> sin, ffi::Buffer<ffi::S32> slots, ffi::Buffer<ffi::F32>,
                         ffi::Buffer<ffi::F32>, ffi::Result<ffi::Buffer<ffi::F32>> q,
                         ffi::Result<ffi::Buffer<ffi::F32>> k_cache,
                         ffi::Result<ffi::Buffer<ffi::F32>> v_cache, int64_t threads) {
  auto xd = qkv.dimensions(), cd = cos.dimensions(), sd = sin.dimensions(), qd = q->dimensions();
  auto kd = k_cache->dimensions(), vd = v_cache->dimensions();
  if (xd.size() != 2 || cd.size() != 2 || sd.size() != 2 || slots.dimensions().size() != 1 ||
      qd.size() != 3 || kd.size() != 4 || vd.size() != 4) {
    return ffi::Error::InvalidArgument(
        "rope_write_kv: qkv must be [R, (H+2KV)D], cos and sin [R, D/2], slots [R], q [R, H, D], "
        "caches [N, BS, KV, D]");
  }
  const int64_t r = xd[0], h = qd[1], d = qd[2], n = kd[0], bs = kd[1], kv = kd[2], half = d / 2;
  bool ok = d % 2 == 0 && kd[3] == d && xd[1] == (h + 2 * kv) * d && qd[0] == r && slots.dimensions()[0] == r;
  for (int i = 0; i < 2; ++i) ok = ok && cd[i] == sd[i] && kd[i] == vd[i];
  ok = ok && cd[0] == r && cd[1] == half && kd[2] == vd[2] && kd[3] == vd[3];
  if (!ok) return ffi::Error::InvalidArgument("rope_write_kv: inconsistent shapes");
  const float* xp = qkv.typed_data();
  const float* cp = cos.typed_data();
  const float* sp = sin.typed_data();
  const int32_t* slot = slots.typed_data();
  float* qp = q->typed_data();
  float* kp = k_cache->typed_data();
  float* vp = v_cache->typed_data();
  const int64_t width = (h + 2 * kv) * d, row_floats = kv * d, limit = n * bs;
  quicserve::parallel_for(pool, (r + kRowsPerTask - 1) / kRowsPerTask, threads, [&](int64_t task) {
    for (int64_t i = task * kRowsPerTask; i < std::min(r, (task + 1) * kRowsPerTask); ++i) {
      const float* x = xp + i * width;
      const float* c = cp + i * half;
      const float* s = sp + i * half;
      for (int64_t j = 0; j < h; ++j) rotate(x + j * d, c, s, half, qp + (i * h + j) * d);
      const int64_t at = slot[i];
      if (at < 0 || at >= limit) continue;  // padding: written nowhere
      for (int64_t j = 0; j < kv; ++j) rotate(x + (h + j) * d, c, s, half, kp + at * row_floats + j * d);
      std::memcpy(vp + at * row_floats, x + (h + kv) * d, sizeof(float) * row_floats);
    }
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(QuicserveRopeWriteKvF32, RopeWriteImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // qkv
                                  .Arg<ffi::Buffer<ffi::F32>>()  // cos
                                  .Arg<ffi::Buffer<ffi::F32>>()  // sin
                                  .Arg<ffi::Buffer<ffi::S32>>()  // slots
                                  .Arg<ffi::Buffer<ffi::F32>>()  // k_cache (aliased to the second result)
                                  .Arg<ffi::Buffer<ffi::F32>>()  // v_cache (aliased to the third result)
                                  .Ret<ffi::Buffer<ffi::F32>>()  // q
                                  .Ret<ffi::Buffer<ffi::F32>>()  // k_cache
                                  .Ret<ffi::Buffer<ffi::F32>>()  // v_cache
                                  .Attr<int64_t>("threads"));
