// flash_attn_with_kvcache's host-side steps in one launch: the new keys (rotated) and values written into the
// KV cache at rows cache_seqlens[b] + i (through the block table when paged), and q rotated into q_out. Takes the
// head dim at run time and includes no CuTe (one compile per dtype). One warp per (entry, row, head) row; lane l
// owns elements [8l, 8l + 8). Positions, entries and pages are clamped to the tensors: bad index values give
// wrong rows, never an access outside them.
#pragma once
#include <cuda/std/cstdint>

#include "flash_gen/half_bits.cuh"

namespace flash_gen {
using cuda::std::int64_t;

// flash_gen/runtime/kvcache.py mirrors this layout with ctypes: change both together.
struct AppendParams {
  const void* q;            // (batch, seqlen_q, nheads, d); rotated into q_out (nullptr: no rotary)
  void* q_out;
  const void* k_new;        // (batch, seqlen_new, nheads_k, d); nullptr: nothing to append
  const void* v_new;
  void* k_cache;            // (entries or pages, rows, nheads_k, d)
  void* v_cache;
  const float* cos;         // (seqlen_ro, rotary_half) fp32; nullptr: no rotary
  const float* sin;
  const int* cache_seqlens;  // (batch,), or nullptr: seqlen_int for every entry
  const int* batch_idx;      // (batch,) cache entry per batch entry, or nullptr: b
  const int* block_table;    // (batch, pages per entry), or nullptr: contiguous cache
  int64_t q_batch_stride, q_row_stride, q_head_stride;
  int64_t qo_batch_stride, qo_row_stride, qo_head_stride;
  int64_t kn_batch_stride, kn_row_stride, kn_head_stride;
  int64_t vn_batch_stride, vn_row_stride, vn_head_stride;
  int64_t kc_batch_stride, kc_row_stride, kc_head_stride;
  int64_t vc_batch_stride, vc_row_stride, vc_head_stride;
  int64_t block_table_stride;
  int batch, seqlen_q, seqlen_new, nheads, nheads_k, head_dim;
  int rotary_half;   // rotary_dim / 2
  int seqlen_ro;     // rows of cos / sin
  int seqlen_int;    // cache_seqlens when it is a host int
  int kv_entries;    // K/V dim 0: cache entries, or pages
  int rows;          // K/V dim 1: rows per entry, or the page size
  int capacity;      // rows an entry can hold (rows, or pages per entry x page size)
  int q_same_pos;    // 1: every query row sits at cache_seqlens[b] (no causal/local mask), else + its index
  int interleaved;   // 1: rotate pairs (2i, 2i+1) (GPT-J), else (i, i + rotary_half) (GPT-NeoX)
};

constexpr int kAppendThreads = 128;
constexpr int kAppendRows = kAppendThreads / 32;

template <bool kBf16>
__device__ __forceinline__ void load8(const void* src, float (&x)[8]) {
  const uint4 v = *reinterpret_cast<const uint4*>(src);
  const unsigned w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    x[2 * j] = to_float<kBf16>(w[j] & 0xffff);
    x[2 * j + 1] = to_float<kBf16>(w[j] >> 16);
  }
}

template <bool kBf16>
__device__ __forceinline__ void store8(void* dst, const float (&x)[8]) {
  unsigned w[4];
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    w[j] = from_float<kBf16>(x[2 * j]) | (static_cast<unsigned>(from_float<kBf16>(x[2 * j + 1])) << 16);
  }
  *reinterpret_cast<uint4*>(dst) = make_uint4(w[0], w[1], w[2], w[3]);
}

// Rotate this lane's 8 elements (column col0 = 8 * lane) by the angles of position `pos`. Every lane of the warp
// must call it (NeoX pairs sit rotary_half / 8 lanes apart and come by shuffle).
__device__ __forceinline__ void rotate8(AppendParams const& p, float (&x)[8], int col0, int pos) {
  const int half = p.rotary_half, lane = threadIdx.x % 32;
  const int row = min(max(pos, 0), p.seqlen_ro - 1) * half;
  float partner[8];
  if (!p.interleaved) {
    const int src = col0 < half ? lane + half / 8 : lane - half / 8;  // pairs (i, i + half); half % 8 == 0
    const int from = col0 < 2 * half && src >= 0 && src < 32 ? src : lane;
#pragma unroll
    for (int j = 0; j < 8; ++j) partner[j] = __shfl_sync(0xffffffff, x[j], from);
  }
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    const int e = col0 + j;
    if (e >= 2 * half) break;
    if (p.interleaved) {
      if (j % 2) continue;  // pair (e, e + 1), e even, both in this lane
      const float c = p.cos[row + e / 2], s = p.sin[row + e / 2];
      const float x0 = x[j], x1 = x[j + 1];
      x[j] = x0 * c - x1 * s;
      x[j + 1] = x0 * s + x1 * c;
    } else {
      const int a = e % half;
      const float c = p.cos[row + a], s = p.sin[row + a];
      x[j] = e < half ? x[j] * c - partner[j] * s : partner[j] * s + x[j] * c;
    }
  }
}

template <bool kBf16>
__device__ __forceinline__ void kv_append(AppendParams const& p) {
  const int lane = threadIdx.x % 32, col0 = 8 * lane;
  int64_t item = int64_t(blockIdx.x) * kAppendRows + threadIdx.x / 32;
  const int64_t k_items = p.k_new != nullptr ? int64_t(p.batch) * p.seqlen_new * p.nheads_k : 0;
  const int64_t q_items = p.cos != nullptr ? int64_t(p.batch) * p.seqlen_q * p.nheads : 0;
  const bool active = col0 < p.head_dim;
  float x[8];
  if (item < k_items) {  // one new key/value row of one KV head
    const int h = item % p.nheads_k, i = item / p.nheads_k % p.seqlen_new, b = item / p.nheads_k / p.seqlen_new;
    const int start = p.cache_seqlens != nullptr ? p.cache_seqlens[b] : p.seqlen_int;
    const int pos = min(max(start + i, 0), p.capacity - 1);
    int entry, row;
    if (p.block_table != nullptr) {
      entry = p.block_table[b * p.block_table_stride + pos / p.rows];
      row = pos % p.rows;
    } else {
      entry = p.batch_idx != nullptr ? p.batch_idx[b] : b;
      row = pos;
    }
    entry = min(max(entry, 0), p.kv_entries - 1);
    const auto* kn = static_cast<const unsigned short*>(p.k_new) + b * p.kn_batch_stride + i * p.kn_row_stride +
                     h * p.kn_head_stride + col0;
    if (active) load8<kBf16>(kn, x);
    if (p.cos != nullptr) rotate8(p, x, col0, start + i);
    if (active) {
      store8<kBf16>(static_cast<unsigned short*>(p.k_cache) + entry * p.kc_batch_stride + row * p.kc_row_stride +
                        h * p.kc_head_stride + col0, x);
      const auto* vn = static_cast<const unsigned short*>(p.v_new) + b * p.vn_batch_stride + i * p.vn_row_stride +
                       h * p.vn_head_stride + col0;
      *reinterpret_cast<uint4*>(static_cast<unsigned short*>(p.v_cache) + entry * p.vc_batch_stride +
                                row * p.vc_row_stride + h * p.vc_head_stride + col0) =
          *reinterpret_cast<const uint4*>(vn);
    }
    return;
  }
  item -= k_items;
  if (item < q_items) {  // one query row of one head
    const int h = item % p.nheads, i = item / p.nheads % p.seqlen_q, b = item / p.nheads / p.seqlen_q;
    const int start = p.cache_seqlens != nullptr ? p.cache_seqlens[b] : p.seqlen_int;
    const auto* q = static_cast<const unsigned short*>(p.q) + b * p.q_batch_stride + i * p.q_row_stride +
                    h * p.q_head_stride + col0;
    if (active) load8<kBf16>(q, x);
    rotate8(p, x, col0, start + (p.q_same_pos ? 0 : i));
    if (active) {
      store8<kBf16>(static_cast<unsigned short*>(p.q_out) + b * p.qo_batch_stride + i * p.qo_row_stride +
                        h * p.qo_head_stride + col0, x);
    }
  }
}

}  // namespace flash_gen
