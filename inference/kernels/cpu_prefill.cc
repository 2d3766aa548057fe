// Causal prefill attention for CPU, called from JAX through the XLA FFI (see cpu_ffi.py).
//
// Why: on CPU the jnp online-softmax loop (attention.prefill_attention) runs as XLA einsums
// over whole key chunks, the masked half included, on one core: 7.4 ms of a 53.4 ms 128-token
// prefill call on the bench model, 67 of 225 ms at 512 tokens (tests/bench/bench_decode.py).
// This kernel visits only the key tiles a query tile can see, keeps the G query heads that
// share a KV head together so every key and value row read in place serves all of them, and
// shares the (row, KV head, query tile) chunks out over XLA's intra-op threads
// (cpu_parallel.h), the most expensive (latest) tiles first.
//
// Figures (bench model: 8 query / 4 KV heads, head dim 64; one sequence, no prefix; two
// threads, other work paused, best of 20). 8 layers' attention alone at 16 / 32 / 64 / 128 /
// 512 tokens: jnp 0.63 / 0.92 / 1.52 / 6.3 / 50.4 ms, this kernel 0.11 / 0.21 / 0.47 / 1.43 /
// 17.7 ms (95 and 122 GFLOP/s of useful work at 128 and 512; one thread 51 and 60, where an
// FMA-bound loop would do ~90). The whole prefill call (runner.execute, both paths in one
// process, interleaved, best of 10): 14.4 -> 12.2, 17.4 -> 16.1, 28.4 -> 27.1, 49.1 -> 44.6,
// 202 -> 164 ms; bench_decode's run_ours at batch 32: 3.18 -> 3.08 s, same greedy tokens.
// Steps that counted (one thread, 512 tokens): keys packed transposed per tile and per-query
// softmax rows 42.7 ms (the packing ~10%, a scalar row max ~5%); query vectors in the vector
// lanes instead (keys read in place, softmax a vector of queries at a time) 38.0; queries
// transposed through registers 8 x 8 instead of strided scalar stores 36.6. Key tiles of
// 32 or 128, and 32 or 96 query vectors per chunk, moved it by less than the noise (~3%).
// What is left besides the FMAs is the softmax (exp, masks, max), ~20% of the samples.
//
// The keys come gathered from the paged cache. QuicserveGatherLiveF32 does that gather for it:
//   k_cache / v_cache [NB, BS, KV, D], block_tables [B, M] int32, kv_lens [B] int32
//   ->  k, v [B, M * BS, KV, D]
// copying only the blocks that hold a row's first kv_lens[b] keys. The rest of each row is left
// unwritten: this kernel never reads past kv_lens, so no other consumer may be given them. XLA's
// gather of a row's whole table copies max_model_len keys per row and layer whatever the prompt's
// length (medium model of bench_prefix_cache, max_model_len 4096: a 16-token prefill 2.17 ms
// against 1.48 at max_model_len 512). Block ids are clamped into the cache (the runner checks them).
//
// Contract (float32 only; the caller falls back to the reference otherwise):
//   q [B, T, H, D], k / v [B, S, KV, D], q_offsets [B] int32, kv_lens [B] int32,
//   attributes scale (f32), threads (i64), window (i64)  ->  out [B, T, H, D].
// Query head h reads KV head h / (H / KV). Query t of row b sits at position p = q_offsets[b] + t
// and sees keys at positions <= p and < min(kv_lens[b], S), and with window > 0 only those
// > p - window (key tiles before a chunk's first query's window are skipped). A query at
// p >= kv_lens[b] is padding (past the sequence) and gets zeros, as does one that sees no key.
// Softmax in float32, online over the key tiles.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "cpu_parallel.h"
#include "cpu_simd.h"
#include "xla/ffi/api/ffi.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kKeyTile = 64;   // keys per online-softmax step
constexpr int64_t kTileRows = 48;  // query vectors (positions x heads of a group) per chunk, about
constexpr int64_t kLanes = 16;     // query vectors per score register tile (two vectors)
constexpr int kRegKeys = 6;        // keys per score register tile
constexpr int kRegRows = 6;        // query vectors per weighted-sum register tile
constexpr float kNoMax = -1e30f;   // running max before any key; masked scores are lower still

// One call's arrays (contract above) and shapes.
struct Call {
  int64_t b, t, h, d, s, kv;
  const float *q, *k, *v;
  const int32_t *offsets, *lens;
  float scale;
  float* out;
  int64_t window;  // 0: none
};

// Layouts inside a chunk (rp = query vectors rounded up to kLanes): queries transposed qt[D][rp],
// scores s[key][rp], so the keys are read in place and the softmax runs across query vectors, a
// vector at a time; outputs o[rp][D].
//
// scores_tile: s[c][0..16) = qt[.][0..16) . k[c] for KC keys k[c] = k + c * stride. Per head-dim
// step two query loads and KC key broadcasts feed 2*KC independent FMA chains.
// pv_tile: o[r] = o[r] * corr[r] + sum over c < n of s[c][r] * v[c] for R query vectors, the
// output tile (R vectors x 16 floats) held in registers over all n keys: per key two value loads
// and R broadcasts feed 2*R FMA chains.
#if defined(__AVX2__) && defined(__FMA__)
template <int KC>
void scores_tile(const float* qt, int64_t rp, const float* k, int64_t stride, int64_t d, float* s) {
  __m256 acc[KC][2];
  for (int c = 0; c < KC; ++c) acc[c][0] = acc[c][1] = _mm256_setzero_ps();
  for (int64_t i = 0; i < d; ++i) {
    const __m256 q0 = _mm256_loadu_ps(qt + i * rp), q1 = _mm256_loadu_ps(qt + i * rp + 8);
    for (int c = 0; c < KC; ++c) {
      const __m256 kb = _mm256_broadcast_ss(k + c * stride + i);
      acc[c][0] = _mm256_fmadd_ps(kb, q0, acc[c][0]);
      acc[c][1] = _mm256_fmadd_ps(kb, q1, acc[c][1]);
    }
  }
  for (int c = 0; c < KC; ++c) {
    _mm256_storeu_ps(s + c * rp, acc[c][0]);
    _mm256_storeu_ps(s + c * rp + 8, acc[c][1]);
  }
}

template <int R>
void pv_tile(const float* s, int64_t rp, const float* corr, const float* v, int64_t stride, int64_t d, int64_t n,
             float* o) {
  int64_t j = 0;
  for (; j + 16 <= d; j += 16) {
    __m256 acc[R][2];
    for (int r = 0; r < R; ++r) {
      const __m256 cr = _mm256_set1_ps(corr[r]);
      acc[r][0] = _mm256_mul_ps(cr, _mm256_loadu_ps(o + r * d + j));
      acc[r][1] = _mm256_mul_ps(cr, _mm256_loadu_ps(o + r * d + j + 8));
    }
    for (int64_t c = 0; c < n; ++c) {
      const __m256 v0 = _mm256_loadu_ps(v + c * stride + j), v1 = _mm256_loadu_ps(v + c * stride + j + 8);
      for (int r = 0; r < R; ++r) {
        const __m256 pb = _mm256_broadcast_ss(s + c * rp + r);
        acc[r][0] = _mm256_fmadd_ps(pb, v0, acc[r][0]);
        acc[r][1] = _mm256_fmadd_ps(pb, v1, acc[r][1]);
      }
    }
    for (int r = 0; r < R; ++r) {
      _mm256_storeu_ps(o + r * d + j, acc[r][0]);
      _mm256_storeu_ps(o + r * d + j + 8, acc[r][1]);
    }
  }
  for (; j + 8 <= d; j += 8) {
    __m256 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_mul_ps(_mm256_set1_ps(corr[r]), _mm256_loadu_ps(o + r * d + j));
    for (int64_t c = 0; c < n; ++c) {
      const __m256 v0 = _mm256_loadu_ps(v + c * stride + j);
      for (int r = 0; r < R; ++r) acc[r] = _mm256_fmadd_ps(_mm256_broadcast_ss(s + c * rp + r), v0, acc[r]);
    }
    for (int r = 0; r < R; ++r) _mm256_storeu_ps(o + r * d + j, acc[r]);
  }
  for (int r = 0; r < R; ++r) {
    for (int64_t i = j; i < d; ++i) {
      float acc = o[r * d + i] * corr[r];
      for (int64_t c = 0; c < n; ++c) acc += s[c * rp + r] * v[c * stride + i];
      o[r * d + i] = acc;
    }
  }
}
#else
template <int KC>
void scores_tile(const float* qt, int64_t rp, const float* k, int64_t stride, int64_t d, float* s) {
  for (int c = 0; c < KC; ++c) {
    float acc[kLanes] = {};
    for (int64_t i = 0; i < d; ++i)
      for (int64_t r = 0; r < kLanes; ++r) acc[r] += qt[i * rp + r] * k[c * stride + i];
    std::copy(acc, acc + kLanes, s + c * rp);
  }
}

template <int R>
void pv_tile(const float* s, int64_t rp, const float* corr, const float* v, int64_t stride, int64_t d, int64_t n,
             float* o) {
  for (int r = 0; r < R; ++r) {
    float* oo = o + r * d;
    for (int64_t i = 0; i < d; ++i) oo[i] *= corr[r];
    for (int64_t c = 0; c < n; ++c)
      for (int64_t i = 0; i < d; ++i) oo[i] += s[c * rp + r] * v[c * stride + i];
  }
}
#endif

// dst[j * ld + r] = src[r][j] * scale for r < m <= 8, j < d: eight query vectors into the
// transposed layout, 8 x 8 blocks at a time through registers (strided scalar stores cost ~5%).
inline void transpose_scaled(const float* const* src, int64_t m, int64_t d, float scale, float* dst, int64_t ld) {
  int64_t j = 0;
#if defined(__AVX2__) && defined(__FMA__)
  if (m == 8) {
    const __m256 sc = _mm256_set1_ps(scale);
    for (; j + 8 <= d; j += 8) {
      __m256 r[8], t[8];
      for (int i = 0; i < 8; ++i) r[i] = _mm256_mul_ps(sc, _mm256_loadu_ps(src[i] + j));
      for (int i = 0; i < 8; i += 2) {
        t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
      }
      for (int i = 0; i < 8; i += 4) {
        r[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
        r[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);
        r[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
        r[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
      }
      for (int i = 0; i < 4; ++i) {
        _mm256_storeu_ps(dst + (j + i) * ld, _mm256_permute2f128_ps(r[i], r[i + 4], 0x20));
        _mm256_storeu_ps(dst + (j + i + 4) * ld, _mm256_permute2f128_ps(r[i], r[i + 4], 0x31));
      }
    }
  }
#endif
  for (; j < d; ++j)
    for (int64_t r = 0; r < m; ++r) dst[j * ld + r] = src[r][j] * scale;
}

// Scores of query vectors [r0, rp) (r0 a multiple of kLanes) against keys [0, n) of the tile.
void scores(const float* qt, int64_t rp, int64_t r0, const float* k, int64_t stride, int64_t d, int64_t n, float* s) {
  for (int64_t r = r0; r < rp; r += kLanes) {
    int64_t c = 0;
    for (; c + kRegKeys <= n; c += kRegKeys) scores_tile<kRegKeys>(qt + r, rp, k + c * stride, stride, d, s + c * rp + r);
    const float* kc = k + c * stride;
    float* sc = s + c * rp + r;
    switch (n - c) {
      case 5: scores_tile<5>(qt + r, rp, kc, stride, d, sc); break;
      case 4: scores_tile<4>(qt + r, rp, kc, stride, d, sc); break;
      case 3: scores_tile<3>(qt + r, rp, kc, stride, d, sc); break;
      case 2: scores_tile<2>(qt + r, rp, kc, stride, d, sc); break;
      case 1: scores_tile<1>(qt + r, rp, kc, stride, d, sc); break;
      default: break;
    }
  }
}

// Weighted sums into outputs [r0, r1) in register tiles of kRegRows query vectors, the last narrower.
void weighted_sums(const float* s, int64_t rp, const float* corr, int64_t r0, int64_t r1, const float* v,
                   int64_t stride, int64_t d, int64_t n, float* o) {
  for (int64_t r = r0; r < r1; r += kRegRows) {
    const float* sr = s + r;
    const float* cr = corr + r;
    float* orow = o + r * d;
    switch (std::min<int64_t>(kRegRows, r1 - r)) {
      case 6: pv_tile<6>(sr, rp, cr, v, stride, d, n, orow); break;
      case 5: pv_tile<5>(sr, rp, cr, v, stride, d, n, orow); break;
      case 4: pv_tile<4>(sr, rp, cr, v, stride, d, n, orow); break;
      case 3: pv_tile<3>(sr, rp, cr, v, stride, d, n, orow); break;
      case 2: pv_tile<2>(sr, rp, cr, v, stride, d, n, orow); break;
      default: pv_tile<1>(sr, rp, cr, v, stride, d, n, orow); break;
    }
  }
}

// Scratch of one chunk: its queries (pre-scaled, transposed), output accumulators, one key tile's
// scores (then weights), and per query vector the key limit, running max, running sum and this
// tile's correction factor.
struct Work {
  std::vector<float> buf;
  std::vector<int32_t> lim, low;  // per query vector: keys [low, lim) are visible
  float *qt, *o, *s, *mx, *den, *corr;
  void reserve(int64_t rp, int64_t d) {
    buf.resize(static_cast<size_t>(2 * rp * d + rp * kKeyTile + 3 * rp));
    lim.resize(static_cast<size_t>(rp));
    low.resize(static_cast<size_t>(rp));
    qt = buf.data();
    o = qt + rp * d;
    s = o + rp * d;
    mx = s + rp * kKeyTile;
    den = mx + rp;
    corr = den + rp;
  }
};

// One chunk: positions [t0, t1) of row b, the g query heads of KV head kvh. Query vector i is
// position t0 + i / g, head kvh * g + i % g, so the key limits never decrease with i up to the
// last real query (padding queries come last): the vectors a key tile reaches are a suffix of
// the real ones, and only those (from the enclosing kLanes group on) are computed.
// kWindowed: the call has a sliding window (compiled apart, so the loops without one are as before).
template <bool kWindowed>
void one_chunk(const Call& call, int64_t b, int64_t kvh, int64_t t0, int64_t t1, Work& w) {
  const int64_t g = call.h / call.kv, d = call.d;
  const int64_t rows = (t1 - t0) * g;
  const int64_t rp = (rows + kLanes - 1) / kLanes * kLanes;
  const int64_t kv_len = std::min<int64_t>(std::max<int32_t>(call.lens[b], 0), call.s);
  const int64_t off = call.offsets[b];
  const int64_t kstride = call.kv * d;  // floats between consecutive keys of one head
  const float* kb = call.k + b * call.s * kstride + kvh * d;
  const float* vb = call.v + b * call.s * kstride + kvh * d;
  w.reserve(rp, d);
  std::fill(w.qt, w.qt + rp * d, 0.0f);
  std::fill(w.lim.begin(), w.lim.end(), 0);
  if (kWindowed) std::fill(w.low.begin(), w.low.end(), 0);
  int64_t real = 0, reach = 0;  // real query vectors (a prefix), keys the last of them sees
  for (int64_t i = 0; i < rows; ++i) {
    const int64_t pos = off + t0 + i / g;
    w.lim[i] = static_cast<int32_t>(pos < kv_len ? std::max<int64_t>(pos + 1, 0) : 0);
    if (kWindowed) w.low[i] = static_cast<int32_t>(std::max<int64_t>(pos + 1 - call.window, 0));
    if (w.lim[i] > 0) real = i + 1, reach = w.lim[i];
  }
  const float* q0 = call.q + ((b * call.t + t0) * call.h + kvh * g) * d;
  for (int64_t i = 0; i < rows; i += 8) {  // query vector i is at q0 + (i / g * h + i % g) * d
    const int64_t m = std::min<int64_t>(8, rows - i);
    const float* src[8];
    for (int64_t r = 0; r < m; ++r) src[r] = q0 + ((i + r) / g * call.h + (i + r) % g) * d;
    transpose_scaled(src, m, d, call.scale, w.qt + i, rp);
  }
  std::fill(w.o, w.o + rp * d, 0.0f);
  std::fill(w.mx, w.mx + rp, kNoMax);
  std::fill(w.den, w.den + rp, 0.0f);
  int64_t first = 0;  // first query vector that sees the current tile
  for (int64_t c0 = kWindowed ? w.low[0] / kKeyTile * kKeyTile : 0; c0 < reach; c0 += kKeyTile) {
    const int64_t n = std::min(kKeyTile, reach - c0);
    while (w.lim[first] <= c0) ++first;
    const int64_t f = first / kLanes * kLanes;
    scores(w.qt, rp, f, kb + c0 * kstride, kstride, d, n, w.s);
    // Online softmax across query vectors (plain loops over r: the compiler vectorizes them).
    float* mx = w.mx;
    float* corr = w.corr;
    const int32_t* lim = w.lim.data();
    const int32_t* low = w.low.data();
    for (int64_t r = f; r < rp; ++r) corr[r] = mx[r];
    for (int64_t c = 0; c < n; ++c) {
      float* sc = w.s + c * rp;
      const int32_t key = static_cast<int32_t>(c0 + c);
      for (int64_t r = f; r < rp; ++r) {
        sc[r] = key < lim[r] && (!kWindowed || key >= low[r]) ? sc[r] : std::numeric_limits<float>::lowest();
        mx[r] = std::max(mx[r], sc[r]);
      }
    }
    for (int64_t r = f; r < rp; ++r) corr[r] -= mx[r];
    quicserve::exp_nonpositive(corr + f, rp - f);  // 1 while a vector has seen no key, 0 at its first
    for (int64_t r = f; r < rp; ++r) w.den[r] *= corr[r];
    for (int64_t c = 0; c < n; ++c) {
      float* sc = w.s + c * rp;
      for (int64_t r = f; r < rp; ++r) sc[r] -= mx[r];
      quicserve::exp_nonpositive(sc + f, rp - f);
      for (int64_t r = f; r < rp; ++r) w.den[r] += sc[r];
    }
    weighted_sums(w.s, rp, corr, first, real, vb + c0 * kstride, kstride, d, n, w.o);
  }
  for (int64_t i = 0; i < rows; ++i) {
    float* oi = call.out + ((b * call.t + t0 + i / g) * call.h + kvh * g + i % g) * d;
    const float inv = w.den[i] > 0.0f ? 1.0f / w.den[i] : 0.0f;
    for (int64_t j = 0; j < d; ++j) oi[j] = w.o[i * d + j] * inv;
  }
}

ffi::Error PrefillImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                       ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::S32> q_offsets, ffi::Buffer<ffi::S32> kv_lens,
                       ffi::Result<ffi::Buffer<ffi::F32>> out, float scale, int64_t threads, int64_t window) {
  auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions();
  if (qd.size() != 4 || kd.size() != 4 || vd.size() != 4 || q_offsets.dimensions().size() != 1 ||
      kv_lens.dimensions().size() != 1) {
    return ffi::Error::InvalidArgument("prefill: q must be [B,T,H,D], k and v [B,S,KV,D], q_offsets and kv_lens [B]");
  }
  const Call call{qd[0], qd[1], qd[2], qd[3], kd[1], kd[2], q.typed_data(), k.typed_data(), v.typed_data(),
                  q_offsets.typed_data(), kv_lens.typed_data(), scale, out->typed_data(), window};
  bool same_kv = true;
  for (size_t i = 0; i < 4; ++i) same_kv = same_kv && kd[i] == vd[i];
  if (kd[0] != call.b || kd[3] != call.d || !same_kv || call.kv == 0 || call.h % call.kv != 0 ||
      q_offsets.dimensions()[0] != call.b || kv_lens.dimensions()[0] != call.b) {
    return ffi::Error::InvalidArgument("prefill: inconsistent shapes");
  }
  const int64_t g = call.h / call.kv;
  const int64_t tq = std::max<int64_t>(1, kTileRows / g);  // positions per chunk
  const int64_t tiles = (call.t + tq - 1) / tq;
  const int64_t per_tile = call.b * call.kv;
  // Later query tiles see more keys: hand them out first so the cheap ones fill in at the end.
  quicserve::parallel_for(pool, tiles * per_tile, threads, [&](int64_t chunk) {
    thread_local Work work;
    const int64_t tile = tiles - 1 - chunk / per_tile;
    const int64_t b = chunk % per_tile / call.kv, kvh = chunk % call.kv;
    if (call.window > 0) {
      one_chunk<true>(call, b, kvh, tile * tq, std::min(call.t, (tile + 1) * tq), work);
    } else {
      one_chunk<false>(call, b, kvh, tile * tq, std::min(call.t, (tile + 1) * tq), work);
    }
  });
  return ffi::Error::Success();
}

ffi::Error GatherLiveImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> k_cache, ffi::Buffer<ffi::F32> v_cache,
                          ffi::Buffer<ffi::S32> block_tables, ffi::Buffer<ffi::S32> kv_lens,
                          ffi::Result<ffi::Buffer<ffi::F32>> k, ffi::Result<ffi::Buffer<ffi::F32>> v,
                          int64_t threads) {
  auto cd = k_cache.dimensions(), vd = v_cache.dimensions(), td = block_tables.dimensions();
  auto kd = k->dimensions(), od = v->dimensions();
  bool ok = cd.size() == 4 && vd.size() == 4 && td.size() == 2 && kv_lens.dimensions().size() == 1 &&
            kd.size() == 4 && od.size() == 4;
  for (size_t i = 0; ok && i < 4; ++i) ok = cd[i] == vd[i] && kd[i] == od[i];
  if (!ok || cd[0] == 0 || kv_lens.dimensions()[0] != td[0] || kd[0] != td[0] || kd[1] != td[1] * cd[1] ||
      kd[2] != cd[2] || kd[3] != cd[3]) {
    return ffi::Error::InvalidArgument(
        "gather_live: caches [NB,BS,KV,D], block_tables [B,M], kv_lens [B] -> [B,M*BS,KV,D]: inconsistent shapes");
  }
  const int64_t b = td[0], m = td[1], nb = cd[0], bs = cd[1];
  const int64_t block_floats = bs * cd[2] * cd[3];
  const int32_t* tables = block_tables.typed_data();
  const int32_t* lens = kv_lens.typed_data();
  const float* kc = k_cache.typed_data();
  const float* vc = v_cache.typed_data();
  float* ko = k->typed_data();
  float* vo = v->typed_data();
  quicserve::parallel_for(pool, b * m, threads, [&](int64_t task) {
    const int64_t row = task / m, j = task % m;
    if (j * bs >= std::max<int32_t>(lens[row], 0)) return;  // no key of this row lies in block j
    const int64_t blk = std::clamp<int64_t>(tables[task], 0, nb - 1);
    std::memcpy(ko + task * block_floats, kc + blk * block_floats, sizeof(float) * block_floats);
    std::memcpy(vo + task * block_floats, vc + blk * block_floats, sizeof(float) * block_floats);
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(QuicservePrefillF32, PrefillImpl, quicserve::attention_binding());
XLA_FFI_DEFINE_HANDLER_SYMBOL(QuicserveGatherLiveF32, GatherLiveImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // k_cache
                                  .Arg<ffi::Buffer<ffi::F32>>()  // v_cache
                                  .Arg<ffi::Buffer<ffi::S32>>()  // block_tables
                                  .Arg<ffi::Buffer<ffi::S32>>()  // kv_lens
                                  .Ret<ffi::Buffer<ffi::F32>>()  // k
                                  .Ret<ffi::Buffer<ffi::F32>>()  // v
                                  .Attr<int64_t>("threads"));
