// K/V rows of a KV cache for the forward kernel (flash_attn_with_kvcache): which rows an entry uses, and where
// each lives when the cache is paged. Every index read from user tensors is clamped to the tensors, so bad values
// give wrong rows but never an access outside them.
#pragma once
#include <cute/tensor.hpp>

#include "flash_gen/fwd_params.cuh"
#include "flash_gen/seq_info.cuh"

namespace flash_gen {
using namespace cute;

// kDense: K/V are plain (batch, seqlen_k, heads, dim) or varlen tensors. kCache: a cache read tile by tile,
// either contiguous (batch_cache, seqlen_cache, ...) or paged with pages that hold whole key tiles (and no left
// padding). kPaged: any page size; each row is found through the block table.
enum class KvLayout { kDense = 0, kCache = 1, kPaged = 2 };

// Entry `batch`'s keys: rows [leftpad, used) of the cache (seq.k_start, seq.seqlen_k), and its cache entry.
// A varlen batch over a paged cache (flash_attn_varlen_func with block_table) takes `used` from cu_seqlens_k.
template <bool kVarlen>
__device__ __forceinline__ int kv_cache_rows(FwdParams const& p, int batch, SeqInfo& seq) {
  const int count = kVarlen ? p.cu_seqlens_k[batch + 1] - p.cu_seqlens_k[batch]
                            : (p.seqused_k != nullptr ? p.seqused_k[batch] : p.seqlen_k);
  const int used = min(max(count, 0), p.seqlen_k);
  const int pad = p.leftpad_k != nullptr ? min(max(p.leftpad_k[batch], 0), used) : 0;
  seq.k_start = pad;
  seq.seqlen_k = used - pad;
  const int entry = p.kv_batch_idx != nullptr ? p.kv_batch_idx[batch] : batch;
  return min(max(entry, 0), p.kv_batches - 1);
}

// Address of cache row `row` (0 = the entry's first row) of a paged K or V tensor whose element 0 of head
// `head_k` is `cache`.
template <class Element>
__device__ __forceinline__ const Element* paged_row(FwdParams const& p, const Element* cache, int64_t page_stride,
                                                    int64_t row_stride, int batch, int row) {
  const int page = min(max(p.block_table[batch * p.block_table_stride + row / p.page_size], 0), p.kv_batches - 1);
  return cache + page * page_stride + (row % p.page_size) * row_stride;
}

// As copy_zfill (sm80_utils.cuh), but tile row r is read from row_ptr(r): rows gathered from pages. Rows at or
// past max_row are zero-filled without looking up their page. Every row's address is computed before the first
// copy is issued, so the page-table loads overlap instead of each waiting behind the previous row's cp.async.
template <class TiledCopy, class RowPtr, class Dst, class Coord>
__device__ __forceinline__ void copy_rows_zfill(TiledCopy const& tiled_copy, RowPtr const& row_ptr, Dst&& dst,
                                                Coord const& coord, int max_row, int max_col) {
  constexpr int kRows = decltype(size<1>(dst))::value;
  decltype(row_ptr(0)) src_rows[kRows];
  CUTE_UNROLL
  for (int m = 0; m < kRows; ++m) {
    const int row = get<0>(coord(0, m, 0));
    src_rows[m] = row_ptr(row < max_row ? row : 0);
  }
  CUTE_UNROLL
  for (int m = 0; m < kRows; ++m) {
    const bool row_ok = get<0>(coord(0, m, 0)) < max_row;
    const auto* src_row = src_rows[m];
    CUTE_UNROLL
    for (int k = 0; k < size<2>(dst); ++k) {
      const int col = get<1>(coord(0, m, k));
      Tensor src = make_tensor(make_gmem_ptr(src_row + col), make_layout(shape(dst(_, m, k))));
      copy(tiled_copy.with(row_ok && col < max_col), src, dst(_, m, k));
    }
  }
}

// Store a partitioned smem tile to gmem rows row_ptr(r) (pack-GQA's stacked heads), 16-byte vector by vector,
// skipping rows at or past max_row and columns at or past max_col.
template <class TiledCopy, class Src, class RowPtr, class Coord>
__device__ __forceinline__ void copy_rows_predicated(TiledCopy const& tiled_copy, Src const& src,
                                                     RowPtr const& row_ptr, Coord const& coord, int max_row,
                                                     int max_col) {
  CUTE_UNROLL
  for (int m = 0; m < size<1>(src); ++m) {
    const int row = get<0>(coord(0, m, 0));
    if (row >= max_row) continue;
    auto* dst_row = row_ptr(row);
    CUTE_UNROLL
    for (int k = 0; k < size<2>(src); ++k) {
      const int col = get<1>(coord(0, m, k));
      if (col >= max_col) continue;
      Tensor dst = make_tensor(make_gmem_ptr(dst_row + col), make_layout(shape(src(_, m, k))));
      copy(tiled_copy, src(_, m, k), dst);
    }
  }
}

}  // namespace flash_gen
