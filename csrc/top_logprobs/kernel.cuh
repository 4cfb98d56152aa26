// top_logprobs' CUDA row kernel (device code only: no torch headers, no launches). Included by
// top_logprobs/kernel.cu, whose launcher picks the grid, and by the kernels-on-CPU tests.
#pragma once

#include "common/cuda_utils.cuh"
#include "top_logprobs/top_ids.h"
#include "vocab_parallel/row_stats.h"
#include "vocab_parallel/warp_partial.cuh"

namespace fused_rl_ops::top_logprobs {

constexpr int kTopIdsRowsPerBlock = 8;  // one warp per row
constexpr int kTopIdsWidth = 4;         // columns per lane and access where aligned (16 bytes)
// The widest top a warp keeps in shared memory (12 bytes an entry, 8 warps: 48 KiB); a wider one
// stays in its row of global memory.
constexpr int64_t kSharedTopWidth = 512;

// The dynamic shared memory a block of the kernel below takes for tops of K entries.
inline size_t top_shared_bytes(int64_t K) {
  return K <= kSharedTopWidth ? size_t(kTopIdsRowsPerBlock) * K * (sizeof(int64_t) + sizeof(float)) : 0;
}

// One read of a chunk's logits per row gives both the row's softmax partial (merged into stats
// [N, stats_column::chosen], in the order and bits of vocab_parallel_stats_rows_kernel: lane l takes
// the kWidth columns [kWidth l, kWidth (l + 1)), then those kWarp kWidth further on, kWidth where the
// launcher finds the rows aligned for it, else 1) and its top of K logits with their global ids
// (top_ids.h; values and ids [N, K]). The warp's lanes test their logits against the top's root, the
// entry a new one replaces; a ballot names those before it, which lane 0 gives to the top in column
// order, the top in shared memory while the warp walks the row.
template <class Logit, int kWidth>
__global__ void top_logprobs_stats_top_ids_rows_kernel(const float* __restrict__ logits, int64_t N, int64_t C,
                                                       int64_t col0, Logit logit, float* __restrict__ stats,
                                                       float* __restrict__ values, int64_t* __restrict__ ids,
                                                       int64_t K) {
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  const bool in_shared = K <= kSharedTopWidth;
  int64_t* shared_ids = nullptr;  // this warp's top in shared memory: its ids, then its values
  float* shared_values = nullptr;
  if (in_shared) {
    shared_ids = reinterpret_cast<int64_t*>(dynamic_shared_memory()) + warp * K;
    shared_values = reinterpret_cast<float*>(dynamic_shared_memory() + kTopIdsRowsPerBlock * K * sizeof(int64_t));
    shared_values += warp * K;
  }
  for (int64_t r = blockIdx.x * int64_t(kTopIdsRowsPerBlock) + warp; r < N;
       r += int64_t(gridDim.x) * kTopIdsRowsPerBlock) {
    const float* x = logits + r * C;
    float* top = in_shared ? shared_values : values + r * K;
    int64_t* top_id = in_shared ? shared_ids : ids + r * K;
    for (int64_t j = lane; in_shared && j < K; j += kWarp) {
      top[j] = values[r * K + j];
      top_id[j] = ids[r * K + j];
    }
    __syncwarp();  // the copy seen by every lane
    float root = top[0];
    int64_t root_id = top_id[0];
    RowStats<float> lane_stats = partial_empty<RowStats<float>>();
    for (int64_t c0 = 0; c0 < C; c0 += kWarp * kWidth) {
      const int64_t c = c0 + int64_t(lane) * kWidth;
      float z[kWidth] = {};
      if (c < C) {
        const Pack<float, kWidth> in = *reinterpret_cast<const Pack<float, kWidth>*>(x + c);
#pragma unroll
        for (int i = 0; i < kWidth; ++i) z[i] = logit(in.v[i]);
        stats_add_online(lane_stats, z, -INFINITY);
      }
      unsigned given[kWidth], any = 0;
#pragma unroll
      for (int i = 0; i < kWidth; ++i) {
        given[i] = __ballot_sync(0xffffffffu, c < C && top_before(z[i], col0 + c + i, root, root_id));
        any |= given[i];
      }
      for (unsigned rest = any; rest != 0; rest &= rest - 1) {
        const int from = __ffs(rest) - 1;
#pragma unroll
        for (int i = 0; i < kWidth; ++i) {
          if (!(given[i] >> from & 1u)) continue;
          const float v = __shfl_sync(0xffffffffu, z[i], from);
          if (lane == 0) top_ids_push(top, top_id, K, v, col0 + c0 + int64_t(from) * kWidth + i);
        }
      }
      if (any != 0) {
        __syncwarp();
        root = top[0];
        root_id = top_id[0];
      }
    }
    const RowStats<float> chunk =
        warp_partial(lane_stats, [](RowStats<float>& a, const RowStats<float>& b) { stats_merge(a, b); });
    if (lane == 0) stats_update_row(stats + stats_column::chosen * r, chunk);
    // Lane 0's pushes were seen at the barrier after them; each lane writes back the entries it
    // copies in, so the next row's copy waits for no other lane.
    for (int64_t j = lane; in_shared && j < K; j += kWarp) {
      values[r * K + j] = top[j];
      ids[r * K + j] = top_id[j];
    }
  }
}

}  // namespace fused_rl_ops::top_logprobs
