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

// n / d for a divisor fixed for the whole kernel (the page size): a multiply-high, an add and a shift instead of
// an integer division per looked-up row (Granlund and Montgomery's round-up method; exact for 0 <= n < 2^31).
struct FastDiv {
  int d;
  uint32_t mul, shift;

  __device__ __forceinline__ explicit FastDiv(int divisor) : d(divisor) {
    shift = 32 - __clz(divisor - 1);  // ceil(log2(divisor)), 0 for 1
    mul = uint32_t((uint64_t((1ull << shift) - divisor) << 32) / uint64_t(divisor) + 1);
  }
  __device__ __forceinline__ int div(int n) const { return int((__umulhi(mul, uint32_t(n)) + uint32_t(n)) >> shift); }
};

// Pages (block-table entries) of the cache rows one thread copies in a key tile, read one tile ahead: issued
// right after the previous tile's copies, the loads' latency hides behind that tile's math instead of holding up
// the next tile's copies, and K and V share one lookup. Entries are clamped when used, not when loaded, so that
// nothing waits on the loads early. kRows: rows per thread (1 when pages hold whole tiles: the tile's first row).
template <int kRows>
struct PageLookahead {
  FastDiv page_size;
  const int* table;     // the entry's row of the block table
  int tile = -1;        // the key tile whose rows the arrays describe; -1: none yet
  int page[kRows];      // block-table entry of each row (unclamped)
  int in_page[kRows];   // each row's index within its page

  __device__ __forceinline__ PageLookahead(FwdParams const& p, int batch)
      : page_size(max(p.page_size, 1)),
        table(p.block_table != nullptr ? p.block_table + batch * p.block_table_stride : nullptr) {}

  // Start loading the pages of key tile n: those of cache rows row_of(i) (0 = the entry's first row), each at
  // most last_row (a row past the keys is never read; it takes the last key's page, which the table holds).
  template <class RowOf>
  __device__ __forceinline__ void fetch(int n, int last_row, RowOf const& row_of) {
    CUTE_UNROLL
    for (int i = 0; i < kRows; ++i) {
      const int row = min(row_of(i), last_row), index = page_size.div(row);
      page[i] = table[index];
      in_page[i] = row - index * page_size.d;
    }
    tile = n;
  }

  // Element offset of row i in a K or V tensor with these page and row strides. The host keeps a page's stride
  // and a row's offset in its page below 2^32 elements (validate.py), so this is one 32 x 32 -> 64-bit
  // multiply-add. A block-table entry out of range (negative ones wrap high) reads the last page.
  __device__ __forceinline__ uint64_t offset(FwdParams const& p, int i, uint32_t page_stride,
                                             uint32_t row_stride) const {
    const uint32_t pg = min(uint32_t(page[i]), uint32_t(p.kv_batches - 1));
    return uint64_t(pg) * page_stride + uint32_t(in_page[i]) * row_stride;
  }
};

// As copy_zfill (sm80_utils.cuh), but the thread's copy row m (tile row r) is read from row_ptr(m, r): rows
// gathered from pages or heads. Rows at or past max_row are zero-filled: row_ptr gets r = 0, and nothing is read.
// Every row's address is computed before the first copy is issued, so lookups overlap instead of each waiting
// behind the previous row's cp.async.
template <class TiledCopy, class RowPtr, class Dst, class Coord>
__device__ __forceinline__ void copy_rows_zfill(TiledCopy const& tiled_copy, RowPtr const& row_ptr, Dst&& dst,
                                                Coord const& coord, int max_row, int max_col) {
  constexpr int kRows = decltype(size<1>(dst))::value;
  decltype(row_ptr(0, 0)) src_rows[kRows];
  CUTE_UNROLL
  for (int m = 0; m < kRows; ++m) {
    const int row = get<0>(coord(0, m, 0));
    // The thread's first column goes into the row's address, so its further copies of the row sit at constant
    // offsets that ptxas folds into the copy instructions (else each pays a 64-bit add and shift).
    src_rows[m] = row_ptr(m, row < max_row ? row : 0) + get<1>(coord(0, m, 0));
  }
  CUTE_UNROLL
  for (int m = 0; m < kRows; ++m) {
    const bool row_ok = get<0>(coord(0, m, 0)) < max_row;
    const auto* src_row = src_rows[m];
    CUTE_UNROLL
    for (int k = 0; k < size<2>(dst); ++k) {
      const int col = get<1>(coord(0, m, k));
      Tensor src = make_tensor(make_gmem_ptr(src_row + (col - get<1>(coord(0, m, 0)))),
                               make_layout(shape(dst(_, m, k))));
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
