// Helpers for the torch-side glue of the CPU and CUDA kernels (not for .cu files).
#pragma once

#include <ATen/ATen.h>

#if defined(__linux__)
#include <sys/mman.h>
#endif

#include "common.h"

namespace fused_rl_ops {

// at::empty for a kernel's output or workspace. On a Linux CPU, the 2 MiB-aligned interior of a large
// buffer is first advised for transparent huge pages: a buffer above glibc's mmap threshold (32 MiB
// at most) arrives as untouched memory, and faulting it in 4 KiB pages can cost more than the kernel
// itself (on the 2-core CI VM: ~38 ms for 47 MiB that take ~7 ms to write). torch's own allocator
// does the same for every buffer under THP_MEM_ALLOC_ENABLE=1. The advice is a hint: where huge
// pages are off or unavailable, nothing changes.
inline at::Tensor empty_buffer(at::IntArrayRef sizes, const at::TensorOptions& options) {
  at::Tensor t = at::empty(sizes, options);
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  constexpr uintptr_t kHugePage = uintptr_t(2) << 20;
  if (t.device().is_cpu()) {
    const auto start = reinterpret_cast<uintptr_t>(t.data_ptr());
    const uintptr_t first = (start + kHugePage - 1) & ~(kHugePage - 1);
    const uintptr_t last = (start + t.nbytes()) & ~(kHugePage - 1);
    if (last > first) madvise(reinterpret_cast<void*>(first), last - first, MADV_HUGEPAGE);
  }
#endif
  return t;
}

// The accumulation (and fp32-output) dtype of a kernel reading `dtype`, as acc_t in common.h.
inline at::ScalarType acc_dtype(at::ScalarType dtype) { return dtype == at::kDouble ? at::kDouble : at::kFloat; }

inline DType to_dtype(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat: return DType::kFloat32;
    case at::kBFloat16: return DType::kBFloat16;
    case at::kHalf: return DType::kFloat16;
    default: TORCH_CHECK(false, "fused_rl_ops: unsupported dtype ", t.scalar_type(), " on CUDA");
  }
}

}  // namespace fused_rl_ops
