// What the native CPU attention kernels (cpu_decode.cc, cpu_prefill.cc) share: the exp of their
// online softmax and their FFI signature.
//
// Why a header: both spend a measurable part of the softmax in exp, and one copy keeps their
// numerics identical (the tests hold both to the same tolerance against dense attention).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "xla/ffi/api/ffi.h"

namespace quicserve {

// exp(x) for x <= 0 (softmax terms after the max is subtracted), in place, written so the
// compiler vectorizes it (std::exp stays a scalar call per element): x = k*ln2 + r with |r| <=
// ln2/2, exp(r) by a degree-6 polynomial (Cephes' expf coefficients, ~1 ulp), times 2^k built
// in the exponent bits. Inputs below -87 give 0 (exp underflows there anyway).
//
// The range reduction is Cody-Waite: k * 0.693359375 is exact (9 + 7 significant bits) and so is
// x minus it, and only then is the small k * 2.12e-4 added. Under the kernels' -fassociative-math
// the compiler may regroup that as (x + k * 2.12e-4) - k * 0.693359375, which rounds at x's
// magnitude: without FMA contraction (the generic level) the error grew to 62 u at x = -72
// (measured; 1.2 u with FMA). An association barrier keeps the order and still vectorizes (a
// per-function no-associative-math attribute did not: GCC then called std::max and floorf).
#if defined(__has_builtin)
#if __has_builtin(__builtin_assoc_barrier)
#define QUICSERVE_ASSOC_BARRIER(x) __builtin_assoc_barrier(x)
#elif __has_builtin(__arithmetic_fence)
#define QUICSERVE_ASSOC_BARRIER(x) __arithmetic_fence(x)
#endif
#endif
#ifndef QUICSERVE_ASSOC_BARRIER  // older compilers: right with FMA contraction, up to ~60 u without
#define QUICSERVE_ASSOC_BARRIER(x) (x)
#endif
inline void exp_nonpositive(float* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const float v = std::max(x[i], -87.0f);
    const float k = std::floor(v * 1.44269504088896341f + 0.5f);
    const float r = QUICSERVE_ASSOC_BARRIER(v - k * 0.693359375f) + k * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    int32_t bits = (static_cast<int32_t>(k) + 127) << 23;
    float scale;
    std::memcpy(&scale, &bits, sizeof scale);
    x[i] = x[i] < -87.0f ? 0.0f : p * scale;
  }
}

// The arguments both kernels take: queries, keys and values (float32), two int32 arrays (decode:
// block tables and context lengths; prefill: query offsets and key lengths), the float32 output,
// and the attributes scale, threads (most of XLA's intra-op threads to use) and window.
inline auto attention_binding() {
  namespace ffi = xla::ffi;
  return ffi::Ffi::Bind()
      .Ctx<ffi::ThreadPool>()
      .Arg<ffi::Buffer<ffi::F32>>()
      .Arg<ffi::Buffer<ffi::F32>>()
      .Arg<ffi::Buffer<ffi::F32>>()
      .Arg<ffi::Buffer<ffi::S32>>()
      .Arg<ffi::Buffer<ffi::S32>>()
      .Ret<ffi::Buffer<ffi::F32>>()
      .Attr<float>("scale")
      .Attr<int64_t>("threads")
      .Attr<int64_t>("window");  // sliding window: a query sees its last `window` keys (0: all)
}

}  // namespace quicserve
