// The instruction sets the CPU row kernels are built for. Each op's cpu_rows.cpp (torch-free but for
// ATen's header-only at::vec) is compiled once per ISA by the build, with that ISA's flags and
// -DCPU_CAPABILITY=<name>, so that all its code lies in a namespace of that name (at::vec's own
// inline namespace is CPU_CAPABILITY too): no function compiled for AVX-512 can stand in for
// another's on a CPU without it. The torch glue, built for the baseline ISA, picks one table of row
// kernels per op at run time (cpu_isa: ATen's own CPU capability).
#pragma once

namespace fused_rl_ops {

enum class CpuIsa { DEFAULT, AVX2, AVX512 };

// The ISA the row kernels run, chosen once: ATen's CPU capability (which honours the
// ATEN_CPU_CAPABILITY variable), DEFAULT (scalar) where this build has no x86 ISAs (common/cpu_isa.cpp).
CpuIsa cpu_isa();
const char* cpu_isa_name(CpuIsa isa);

template <class Table>
const Table& for_cpu_isa(const Table& scalar, const Table& avx2, const Table& avx512) {
  switch (cpu_isa()) {
    case CpuIsa::AVX512: return avx512;
    case CpuIsa::AVX2: return avx2;
    default: return scalar;
  }
}

}  // namespace fused_rl_ops

// Declares an op's row-kernel table `row_kernels` of type Table in each ISA's namespace (inside the
// op's), and FRL_CPU_ROW_KERNELS the one the CPU runs; the build defines FRL_CPU_ISAS_X86 where it
// builds AVX2 and AVX512 beside DEFAULT.
#define FRL_DECLARE_CPU_ROW_KERNELS(Table)  \
  namespace DEFAULT {                       \
  extern const Table row_kernels;           \
  }                                         \
  namespace AVX2 {                          \
  extern const Table row_kernels;           \
  }                                         \
  namespace AVX512 {                        \
  extern const Table row_kernels;           \
  }
#if defined(FRL_CPU_ISAS_X86)
#define FRL_CPU_ROW_KERNELS() \
  (::fused_rl_ops::for_cpu_isa(DEFAULT::row_kernels, AVX2::row_kernels, AVX512::row_kernels))
#else
#define FRL_CPU_ROW_KERNELS() (DEFAULT::row_kernels)
#endif
