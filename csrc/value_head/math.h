// Value head math, shared by the CPU and CUDA kernels. For hidden h [rows, H], weight w [H],
// bias b and upstream gradient g [rows]:
//   forward    v[r]     = sum_j h[r, j] w[j] + b
//   backward   dh[r, j] = g[r] w[j]              (one write pass, rounded once to h's dtype)
//              dw[j]    = sum_r g[r] h[r, j],   db = sum_r g[r]
// Everything accumulates in fp32 (fp64 for float64 hidden on the CPU).
//
// dw and db are reduced in two fixed-order stages, so they are bitwise reproducible whatever the
// thread count or SM count: stage 1 sums each block of kValueHeadRowBlock consecutive rows into one
// partial row, stage 2 sums the partial rows. Each stage adds in an order fixed by the code (the
// CPU adds rows in order; the CUDA kernels add fixed groups of rows in order, then the groups).
// No float atomics.
#pragma once

#include "common/math.h"

namespace fused_rl_ops::value_head {

// Rows per stage-1 block: large enough that the fp32 partials add little traffic (4 bytes per
// column per 64 rows of hidden), small enough to give every core or SM blocks to work on.
constexpr int64_t kValueHeadRowBlock = 64;

FRL_HD int64_t value_head_row_blocks(int64_t rows) {
  return (rows + kValueHeadRowBlock - 1) / kValueHeadRowBlock;
}

struct RowRange {
  int64_t begin, end;
};

// The rows stage 1 sums into partial row `block`: all of them, or (CUDA) part `part` of `parts`
// equal consecutive parts, which the kernel then adds in part order.
FRL_HD RowRange value_head_block_rows(int64_t block, int64_t rows, int64_t part = 0, int64_t parts = 1) {
  const int64_t part_rows = kValueHeadRowBlock / parts;
  const int64_t begin = block * kValueHeadRowBlock + part * part_rows;
  const int64_t end = begin + part_rows;
  return {begin, end < rows ? end : rows};
}

}  // namespace fused_rl_ops::value_head
