// y = x @ W.T on CPU for float32 projections whose W is stored packed for this kernel, called
// from JAX through the XLA FFI (see cpu_ffi.py; the packing is inference.model.llama.pack_weight).
//
// Why: the projections are most of a step. XLA:CPU runs them as a dot (prefill) or, for a few
// rows, a broadcast multiply-reduce (decode); in the bench model's 8-layer chain that is
// 13.7 ms at 32 rows (~128 GFLOP/s on two threads) and 7.8 ms at 8 rows, where the weights
// streamed from memory (110 MB a step, ~5.5 ms at the ~20 GB/s two cores read here) and the
// arithmetic (9.2 ms at 32 rows at the ~190 GFLOP/s peak) run one after the other. Prefill
// calls of 16-128 tokens reached 68-136 GFLOP/s.
//
// How: the classic register-blocked GEMM (BLIS/GotoBLAS). W [N, K] is stored once, at load, as
// panels of 16 output columns, [ceil(N/16), K, 16] (zero-padded), so the kernel reads each
// panel as one contiguous stream; x is packed per call as tiles of up to 6 rows, [ceil(M/6), K, 6],
// the rows spread evenly over the tiles.
// A 6 x 16 register tile (12 accumulators of 8 lanes) takes, per k, two 8-wide loads of the
// panel, six broadcasts of x and twelve FMAs, with no horizontal sums. While one panel is
// multiplied the next is prefetched, a line every few k, so the weight stream overlaps the
// arithmetic. Panels are shared out over XLA's intra-op threads (cpu_parallel.h) in runs of a
// few, so a run's panels after the first arrive prefetched.
//
// Measured (standalone chain of the bench model's 33 projections, weights streamed, two
// threads): 32 rows 11.8 ms (149 GFLOP/s) against XLA's 13.7; 16 rows 7.9 (9.4); 8 rows 6.6
// (7.8); 64-256 rows 179-190 GFLOP/s, against 136-159 for XLA's dot in prefill calls. Without
// the prefetch: 14.7 / 9.6 / 8.1 ms. Rows spread evenly over the tiles instead of full tiles and a
// short last one (same chain, best of 40): 32 rows 11.20 -> 10.73 ms, 8 rows 5.22 -> 5.04, 80 rows
// 25.6 -> 24.9; 24, 128 and 256 rows (whole tiles either way) unchanged.
//
// Live rows and fusions. A call multiplies only the rows that hold tokens: a prefill's rows past
// each sequence's length and a decode step's rows past the batch are a shape bucket's padding
// (11% of the decode bench's prefill tokens, 245 of 2672 decode rows), skipped and written as
// zeros. The RMSNorm before q|k|v, gate|up and the head, the SwiGLU before w_down and the
// residual adds after wo and w_down run inside the call (on x as it is packed, on y as it is
// stored) instead of as XLA ops between calls. The pack and the panels are one hand-off to the
// pool (cpu_parallel.h parallel_two_phase). bench_decode's batch-32 run, our side, quiet,
// best of 4-5, against the unfused calls over every row: prefill 0.86-0.90 -> 0.78-0.84 s,
// decode 1.60-1.62 -> 1.50-1.52 s. A full bucket's decode step is unchanged (17.2-17.4 ms at
// batch 32): there the XLA ops removed (~0.5 ms of thunks) were not on the step's critical path
// in any way the fused calls could take back. With the pack on one thread and a hand-off of its
// own after it, decode was 1.52-1.60 s (a woken pool thread arriving late, it seems).
//
// Contract: x [M, K] f32 ([M, 2K] = gate | up with SwiGLU), w [P, K, 16] f32 with P = ceil(N / 16),
// live [G] s32 (x's rows are G groups of M / G, the first live[g] of group g real), out y [M, N]
// f32 (N taken from the result's shape, columns past N in the last panel are zero padding and never
// written); the norm weight [K] or the residual [M, N] f32 where fused.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "cpu_parallel.h"
#include "cpu_simd.h"
#include "xla/ffi/api/ffi.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

namespace ffi = xla::ffi;

namespace {

constexpr int kMR = 6;   // rows of x per register tile
constexpr int kNR = 16;  // columns of W per panel (two 8-lane vectors)

// Where results go: computed row i (x's live rows, packed in order) is row rows[i] of y, and of
// the residual when there is one (both [M, ld]).
struct Out {
  float* y;
  const float* res;
  const int64_t* rows;
  int64_t ld;
};

// A finished register tile (computed rows m0 .. m0+mr-1, columns n0 .. n0+nr-1) into y.
template <typename Tile>
inline void store(const Tile& buf, const Out& out, int64_t m0, int64_t n0, int64_t mr, int64_t nr) {
  for (int64_t i = 0; i < std::min<int64_t>(mr, std::extent<Tile>::value); ++i) {
    const int64_t at = out.rows[m0 + i] * out.ld + n0;
    if (out.res == nullptr) {
      std::memcpy(out.y + at, buf[i], sizeof(float) * nr);
    } else {
      for (int64_t j = 0; j < nr; ++j) out.y[at + j] = out.res[at + j] + buf[i][j];
    }
  }
}

#if defined(__AVX2__) && defined(__FMA__)
// Rows of y of computed rows m0 .. m0+mr-1, columns n0 .. n0+nr-1 = xt[K][6] . panel[K][16] (+ res);
// prefetches `pf_lines` lines of `pf` (the next panel's share for this tile), one every `pf_every` k.
template <int MR>
void tile(const float* xt, const float* panel, int64_t K, const Out& out, int64_t m0, int64_t n0, int64_t mr,
          int64_t nr, const float* pf, int64_t pf_every) {
  __m256 acc[MR][2];
#pragma GCC unroll 6
  for (int i = 0; i < MR; ++i) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
  int64_t next_pf = 0;
  for (int64_t k = 0; k < K; ++k) {
    const __m256 w0 = _mm256_loadu_ps(panel + k * kNR);
    const __m256 w1 = _mm256_loadu_ps(panel + k * kNR + 8);
    if (pf != nullptr && k == next_pf) {
      _mm_prefetch(reinterpret_cast<const char*>(pf), _MM_HINT_T0);
      pf += kNR;
      next_pf += pf_every;
    }
    const float* xk = xt + k * kMR;
#pragma GCC unroll 6
    for (int i = 0; i < MR; ++i) {
      const __m256 a = _mm256_broadcast_ss(xk + i);
      acc[i][0] = _mm256_fmadd_ps(a, w0, acc[i][0]);
      acc[i][1] = _mm256_fmadd_ps(a, w1, acc[i][1]);
    }
  }
  // Stored with constant indices first: reading acc[i] under the run-time bound `mr` would make
  // the compiler keep the accumulators in memory, a store per FMA pair (measured 1.6x slower).
  alignas(32) float buf[MR][kNR];
#pragma GCC unroll 6
  for (int i = 0; i < MR; ++i) {
    _mm256_store_ps(buf[i], acc[i][0]);
    _mm256_store_ps(buf[i] + 8, acc[i][1]);
  }
  store(buf, out, m0, n0, mr, nr);
}
#else
template <int MR>
void tile(const float* xt, const float* panel, int64_t K, const Out& out, int64_t m0, int64_t n0, int64_t mr,
          int64_t nr, const float*, int64_t) {
  float acc[MR][kNR] = {};
  for (int64_t k = 0; k < K; ++k)
    for (int i = 0; i < MR; ++i)
      for (int j = 0; j < kNR; ++j) acc[i][j] += xt[k * kMR + i] * panel[k * kNR + j];
  store(acc, out, m0, n0, mr, nr);
}
#endif

// Row tiles of x: ceil(M / 6) of them, the rows spread evenly (the first M % tiles one row taller),
// so no tile is much shorter than 6. A tile of r rows keeps 2r FMA chains busy; below ~5 rows
// the FMA latency, not the FMA units, bounds it, so 32 rows as 6+6+5+5+5+5 take ~32 tile-rows of
// time against ~35 as 6+6+6+6+6+2. Rows [m0, m0 + mr) of tile t.
struct RowTiles {
  int64_t tiles, base, extra;
  explicit RowTiles(int64_t M) : tiles((M + kMR - 1) / kMR), base(M / tiles), extra(M % tiles) {}
  int64_t start(int64_t t) const { return t * base + std::min(t, extra); }
  int64_t rows(int64_t t) const { return base + (t < extra ? 1 : 0); }
};

// Every row tile of x against one panel (columns n0 .. n0+nr-1 of y), prefetching `next`.
void panel_rows(const float* xpack, const float* panel, const float* next, int64_t M, int64_t N, int64_t K,
                int64_t n0, const Out& out) {
  const RowTiles rt(M);
  const int64_t tiles = rt.tiles;
  const int64_t nr = std::min<int64_t>(kNR, N - n0);
  const int64_t share = (K + tiles - 1) / tiles;  // the next panel's lines (one per k) this tile fetches
  for (int64_t t = 0; t < tiles; ++t) {
    const int64_t m0 = rt.start(t), mr = rt.rows(t);
    const float* pf = next == nullptr || t * share >= K ? nullptr : next + t * share * kNR;
    const int64_t every = std::max<int64_t>(1, K / std::max<int64_t>(1, std::min(share, K - t * share)));
    const float* xt = xpack + t * K * kMR;
    switch (mr) {  // a short tile: fewer accumulators, not wasted rows
      case 6: tile<6>(xt, panel, K, out, m0, n0, mr, nr, pf, every); break;
      case 5: tile<5>(xt, panel, K, out, m0, n0, mr, nr, pf, every); break;
      case 4: tile<4>(xt, panel, K, out, m0, n0, mr, nr, pf, every); break;
      case 3: tile<3>(xt, panel, K, out, m0, n0, mr, nr, pf, every); break;
      case 2: tile<2>(xt, panel, K, out, m0, n0, mr, nr, pf, every); break;
      default: tile<1>(xt, panel, K, out, m0, n0, mr, nr, pf, every); break;
    }
  }
}

// What a call does besides the product: to each row of x as it is packed (an RMSNorm, or SwiGLU of a
// gate | up row) and to y as it is stored (a residual added). Fusing them saves XLA:CPU a pass over
// the activations and an op's dispatch each: per layer two norms (a reduce and a scale each), the
// SwiGLU and two residual adds.
struct Fusion {
  const float* norm = nullptr;      // [K]: row -> norm * (row * rsqrt(mean(row^2) + eps))
  float eps = 0.0f;
  bool swiglu = false;              // row [2K] = gate | up -> silu(gate) * up, silu(g) = g * sigmoid(g)
  const float* residual = nullptr;  // [M, N], added to the product
};

// Row `row` of x after the prologue: `src` itself, or `tmp` (K floats) holding it.
// Not inlined: inlined into Matmul's loops, GCC left the copy that runs unvectorized (a norm of 32 x 512
// took 25 us instead of 3).
__attribute__((noinline)) const float* prologue(const float* src, int64_t K, const Fusion& f, float* tmp) {
  if (f.norm != nullptr) {
    float ss = 0.0f;
    for (int64_t k = 0; k < K; ++k) ss += src[k] * src[k];
    const float inv = 1.0f / std::sqrt(ss / static_cast<float>(K) + f.eps);
    for (int64_t k = 0; k < K; ++k) tmp[k] = f.norm[k] * (src[k] * inv);
    return tmp;
  }
  if (f.swiglu) {  // sigmoid(g) from e = exp(-|g|): 1 / (1 + e) for g >= 0, e / (1 + e) below
    const float* up = src + K;
    for (int64_t k = 0; k < K; ++k) tmp[k] = -std::abs(src[k]);
    quicserve::exp_nonpositive(tmp, K);
    for (int64_t k = 0; k < K; ++k) {
      const float e = tmp[k], g = src[k];
      const float sig = (g >= 0.0f ? 1.0f : e) / (1.0f + e);
      tmp[k] = g * sig * up[k];
    }
    return tmp;
  }
  return src;
}

// y = x' @ W.T (+ residual) for the live rows of x: x's M rows are G groups of M / G (a prefill's
// sequences, or a decode step's rows, one each), and group g's first live[g] rows are computed;
// the rest are padding (a shape bucket's), skipped, and their rows of y set to zero.
ffi::Error Matmul(ffi::ThreadPool& pool, ffi::Buffer<ffi::F32>& x, ffi::Buffer<ffi::F32>& w,
                  ffi::Buffer<ffi::S32>& live, ffi::Result<ffi::Buffer<ffi::F32>>& y, int64_t threads,
                  const Fusion& f) {
  auto xd = x.dimensions();
  auto wd = w.dimensions();
  auto yd = y->dimensions();
  const int64_t width = f.swiglu ? 2 : 1;  // x's row is K floats, or gate | up of K each
  if (xd.size() != 2 || wd.size() != 3 || yd.size() != 2 || wd[2] != kNR || wd[1] * width != xd[1] ||
      yd[0] != xd[0] || (yd[1] + kNR - 1) / kNR != wd[0]) {
    return ffi::Error::InvalidArgument(
        f.swiglu ? "matmul_packed: x must be [M, 2K], w [ceil(N/16), K, 16], y [M, N]"
                 : "matmul_packed: x must be [M, K], w [ceil(N/16), K, 16], y [M, N]");
  }
  const int64_t M = xd[0], K = wd[1], N = yd[1], P = wd[0];
  const int64_t G = live.dimensions().size() == 1 ? live.dimensions()[0] : 0;
  if (G == 0 || M % G != 0) {
    return ffi::Error::InvalidArgument("matmul_packed: live must be [G], G dividing x's rows");
  }
  float* yp = y->typed_data();
  std::vector<int64_t> rows;  // the live rows of x, in order
  rows.reserve(static_cast<size_t>(M));
  const int64_t per = M / G;
  for (int64_t g = 0; g < G; ++g) {
    const int64_t n = std::clamp<int64_t>(live.typed_data()[g], 0, per);
    for (int64_t i = g * per; i < g * per + n; ++i) rows.push_back(i);
    std::memset(yp + (g * per + n) * N, 0, sizeof(float) * (per - n) * N);
  }
  const int64_t Mv = static_cast<int64_t>(rows.size());
  if (Mv == 0 || N == 0) return ffi::Error::Success();
  const Out out{yp, f.residual, rows.data(), N};
  if (K == 0) {
    for (int64_t i : rows)
      for (int64_t j = 0; j < N; ++j) yp[i * N + j] = f.residual == nullptr ? 0.0f : f.residual[i * N + j];
    return ffi::Error::Success();
  }
  const float* xp = x.typed_data();
  const float* wp = w.typed_data();
  const RowTiles rt(Mv);
  std::vector<float> xpack(static_cast<size_t>(rt.tiles * K * kMR), 0.0f);
  auto pack = [&](int64_t t) {
    thread_local std::vector<float> tmp;
    tmp.resize(static_cast<size_t>(K));
    for (int64_t i = 0; i < rt.rows(t); ++i) {
      const float* row = prologue(xp + rows[rt.start(t) + i] * K * width, K, f, tmp.data());
      float* dst = xpack.data() + t * K * kMR + i;
      for (int64_t k = 0; k < K; ++k) dst[k * kMR] = row[k];
    }
  };
  // Runs of panels: enough runs for every thread to take a few, each run long enough that most
  // of its panels arrive prefetched.
  const int64_t run = std::clamp<int64_t>(P / (4 * std::max<int64_t>(1, threads)), 1, 8);
  const int64_t runs = (P + run - 1) / run;
  quicserve::parallel_two_phase(pool, rt.tiles, runs, threads, pack, [&](int64_t r) {
    const int64_t p1 = std::min(P, (r + 1) * run);
    for (int64_t p = r * run; p < p1; ++p) {
      const float* next = p + 1 < p1 ? wp + (p + 1) * K * kNR : nullptr;
      panel_rows(xpack.data(), wp + p * K * kNR, next, Mv, N, K, p * kNR, out);
    }
  });
  return ffi::Error::Success();
}

ffi::Error MatmulPackedImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                            ffi::Buffer<ffi::S32> live, ffi::Result<ffi::Buffer<ffi::F32>> y,
                            int64_t threads) {
  return Matmul(pool, x, w, live, y, threads, Fusion{});
}

ffi::Error MatmulPackedNormImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                                ffi::Buffer<ffi::S32> live, ffi::Buffer<ffi::F32> norm,
                                ffi::Result<ffi::Buffer<ffi::F32>> y, float eps, int64_t threads) {
  if (norm.dimensions().size() != 1 || norm.dimensions()[0] != x.dimensions().back()) {
    return ffi::Error::InvalidArgument("matmul_packed: the norm weight must be [K]");
  }
  Fusion f;
  f.norm = norm.typed_data();
  f.eps = eps;
  return Matmul(pool, x, w, live, y, threads, f);
}

ffi::Error MatmulPackedResidualImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                                    ffi::Buffer<ffi::S32> live, ffi::Buffer<ffi::F32> residual,
                                    ffi::Result<ffi::Buffer<ffi::F32>> y, int64_t swiglu, int64_t threads) {
  auto rd = residual.dimensions(), yd = y->dimensions();
  if (rd.size() != 2 || yd.size() != 2 || rd[0] != yd[0] || rd[1] != yd[1]) {
    return ffi::Error::InvalidArgument("matmul_packed: the residual must be [M, N], as y");
  }
  Fusion f;
  f.swiglu = swiglu != 0;
  f.residual = residual.typed_data();
  return Matmul(pool, x, w, live, y, threads, f);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(QuicserveMatmulPackedF32, MatmulPackedImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [M, K]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // w
                                  .Arg<ffi::Buffer<ffi::S32>>()  // live [G]
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("threads"));

// x normed on the way in: y = rms_norm(x, norm, eps) @ W.T
XLA_FFI_DEFINE_HANDLER_SYMBOL(QuicserveMatmulPackedNormF32, MatmulPackedNormImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [M, K]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // w
                                  .Arg<ffi::Buffer<ffi::S32>>()  // live [G]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // norm [K]
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("eps")
                                  .Attr<int64_t>("threads"));

// A residual added on the way out: y = residual + x' @ W.T, x' = x or (swiglu) silu(gate) * up
XLA_FFI_DEFINE_HANDLER_SYMBOL(QuicserveMatmulPackedResidualF32, MatmulPackedResidualImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [M, K] or [M, 2K]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // w
                                  .Arg<ffi::Buffer<ffi::S32>>()  // live [G]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // residual [M, N]
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("swiglu")
                                  .Attr<int64_t>("threads"));
