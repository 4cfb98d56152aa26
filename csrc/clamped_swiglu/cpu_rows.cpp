// clamped_swiglu's CPU row kernels: rows are cut into tiles of kTile outputs run through the shared
// formula in SIMD, compiled once per ISA (common/cpu_isa.h); no torch header but at::vec. A tile loads
// and stores whole SIMD vectors of x's dtype straight from memory (bf16 / fp16 widened to two fp32
// vectors and narrowed back in registers, with the faster exp of MathForHalfOutputs); a row's last
// partial tile is first copied into a zero-padded buffer of the same layout.
#include <ATen/cpu/vec/functional.h>

#include <array>
#include <cstring>

#include "clamped_swiglu/cpu_rows.h"
#include "common/vec_math.h"

namespace fused_rl_ops::clamped_swiglu::CPU_CAPABILITY {
namespace {

using at::vec::Vectorized;

// SIMD loads and stores of Vectorized<scalar_t>::size() elements as kParts vectors of the fp32
// (fp64 for double) compute type.
template <typename scalar_t>
struct Lanes {
  using acc = acc_t<scalar_t>;
  using Acc = Vectorized<acc>;
  static constexpr int64_t kWidth = Vectorized<scalar_t>::size();
  static constexpr int kParts = kWidth / Acc::size();
  using Parts = std::array<Acc, kParts>;
  using M = std::conditional_t<kParts == 1, Math<Acc>, MathForHalfOutputs>;  // bf16 / fp16 results: fast exp

  static Parts load(const scalar_t* p) {
    if constexpr (kParts == 1) {
      return {Acc::loadu(p)};
    } else {
      auto [lo, hi] = at::vec::convert_to_float<scalar_t>(Vectorized<scalar_t>::loadu(p));
      return {lo, hi};
    }
  }

  static void store(const Parts& v, scalar_t* p) {
    if constexpr (kParts == 1) {
      v[0].store(p);
    } else {
      at::vec::convert_from_float<scalar_t>(v[0], v[1]).store(p);
    }
  }
};

// Where one tile's kTile gate and linear values (or their gradients) sit. With interleaved, `g`
// points at kTile (g, u) pairs and `u` is unused.
template <typename P>
struct Halves {
  P* g;
  P* u;
};

// Gate and linear values of outputs [k, k + kWidth) of a tile.
template <typename scalar_t, typename L = Lanes<scalar_t>>
void load_gu(const Halves<const scalar_t>& in, int64_t k, bool interleaved, typename L::Parts& g,
             typename L::Parts& u) {
  if (!interleaved) {
    g = L::load(in.g + k);
    u = L::load(in.u + k);
    return;
  }
  const auto a = L::load(in.g + 2 * k), b = L::load(in.g + 2 * k + L::kWidth);
  std::array<typename L::Acc, 2 * L::kParts> pairs;
  std::copy(a.begin(), a.end(), pairs.begin());
  std::copy(b.begin(), b.end(), pairs.begin() + L::kParts);
  for (int i = 0; i < L::kParts; ++i) std::tie(g[i], u[i]) = at::vec::deinterleave2(pairs[2 * i], pairs[2 * i + 1]);
}

template <typename scalar_t, typename L = Lanes<scalar_t>>
void store_gu(const typename L::Parts& g, const typename L::Parts& u, int64_t k, bool interleaved,
              const Halves<scalar_t>& out) {
  if (!interleaved) {
    L::store(g, out.g + k);
    L::store(u, out.u + k);
    return;
  }
  std::array<typename L::Acc, 2 * L::kParts> pairs;
  for (int i = 0; i < L::kParts; ++i) std::tie(pairs[2 * i], pairs[2 * i + 1]) = at::vec::interleave2(g[i], u[i]);
  typename L::Parts a, b;
  std::copy(pairs.begin(), pairs.begin() + L::kParts, a.begin());
  std::copy(pairs.begin() + L::kParts, pairs.end(), b.begin());
  L::store(a, out.g + 2 * k);
  L::store(b, out.g + 2 * k + L::kWidth);
}

// kScaled: the weighted form, every output times the row's scale.
template <typename scalar_t, bool kScaled>
void forward_tile(const Halves<const scalar_t>& in, scalar_t* y, bool interleaved, const Activation& p,
                  acc_t<scalar_t> scale) {
  using L = Lanes<scalar_t>;
  for (int64_t k = 0; k < kTile; k += L::kWidth) {
    typename L::Parts g, u, out;
    load_gu(in, k, interleaved, g, u);
    for (int i = 0; i < L::kParts; ++i) {
      out[i] = clamped_swiglu_forward<typename L::Acc, typename L::M>(g[i], u[i], p);
      if constexpr (kScaled) out[i] = out[i] * typename L::Acc(scale);
    }
    L::store(out, y + k);
  }
}

// kScaled: the weighted form, dy times the row's scale; also adds each output's d/dscale term into
// the lanes of `dscale` (the row's running sum, in a fixed order). Unweighted, `dscale` is unused.
template <typename scalar_t, bool kScaled>
void backward_tile(const Halves<const scalar_t>& in, const scalar_t* dy, const Halves<scalar_t>& dx, bool interleaved,
                   const Activation& p, acc_t<scalar_t> scale, Vectorized<acc_t<scalar_t>>& dscale) {
  using L = Lanes<scalar_t>;
  const typename L::Acc s(scale);
  for (int64_t k = 0; k < kTile; k += L::kWidth) {
    typename L::Parts g, u, d = L::load(dy + k), dg, du;
    load_gu(in, k, interleaved, g, u);
    for (int i = 0; i < L::kParts; ++i) {
      if constexpr (kScaled) {
        dscale = dscale + clamped_swiglu_scaled_backward<typename L::Acc, typename L::M>(g[i], u[i], d[i], s, p, dg[i],
                                                                                         du[i]);
      } else {
        clamped_swiglu_backward<typename L::Acc, typename L::M>(g[i], u[i], d[i], p, dg[i], du[i]);
      }
    }
    store_gu(dg, du, k, interleaved, dx);
  }
}

// A row's inputs (or input gradients) in one layout: the tile starting at output c, in place, or
// copied from / to a zero-padded buffer of the same layout when the row has fewer than kTile left.
struct RowLayout {
  int64_t F;
  bool interleaved;

  int64_t g_offset(int64_t c) const { return interleaved ? 2 * c : c; }
  int64_t u_offset(int64_t c) const { return interleaved ? 2 * c + 1 : F + c; }
  // Elements of the gate (or pair) run holding n outputs.
  int64_t run(int64_t n) const { return interleaved ? 2 * n : n; }

  // The tile at output c of a row, in place; and a tile's buffer, linear run after kTile gates.
  template <typename P>
  Halves<P> tile(P* row, int64_t c) const { return {row + g_offset(c), row + u_offset(c)}; }
  template <typename P>
  Halves<P> buffer(P* buf) const { return {buf, buf + (interleaved ? 1 : kTile)}; }

  // Copies the n outputs' worth of values from one tile to another (in place <-> buffer).
  template <typename T>
  void copy(const Halves<const T>& from, const Halves<T>& to, int64_t n) const {
    std::memcpy(to.g, from.g, run(n) * sizeof(T));
    if (!interleaved) std::memcpy(to.u, from.u, n * sizeof(T));
  }
};

// Calls fn(row, c, n) for tiles [begin, end) of a [rows, F] output.
template <typename Fn>
void for_tiles(int64_t F, int64_t begin, int64_t end, const Fn& fn) {
  const int64_t per_row = tiles_per_row(F);
  for (int64_t t = begin; t < end; ++t) {
    const int64_t r = t / per_row, c = (t % per_row) * kTile;
    fn(r, c, std::min(kTile, F - c));
  }
}

// Tiles [begin, end) of the forward; kScaled: the weighted form, with p.scale's [rows] scales.
template <typename scalar_t, bool kScaled>
void forward_tiles(const Params& p, int64_t begin, int64_t end) {
  const auto* x = static_cast<const scalar_t*>(p.x);
  auto* y = static_cast<scalar_t*>(p.y);
  const auto* scale = static_cast<const acc_t<scalar_t>*>(p.scale);
  const int64_t F = p.F;
  const RowLayout layout{F, p.interleaved};
  for_tiles(F, begin, end, [&](int64_t r, int64_t c, int64_t n) {
    const scalar_t* xr = x + r * 2 * F;
    scalar_t* yr = y + r * F + c;
    const acc_t<scalar_t> s = kScaled ? scale[r] : 1;
    if (n == kTile) {
      forward_tile<scalar_t, kScaled>(layout.tile(xr, c), yr, p.interleaved, p.act, s);
      return;
    }
    alignas(64) scalar_t in[2 * kTile] = {}, out[kTile];
    layout.copy(layout.tile(xr, c), layout.buffer(in), n);
    forward_tile<scalar_t, kScaled>(layout.buffer<const scalar_t>(in), out, p.interleaved, p.act, s);
    std::memcpy(yr, out, n * sizeof(scalar_t));
  });
}

// Outputs [begin, end) of row r's backward (begin a multiple of kTile), tile by tile; kScaled: the
// weighted form, which also adds each output's d/dscale term into dscale_lanes. A row's last partial
// tile goes through zero-padded gate, linear and dy buffers (the padding adds 0 to dscale_lanes).
template <typename scalar_t, bool kScaled>
void backward_row_part(const Params& p, int64_t r, int64_t begin, int64_t end,
                       Vectorized<acc_t<scalar_t>>& dscale_lanes) {
  const int64_t F = p.F;
  const bool interleaved = p.interleaved;
  const RowLayout layout{F, interleaved};
  const scalar_t* xr = static_cast<const scalar_t*>(p.x) + r * 2 * F;
  const scalar_t* dyr = static_cast<const scalar_t*>(p.dy) + r * F;
  scalar_t* dxr = static_cast<scalar_t*>(p.dx) + r * 2 * F;
  const acc_t<scalar_t> s = kScaled ? static_cast<const acc_t<scalar_t>*>(p.scale)[r] : 1;
  for (int64_t c = begin; c < end; c += kTile) {
    const int64_t n = std::min(kTile, end - c);
    if (n == kTile) {
      backward_tile<scalar_t, kScaled>(layout.tile(xr, c), dyr + c, layout.tile(dxr, c), interleaved, p.act, s,
                                       dscale_lanes);
      continue;
    }
    alignas(64) scalar_t in[2 * kTile] = {}, d[kTile] = {}, out[2 * kTile];
    layout.copy(layout.tile(xr, c), layout.buffer(in), n);
    std::memcpy(d, dyr + c, n * sizeof(scalar_t));
    backward_tile<scalar_t, kScaled>(layout.buffer<const scalar_t>(in), d, layout.buffer(out), interleaved, p.act, s,
                                     dscale_lanes);
    layout.copy(layout.buffer<const scalar_t>(out), layout.tile(dxr, c), n);
  }
}

template <typename scalar_t>
void backward_tiles(const Params& p, int64_t begin, int64_t end) {
  for_tiles(p.F, begin, end, [&](int64_t r, int64_t c, int64_t n) {
    Vectorized<acc_t<scalar_t>> unused;
    backward_row_part<scalar_t, false>(p, r, c, c + n, unused);
  });
}

// Rows [begin, end) of the weighted backward: a row's scale gradient is its lanes' running sums, then
// the lanes in order.
template <typename scalar_t>
void scaled_backward_rows(const Params& p, int64_t begin, int64_t end) {
  using acc = acc_t<scalar_t>;
  for (int64_t r = begin; r < end; ++r) {
    Vectorized<acc> sum(0);
    backward_row_part<scalar_t, true>(p, r, 0, p.F, sum);
    alignas(64) acc lanes[Vectorized<acc>::size()];
    sum.store(lanes);
    acc total = 0;
    for (acc v : lanes) total += v;
    static_cast<acc*>(p.dscale)[r] = total;
  }
}

}  // namespace

const RowKernels row_kernels{
    [](const Params& p, CpuDType x, int64_t begin, int64_t end) {
      with_cpu_dtype(x, [&](auto zero) {
        using scalar_t = decltype(zero);
        if (p.scale != nullptr) forward_tiles<scalar_t, true>(p, begin, end);
        else forward_tiles<scalar_t, false>(p, begin, end);
      });
    },
    [](const Params& p, CpuDType x, int64_t begin, int64_t end) {
      with_cpu_dtype(x, [&](auto zero) { backward_tiles<decltype(zero)>(p, begin, end); });
    },
    [](const Params& p, CpuDType x, int64_t begin, int64_t end) {
      with_cpu_dtype(x, [&](auto zero) { scaled_backward_rows<decltype(zero)>(p, begin, end); });
    },
};

}  // namespace fused_rl_ops::clamped_swiglu::CPU_CAPABILITY
