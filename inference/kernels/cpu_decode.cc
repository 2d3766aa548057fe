// Paged-attention decode for CPU, called from JAX through the XLA FFI (see cpu_ffi.py).
//
// Why: on CPU the jnp reference runs as small XLA ops inside a run-time loop; they copy each
// sequence's blocks before reading them and never use a second core (measured: ~15-26 ms of a
// ~32-44 ms batch-32 step on two threads). This kernel reads each K/V row in place through the
// block table, once, and splits the sequences over threads.
//
// Contract (float32 only; the caller falls back to the reference otherwise):
//   q [B, H, D], k_cache / v_cache [N, BS, KV, D], block_tables [B, M] int32,
//   context_lens [B] int32, attribute scale (f32)  ->  out [B, H, D].
// Query head h reads KV head h / (H / KV). Row b attends to positions 0 .. context_lens[b]-1;
// a row with no context gets zeros. Softmax in float32, two passes over the scores.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <thread>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

struct Shapes {
  int64_t b, h, d, n, bs, kv, m;
};

// One sequence, every head: a token's K (then V) for all KV heads is one contiguous row of KV*D
// floats, and a block's rows are contiguous, so each pass streams whole blocks.
void one_row(const Shapes& s, const float* q, const float* kc, const float* vc, const int32_t* tables,
             const int32_t* lens, float scale, float* out, int64_t row, std::vector<float>& scores) {
  const int64_t g = s.h / s.kv;
  const int64_t d = s.d;
  const int64_t h = s.h;
  const int64_t width = s.kv * d;  // floats per token row
  float* o = out + row * h * d;
  const int64_t ctx = std::min<int64_t>(std::max<int32_t>(lens[row], 0), s.m * s.bs);
  std::fill(o, o + h * d, 0.0f);
  if (ctx == 0) return;
  scores.resize(static_cast<size_t>(ctx * h));
  const float* qr = q + row * h * d;
  const int32_t* table = tables + row * s.m;
  std::vector<float> mx(h, std::numeric_limits<float>::lowest()), denom(h, 0.0f);
  for (int64_t t = 0; t < ctx; ++t) {
    const float* k = kc + (table[t / s.bs] * s.bs + t % s.bs) * width;
    float* sc = scores.data() + t * h;
    for (int64_t hi = 0; hi < h; ++hi) {
      const float* qq = qr + hi * d;
      const float* kk = k + (hi / g) * d;
      float acc = 0.0f;
      for (int64_t i = 0; i < d; ++i) acc += qq[i] * kk[i];
      acc *= scale;
      sc[hi] = acc;
      mx[hi] = std::max(mx[hi], acc);
    }
  }
  for (int64_t t = 0; t < ctx; ++t) {
    const float* v = vc + (table[t / s.bs] * s.bs + t % s.bs) * width;
    const float* sc = scores.data() + t * h;
    for (int64_t hi = 0; hi < h; ++hi) {
      const float p = std::exp(sc[hi] - mx[hi]);
      denom[hi] += p;
      float* oo = o + hi * d;
      const float* vv = v + (hi / g) * d;
      for (int64_t i = 0; i < d; ++i) oo[i] += p * vv[i];
    }
  }
  for (int64_t hi = 0; hi < h; ++hi) {
    const float inv = 1.0f / denom[hi];
    float* oo = o + hi * d;
    for (int64_t i = 0; i < d; ++i) oo[i] *= inv;
  }
}

ffi::Error PagedDecodeImpl(ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k_cache, ffi::Buffer<ffi::F32> v_cache,
                           ffi::Buffer<ffi::S32> block_tables, ffi::Buffer<ffi::S32> context_lens,
                           ffi::Result<ffi::Buffer<ffi::F32>> out, float scale, int64_t threads) {
  auto qd = q.dimensions();
  auto kd = k_cache.dimensions();
  auto td = block_tables.dimensions();
  if (qd.size() != 3 || kd.size() != 4 || td.size() != 2) {
    return ffi::Error::InvalidArgument("paged decode: q must be [B,H,D], caches [N,BS,KV,D], tables [B,M]");
  }
  Shapes s{qd[0], qd[1], qd[2], kd[0], kd[1], kd[2], td[1]};
  if (kd[3] != s.d || s.kv == 0 || s.h % s.kv != 0 || td[0] != s.b) {
    return ffi::Error::InvalidArgument("paged decode: inconsistent shapes");
  }
  // Every block a row will read must exist: a bad table is an error, never a read out of bounds.
  const int32_t* tables = block_tables.typed_data();
  const int32_t* lens = context_lens.typed_data();
  for (int64_t row = 0; row < s.b; ++row) {
    const int64_t ctx = std::min<int64_t>(std::max<int32_t>(lens[row], 0), s.m * s.bs);
    for (int64_t j = 0; j < (ctx + s.bs - 1) / s.bs; ++j) {
      const int32_t blk = tables[row * s.m + j];
      if (blk < 0 || blk >= s.n) {
        return ffi::Error::InvalidArgument("paged decode: block id " + std::to_string(blk) + " of row " +
                                           std::to_string(row) + " outside the cache");
      }
    }
  }
  const float* qp = q.typed_data();
  const float* kp = k_cache.typed_data();
  const float* vp = v_cache.typed_data();
  const int32_t* tp = block_tables.typed_data();
  const int32_t* lp = context_lens.typed_data();
  float* op = out->typed_data();
  const int64_t n_threads = std::max<int64_t>(1, std::min<int64_t>(threads, s.b));
  auto work = [&](int64_t first) {
    std::vector<float> scores;
    for (int64_t row = first; row < s.b; row += n_threads) {
      one_row(s, qp, kp, vp, tp, lp, scale, op, row, scores);
    }
  };
  std::vector<std::thread> pool;
  for (int64_t t = 1; t < n_threads; ++t) pool.emplace_back(work, t);
  work(0);
  for (auto& th : pool) th.join();
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(QuicservePagedDecodeF32, PagedDecodeImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("scale")
                                  .Attr<int64_t>("threads"));
