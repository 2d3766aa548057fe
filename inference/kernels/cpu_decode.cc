// Paged-attention decode for CPU, called from JAX through the XLA FFI (see cpu_ffi.py).
//
// Why: on CPU the jnp reference runs as small XLA ops inside a run-time loop; they copy each
// sequence's blocks before reading them and never use a second core (measured: ~15-26 ms of a
// ~32-44 ms batch-32 step on two threads). This kernel reads each K/V row in place through the
// block table, once, and shares the sequences out over XLA's intra-op threads (cpu_parallel.h).
//
// Figures (bench model, 8 layers' caches, batch 32, contexts 100-200, scattered blocks, two
// threads): 8 calls took 5.4 ms (14.4 GB/s of K/V); with every row reading the same few blocks
// (no memory traffic) 2.6 ms before the 8-wide score and weighted-sum loops below, 1.5 ms
// after. The memory is the rest: a standalone loop reading 16 KB blocks in random order gets
// ~12 GB/s on one core and ~20.5 GB/s on two here (3.8 ms for these bytes; 2 MB pages add
// ~15%), and arithmetic and loads did not overlap (1.5 + 3.8 ~ 5.4). Prefetching the next
// block of the row, spread over the per-head weighted sums, brings it to 4.8-4.9 ms (16 GB/s);
// the whole next block at once, or two blocks ahead, did not help (5.0-5.3 ms).
//
// Contract (float32 only; the caller falls back to the reference otherwise):
//   q [B, H, D], k_cache / v_cache [N, BS, KV, D], block_tables [B, M] int32,
//   context_lens [B] int32, attributes scale (f32), window (i64)  ->  out [B, H, D].
// Query head h reads KV head h / (H / KV). Row b attends to positions 0 .. context_lens[b]-1,
// or with window > 0 only the last `window` of them (blocks before those are never read: the
// KV cache may have released them); a row with no context gets zeros. Softmax in float32,
// online over the blocks.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "cpu_parallel.h"
#include "cpu_simd.h"
#include "xla/ffi/api/ffi.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

namespace ffi = xla::ffi;
using quicserve::exp_nonpositive;

namespace {

struct Shapes {
  int64_t b, h, d, n, bs, kv, m;
};

// out[t] = q . k[t] for n rows k[t] = k + t * stride (D floats each).
// out_row[i] += sum over t < n of p[t] * v[t][i] for n rows v[t] = v + t * stride (D floats each).
#if defined(__AVX2__) && defined(__FMA__)
// Eight rows at a time with one accumulator each (independent FMA chains; one accumulator per
// dot product would wait on the FMA latency every 8 columns), reduced together by a
// transpose-add, so the 8 scores come out as one vector.
inline __m256 dot8(const float* q, const float* k, int64_t stride, int64_t d) {
  __m256 acc[8];
  for (int r = 0; r < 8; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t i = 0; i < d; i += 8) {
    const __m256 qv = _mm256_loadu_ps(q + i);
    for (int r = 0; r < 8; ++r) acc[r] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + r * stride + i), acc[r]);
  }
  const __m256 h01 = _mm256_hadd_ps(acc[0], acc[1]), h23 = _mm256_hadd_ps(acc[2], acc[3]);
  const __m256 h45 = _mm256_hadd_ps(acc[4], acc[5]), h67 = _mm256_hadd_ps(acc[6], acc[7]);
  const __m256 lo = _mm256_hadd_ps(h01, h23), hi = _mm256_hadd_ps(h45, h67);
  return _mm256_add_ps(_mm256_permute2f128_ps(lo, hi, 0x20), _mm256_permute2f128_ps(lo, hi, 0x31));
}

inline void scores(const float* q, const float* k, int64_t stride, int64_t d, int64_t n, float* out) {
  int64_t t = 0;
  if (d % 8 == 0) {
    for (; t + 8 <= n; t += 8) _mm256_storeu_ps(out + t, dot8(q, k + t * stride, stride, d));
  }
  for (; t < n; ++t) {
    float acc = 0.0f;
    for (int64_t i = 0; i < d; ++i) acc += q[i] * k[t * stride + i];
    out[t] = acc;
  }
}

// The output row is held in registers 64 floats at a time while every token's weight is added in.
inline void weighted_sum(const float* p, const float* v, int64_t stride, int64_t d, int64_t n, float* out) {
  int64_t i = 0;
  for (; i + 64 <= d; i += 64) {
    __m256 acc[8];
    for (int r = 0; r < 8; ++r) acc[r] = _mm256_loadu_ps(out + i + 8 * r);
    for (int64_t t = 0; t < n; ++t) {
      const __m256 pt = _mm256_set1_ps(p[t]);
      const float* vt = v + t * stride + i;
      for (int r = 0; r < 8; ++r) acc[r] = _mm256_fmadd_ps(pt, _mm256_loadu_ps(vt + 8 * r), acc[r]);
    }
    for (int r = 0; r < 8; ++r) _mm256_storeu_ps(out + i + 8 * r, acc[r]);
  }
  for (int64_t t = 0; t < n; ++t)
    for (int64_t j = i; j < d; ++j) out[j] += p[t] * v[t * stride + j];
}
#else
inline void scores(const float* q, const float* k, int64_t stride, int64_t d, int64_t n, float* out) {
  for (int64_t t = 0; t < n; ++t) {
    float acc = 0.0f;
    for (int64_t i = 0; i < d; ++i) acc += q[i] * k[t * stride + i];
    out[t] = acc;
  }
}

inline void weighted_sum(const float* p, const float* v, int64_t stride, int64_t d, int64_t n, float* out) {
  for (int64_t t = 0; t < n; ++t)
    for (int64_t j = 0; j < d; ++j) out[j] += p[t] * v[t * stride + j];
}
#endif

// One sequence, every head, in one pass over its blocks (online softmax): a block's K rows give
// the scores of its tokens for every head, the running max and denominator are updated, and its
// V rows are added into the output, weighted. A token's K (or V) for all KV heads is one
// contiguous row of KV*D floats and a block's rows are contiguous, so each block is two
// sequential streams, and the next block is prefetched a slice per head while this one is summed.
void one_row(const Shapes& s, const float* q, const float* kc, const float* vc, const int32_t* tables,
             const int32_t* lens, float scale, int64_t window, float* out, int64_t row, std::vector<float>& work) {
  const int64_t g = s.h / s.kv;
  const int64_t d = s.d;
  const int64_t h = s.h;
  const int64_t bs = s.bs;
  const int64_t width = s.kv * d;  // floats per token row
  float* o = out + row * h * d;
  const int64_t ctx = std::min<int64_t>(std::max<int32_t>(lens[row], 0), s.m * bs);
  std::fill(o, o + h * d, 0.0f);
  if (ctx == 0) return;
  work.resize(static_cast<size_t>(h * d + h * bs + 2 * h));
  float* qs = work.data();       // [h, d] queries, pre-scaled
  float* sc = qs + h * d;        // [h, bs] this block's scores, then weights
  float* mx = sc + h * bs;       // [h] running max
  float* denom = mx + h;         // [h] running sum of weights
  const float* qr = q + row * h * d;
  for (int64_t i = 0; i < h * d; ++i) qs[i] = qr[i] * scale;
  std::fill(mx, mx + h, std::numeric_limits<float>::lowest());
  std::fill(denom, denom + h, 0.0f);
  const int32_t* table = tables + row * s.m;
  const int64_t blocks = (ctx + bs - 1) / bs;
  const int64_t block_floats = bs * width;
  const int64_t lo = window > 0 ? std::max<int64_t>(0, ctx - window) : 0;  // first visible key
  for (int64_t j = lo / bs; j < blocks; ++j) {
    const float* kb = kc + static_cast<int64_t>(table[j]) * block_floats;
    const float* vb = vc + static_cast<int64_t>(table[j]) * block_floats;
    const float* kn = j + 1 < blocks ? kc + static_cast<int64_t>(table[j + 1]) * block_floats : nullptr;
    const float* vn = j + 1 < blocks ? vc + static_cast<int64_t>(table[j + 1]) * block_floats : nullptr;
    const int64_t pf_step = (block_floats + h - 1) / h;
    const int64_t n = std::min(bs, ctx - j * bs);
    for (int64_t hi = 0; hi < h; ++hi) scores(qs + hi * d, kb + (hi / g) * d, width, d, n, sc + hi * bs);
    for (int64_t t = 0; t < lo - j * bs; ++t)  // keys before the window (first block only)
      for (int64_t hi = 0; hi < h; ++hi) sc[hi * bs + t] = std::numeric_limits<float>::lowest();
    for (int64_t hi = 0; hi < h; ++hi) {
      float* p = sc + hi * bs;
      float m = mx[hi];
      for (int64_t t = 0; t < n; ++t) m = std::max(m, p[t]);
      const float corr = std::exp(mx[hi] - m);  // 0 on the first block
      mx[hi] = m;
      for (int64_t t = 0; t < n; ++t) p[t] -= m;
      exp_nonpositive(p, n);
      float sum = 0.0f;
      for (int64_t t = 0; t < n; ++t) sum += p[t];
      denom[hi] = denom[hi] * corr + sum;
      if (corr != 1.0f) {
        float* oo = o + hi * d;
        for (int64_t i = 0; i < d; ++i) oo[i] *= corr;
      }
    }
    for (int64_t hi = 0; hi < h; ++hi) {
      weighted_sum(sc + hi * bs, vb + (hi / g) * d, width, d, n, o + hi * d);
      if (kn != nullptr) {
        for (int64_t f = hi * pf_step; f < std::min(block_floats, (hi + 1) * pf_step); f += 16) {  // a line
          __builtin_prefetch(kn + f);
          __builtin_prefetch(vn + f);
        }
      }
    }
  }
  for (int64_t hi = 0; hi < h; ++hi) {
    const float inv = 1.0f / denom[hi];
    float* oo = o + hi * d;
    for (int64_t i = 0; i < d; ++i) oo[i] *= inv;
  }
}

ffi::Error PagedDecodeImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k_cache,
                           ffi::Buffer<ffi::F32> v_cache, ffi::Buffer<ffi::S32> block_tables, ffi::Buffer<ffi::S32> context_lens,
                           ffi::Result<ffi::Buffer<ffi::F32>> out, float scale, int64_t threads, int64_t window) {
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
    const int64_t lo = window > 0 ? std::max<int64_t>(0, ctx - window) : 0;
    for (int64_t j = lo / s.bs; j < (ctx + s.bs - 1) / s.bs; ++j) {
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
  quicserve::parallel_for(pool, s.b, threads, [&](int64_t row) {
    thread_local std::vector<float> work;
    one_row(s, qp, kp, vp, tp, lp, scale, window, op, row, work);
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(QuicservePagedDecodeF32, PagedDecodeImpl, quicserve::attention_binding());

// The softmax's exp as the kernels compile it, for the tests: they hold it to its error bound on
// every instruction-set level (the compiler may contract and vectorize it differently on each).
extern "C" void QuicserveExpNonpositive(float* x, int64_t n) { exp_nonpositive(x, n); }
