// The choice of the CPU row kernels' ISA (common/cpu_isa.h), made once from ATen's CPU capability
// so that an ATEN_CPU_CAPABILITY override (default, avx2, avx512) applies to both alike.
#include "common/cpu_isa.h"

#include <ATen/Version.h>

#include <string>

namespace fused_rl_ops {

CpuIsa cpu_isa() {
  static const CpuIsa isa = [] {
#if defined(FRL_CPU_ISAS_X86)
    const std::string aten = at::get_cpu_capability();
    if (aten == "AVX512") return CpuIsa::AVX512;
    if (aten == "AVX2") return CpuIsa::AVX2;
#endif
    return CpuIsa::DEFAULT;
  }();
  return isa;
}

const char* cpu_isa_name(CpuIsa isa) {
  switch (isa) {
    case CpuIsa::AVX512: return "AVX512";
    case CpuIsa::AVX2: return "AVX2";
    default: return "DEFAULT";
  }
}

}  // namespace fused_rl_ops
