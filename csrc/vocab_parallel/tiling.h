// How the chunk loop (vocab_parallel/chunk_loop.h) cuts its work: token rows into GEMM blocks,
// passes and a device's pieces, weight's rows into chunks and groups, and where one step of the
// walk is (ChunkStep).
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

namespace fused_rl_ops {

// How the token rows meet the GEMMs. Every GEMM takes exactly `block` rows (a last, shorter block
// runs on a zero-padded copy), and the rows are walked in passes of `pass` rows (a multiple of
// `block`) that share the logits workspace. With a block and chunk width fixed independently of
// the batch, every GEMM call has one shape, so each row's dot products are computed by the same
// kernel in the same order whatever the other rows are (batch invariance); the default, one block
// and one pass of all N rows, makes one GEMM per chunk.
struct RowTiling {
  int64_t N, block, pass;
  bool fixed_block;  // block was given (batch-invariant), not all rows

  RowTiling(int64_t num_rows, int64_t row_block, int64_t pass_rows) : N(num_rows), fixed_block(row_block > 0) {
    block = row_block > 0 ? row_block : std::max<int64_t>(N, 1);
    pass = pass_rows > 0 ? std::max(pass_rows / block, int64_t(1)) * block : block;
    pass = std::min(pass, padded(N));
  }
  int64_t padded(int64_t rows) const { return (rows + block - 1) / block * block; }
  int64_t tail_rows() const { return N % block; }  // rows of the padded last block (0: none)
  int64_t last_full_row() const { return N - tail_rows(); }
};

// t itself, or a copy where a fixed-block GEMM operand would start off the alignment its
// allocator gives (64 bytes on the CPU, 256 on CUDA, where torch tells cuBLASLt the operands'
// alignment up to 256): BLAS libraries may pick their kernel by alignment, and a token's rows must
// meet the same kernel in every call. Blocks are multiples of 128 rows, so they all start aligned.
inline at::Tensor aligned_rows(const at::Tensor& t, const RowTiling& tiling) {
  const uintptr_t alignment = t.is_cuda() ? 256 : 64;
  const bool misaligned = reinterpret_cast<uintptr_t>(t.const_data_ptr()) % alignment != 0;
  return tiling.fixed_block && misaligned ? t.clone() : t;
}

// Rows [r0, r0 + block) of t as a GEMM operand: a view, or the zero-padded copy `tail` of the
// last block.
inline at::Tensor block_rows(const at::Tensor& t, const at::Tensor& tail, const RowTiling& tiling, int64_t r0) {
  return r0 < tiling.last_full_row() ? t.narrow(0, r0, tiling.block) : tail;
}

// How weight's rows meet the GEMMs: in chunks of `chunk` rows, one logits GEMM and one row kernel
// each, walked in groups of `group` rows (a whole number of chunks, or all rows) that the
// backward's gradient GEMMs take at once. Fixed by the options alone, so batch-invariant tilings
// keep one GEMM shape.
struct VocabTiling {
  int64_t rows, chunk, group;

  VocabTiling(int64_t vocab_rows, int64_t chunk_size, int64_t group_chunks)
      : rows(vocab_rows), chunk(std::min(chunk_size, vocab_rows)) {
    // chunk * group_chunks, or all rows when that is at least as many (without a product that overflows)
    group = chunk == 0 || group_chunks > (rows - 1) / chunk ? rows : chunk * group_chunks;
  }
};

// Where for_each_logits_chunk is: token rows [r0, r0 + rows) of a pass, vocab rows [g0, g0 + k) of a
// group and [c0, c0 + n) of a chunk in it (GroupWork: the whole group, c0 = g0 and n = k); for
// on_chunk, the pass's rows [begin, end) its row kernels take (all of them, or one piece).
struct ChunkStep {
  int64_t r0, rows, g0, k, c0, n, begin, end;

  // The address of on_chunk's first row of t, read (rows_in) or written (rows_out): of a [N, ...] tensor
  // per token row, or (pass_rows_in) of a pass's [padded rows, ...]. Addresses, not views: a task
  // per piece and chunk makes them.
  template <typename T = void>
  const T* rows_in(const at::Tensor& t) const {
    return row_address<const T>(t.const_data_ptr(), t, r0 + begin);
  }
  template <typename T = void>
  T* rows_out(const at::Tensor& t) const {
    return row_address<T>(t.mutable_data_ptr(), t, r0 + begin);
  }
  const void* pass_rows_in(const at::Tensor& t) const {
    return row_address<const void>(t.const_data_ptr(), t, begin);
  }

 private:
  template <typename T, typename Void>
  static T* row_address(Void* base, const at::Tensor& t, int64_t row) {
    using Byte = std::conditional_t<std::is_const_v<Void>, const char, char>;
    const int64_t offset = row * t.stride(0) * static_cast<int64_t>(t.element_size());
    return static_cast<T*>(static_cast<Void*>(static_cast<Byte*>(base) + offset));
  }
};

// How a pass's padded rows are cut for a device whose Kernels run pieces (kPieceRows > 0, the CPU):
// each block of the tiling into pieces of `piece` rows (the last of a block shorter where piece does
// not divide it: never in batch-invariant tilings, whose GEMMs so keep one shape), each piece's
// GEMMs and row kernels one task (LogitsChunks::as_tasks). For other Kernels (CUDA) a piece is a
// whole block.
struct RowPieces {
  int64_t block, piece, per_block, count;

  RowPieces(const RowTiling& tiling, int64_t padded_rows, int64_t piece_rows)
      : block(tiling.block), piece(piece_of(tiling.block, piece_rows)) {
    per_block = (block + piece - 1) / piece;
    count = padded_rows / block * per_block;
  }
  int64_t block_begin(int64_t i) const { return i / per_block * block; }
  int64_t begin(int64_t i) const { return block_begin(i) + i % per_block * piece; }
  int64_t end(int64_t i) const { return std::min(begin(i) + piece, block_begin(i) + block); }
  int64_t at(int64_t row) const { return row / block * per_block + row % block / piece; }  // the piece of a row

 private:
  // Pieces of piece_rows, or twice that where a block holds 16 of those: each piece's GEMM packs the
  // chunk's weight rows again, and 8 pieces a chunk still even out a slowed thread's share. The
  // batch-invariant block (512 rows) keeps piece_rows.
  static int64_t piece_of(int64_t block, int64_t piece_rows) {
    if (piece_rows <= 0) return block;
    return std::min(block >= 16 * piece_rows ? 2 * piece_rows : piece_rows, block);
  }
};

// Each piece's rows of a pass's blocks, block_at(b0) the block from the pass's row b0: views made
// once per call for the CPU's piece tasks.
template <class BlockAt>
std::vector<at::Tensor> piece_views(const RowPieces& pieces, const BlockAt& block_at) {
  std::vector<at::Tensor> rows;
  for (int64_t i = 0; i < pieces.count; ++i) {
    const int64_t b0 = pieces.block_begin(i), b = pieces.begin(i);
    rows.push_back(block_at(b0).narrow(0, b - b0, pieces.end(i) - b));
  }
  return rows;
}

// Piece i's rows of logits ([padded rows, n] of a pass from token row r0) = its rows of h times
// w_chunk^T; h_tail: h's zero-padded last block (block_rows).
template <class Kernels>
void piece_logits(at::Tensor& logits, const at::Tensor& w_chunk, const at::Tensor& h, const at::Tensor& h_tail,
                  const RowTiling& tiling, const RowPieces& pieces, int64_t r0, int64_t i) {
  const int64_t b = pieces.begin(i), b0 = pieces.block_begin(i);
  at::Tensor out = logits.narrow(0, b, pieces.end(i) - b);
  Kernels::logits(block_rows(h, h_tail, tiling, r0 + b0).narrow(0, b - b0, out.size(0)), w_chunk, out);
}

}  // namespace fused_rl_ops
