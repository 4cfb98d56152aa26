// The choice of the CPU row kernels' ISA (common/cpu_isa.h), made once from ATen's CPU capability
// so that an ATEN_CPU_CAPABILITY override (default, avx2, avx512) applies to both alike.
#include "common/cpu_isa.h"

#include <ATen/Version.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdlib>
#include <string>

namespace fused_rl_ops {
namespace {

#if defined(FRL_CPU_ISAS_X86)
// The widest ISA this CPU and its OS run, with the features ATen's own check asks for.
CpuIsa supported_isa() {
  __builtin_cpu_init();
  const bool fma = __builtin_cpu_supports("fma");
  if (fma && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq")) {
    return CpuIsa::AVX512;
  }
  return fma && __builtin_cpu_supports("avx2") ? CpuIsa::AVX2 : CpuIsa::DEFAULT;
}
#endif

CpuIsa choose_isa() {
#if defined(FRL_CPU_ISAS_X86)
  const std::string aten = at::get_cpu_capability();
  const CpuIsa wanted = aten == "AVX512" ? CpuIsa::AVX512 : aten == "AVX2" ? CpuIsa::AVX2 : CpuIsa::DEFAULT;
  // ATen takes an ATEN_CPU_CAPABILITY override without asking the CPU; ours never runs what it lacks.
  const CpuIsa isa = std::min(wanted, supported_isa());
  if (isa != wanted) {
    TORCH_WARN("fused_rl_ops: ATen's CPU capability is ", aten, " (ATEN_CPU_CAPABILITY=",
               std::getenv("ATEN_CPU_CAPABILITY") ? std::getenv("ATEN_CPU_CAPABILITY") : "unset",
               "), which this CPU cannot run; the row kernels run ", cpu_isa_name(isa));
  }
  return isa;
#else
  return CpuIsa::DEFAULT;
#endif
}

}  // namespace

CpuIsa cpu_isa() {
  static const CpuIsa isa = choose_isa();
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
