// Shared by the CPU (.cpp) and CUDA (.cu) kernels: no torch headers here.
#pragma once

#include <cmath>
#include <cstdint>
#include <type_traits>

#if defined(__CUDACC__)
#define FRL_HD __host__ __device__ __forceinline__
#elif defined(FRL_CPU_ROWS_ISA)
// A CPU row-kernel file compiled for one ISA (common/cpu_isa.h): the shared formulas inlined into
// its kernels, never emitted as functions another file's calls could link to.
#define FRL_HD inline __attribute__((always_inline))
#else
#define FRL_HD inline
#endif

namespace fused_rl_ops {

// Elementwise primitives the per-element math headers are written in. Specialised here for
// scalars (CPU and CUDA) and in common/vec_math.h for at::vec::Vectorized (CPU SIMD), so one
// formula serves every kernel. select(c, a, b) is c ? a : b; comparisons are ordered (NaN
// compares false), as IEEE and AVX's _CMP_*_OQ are.
template <typename T>
struct Math;

template <typename S>
struct ScalarMath {
  static FRL_HD S select(bool c, S a, S b) { return c ? a : b; }
  static FRL_HD S exp(S x) { return ::exp(x); }
  static FRL_HD S log(S x) { return ::log(x); }
  static FRL_HD S tanh(S x) { return ::tanh(x); }
  static FRL_HD S abs(S x) { return ::fabs(x); }
  // NaN-propagating in either argument, like at::vec::maximum and torch.maximum: a bare a > b ? a : b
  // would drop a NaN in a but not in b, so the lanes of a reduction could disagree.
  static FRL_HD S max(S a, S b) { return (a > b || a != a) ? a : b; }
  static FRL_HD S recip(S x) { return S(1) / x; }
};

template <>
struct Math<float> : ScalarMath<float> {
  static FRL_HD float exp(float x) { return ::expf(x); }
  static FRL_HD float log(float x) { return ::logf(x); }
  static FRL_HD float tanh(float x) { return ::tanhf(x); }
  static FRL_HD float abs(float x) { return ::fabsf(x); }
#if defined(__CUDA_ARCH__)
  // Correctly rounded like the host's 1.0f / x, without the division's slow-path call.
  static FRL_HD float recip(float x) { return __frcp_rn(x); }
#endif
};

template <>
struct Math<double> : ScalarMath<double> {};

// The accumulation type of a kernel reading scalar_t: fp64 for double (CPU, for gradcheck), else fp32.
template <typename scalar_t>
using acc_t = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;

// Element types the torch-free CUDA launchers accept.
enum class DType : int { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };

}  // namespace fused_rl_ops
