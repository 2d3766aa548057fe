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
// Contract: x [M, K] f32, w [P, K, 16] f32 with P = ceil(N / 16), out y [M, N] f32 (N taken from
// the result's shape, columns past N in the last panel are zero padding and never written).

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu_parallel.h"
#include "xla/ffi/api/ffi.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

namespace ffi = xla::ffi;

namespace {

constexpr int kMR = 6;   // rows of x per register tile
constexpr int kNR = 16;  // columns of W per panel (two 8-lane vectors)

#if defined(__AVX2__) && defined(__FMA__)
// y[0:mr, 0:nr] = xt[K][6] . panel[K][16]; prefetches `pf_lines` lines of `pf` (the next panel's
// share for this tile), one every `pf_every` k.
template <int MR>
void tile(const float* xt, const float* panel, int64_t K, float* y, int64_t ldy, int64_t mr, int64_t nr,
          const float* pf, int64_t pf_every) {
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
  for (int64_t i = 0; i < mr; ++i) std::memcpy(y + i * ldy, buf[i], sizeof(float) * nr);
}
#else
template <int MR>
void tile(const float* xt, const float* panel, int64_t K, float* y, int64_t ldy, int64_t mr, int64_t nr,
          const float*, int64_t) {
  float acc[MR][kNR] = {};
  for (int64_t k = 0; k < K; ++k)
    for (int i = 0; i < MR; ++i)
      for (int j = 0; j < kNR; ++j) acc[i][j] += xt[k * kMR + i] * panel[k * kNR + j];
  for (int64_t i = 0; i < mr; ++i) std::memcpy(y + i * ldy, acc[i], sizeof(float) * nr);
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
                int64_t n0, float* y) {
  const RowTiles rt(M);
  const int64_t tiles = rt.tiles;
  const int64_t nr = std::min<int64_t>(kNR, N - n0);
  const int64_t share = (K + tiles - 1) / tiles;  // the next panel's lines (one per k) this tile fetches
  for (int64_t t = 0; t < tiles; ++t) {
    const int64_t m0 = rt.start(t), mr = rt.rows(t);
    const float* pf = next == nullptr || t * share >= K ? nullptr : next + t * share * kNR;
    const int64_t every = std::max<int64_t>(1, K / std::max<int64_t>(1, std::min(share, K - t * share)));
    const float* xt = xpack + t * K * kMR;
    float* yt = y + m0 * N + n0;
    switch (mr) {  // a short tile: fewer accumulators, not wasted rows
      case 6: tile<6>(xt, panel, K, yt, N, mr, nr, pf, every); break;
      case 5: tile<5>(xt, panel, K, yt, N, mr, nr, pf, every); break;
      case 4: tile<4>(xt, panel, K, yt, N, mr, nr, pf, every); break;
      case 3: tile<3>(xt, panel, K, yt, N, mr, nr, pf, every); break;
      case 2: tile<2>(xt, panel, K, yt, N, mr, nr, pf, every); break;
      default: tile<1>(xt, panel, K, yt, N, mr, nr, pf, every); break;
    }
  }
}

ffi::Error MatmulPackedImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                            ffi::Result<ffi::Buffer<ffi::F32>> y, int64_t threads) {
  auto xd = x.dimensions();
  auto wd = w.dimensions();
  auto yd = y->dimensions();
  if (xd.size() != 2 || wd.size() != 3 || yd.size() != 2 || wd[2] != kNR || wd[1] != xd[1] || yd[0] != xd[0] ||
      (yd[1] + kNR - 1) / kNR != wd[0]) {
    return ffi::Error::InvalidArgument("matmul_packed: x must be [M, K], w [ceil(N/16), K, 16], y [M, N]");
  }
  const int64_t M = xd[0], K = xd[1], N = yd[1], P = wd[0];
  float* yp = y->typed_data();
  if (M == 0 || N == 0) return ffi::Error::Success();
  if (K == 0) {
    std::memset(yp, 0, sizeof(float) * M * N);
    return ffi::Error::Success();
  }
  const float* xp = x.typed_data();
  const float* wp = w.typed_data();
  const RowTiles rt(M);
  std::vector<float> xpack(static_cast<size_t>(rt.tiles * K * kMR), 0.0f);
  for (int64_t t = 0; t < rt.tiles; ++t)
    for (int64_t i = 0; i < rt.rows(t); ++i) {
      const float* row = xp + (rt.start(t) + i) * K;
      float* dst = xpack.data() + t * K * kMR + i;
      for (int64_t k = 0; k < K; ++k) dst[k * kMR] = row[k];
    }
  // Runs of panels: enough runs for every thread to take a few, each run long enough that most
  // of its panels arrive prefetched.
  const int64_t run = std::clamp<int64_t>(P / (4 * std::max<int64_t>(1, threads)), 1, 8);
  const int64_t runs = (P + run - 1) / run;
  quicserve::parallel_for(pool, runs, threads, [&](int64_t r) {
    const int64_t p1 = std::min(P, (r + 1) * run);
    for (int64_t p = r * run; p < p1; ++p) {
      const float* next = p + 1 < p1 ? wp + (p + 1) * K * kNR : nullptr;
      panel_rows(xpack.data(), wp + p * K * kNR, next, M, N, K, p * kNR, yp);
    }
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(QuicserveMatmulPackedF32, MatmulPackedImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("threads"));
