// Forward-kernel launch parameters, passed by value as one __grid_constant__ struct.
// flash_gen/runtime/fwd.py mirrors this layout with ctypes: change both together.
#pragma once
#include <cuda/std/cstdint>

namespace flash_gen {
using cuda::std::int64_t;

struct FwdParams {
  const void* q;
  const void* k;
  const void* v;
  void* o;
  float* lse;                  // (batch, nheads, seqlen_q), or (nheads, total_q) when varlen
  const float* alibi_slopes;   // (nheads,) or (batch, nheads); nullptr unless the kernel is built with ALiBi
  const int* cu_seqlens_q;     // (batch + 1) row offsets of a packed ragged batch; varlen kernels only
  const int* cu_seqlens_k;
  // KV-cache kernels (kv_cache.cuh): entry b's keys are rows [leftpad_k[b], seqused_k[b]) of cache entry
  // kv_batch_idx[b], or of the pages listed in block_table[b]. nullptr: seqlen_k rows, no padding, entry b.
  const int* seqused_k;
  const int* leftpad_k;
  const int* kv_batch_idx;
  const int* block_table;      // (batch, block_table_stride) page indices; K/V are then (pages, page_size, ...)
  float* o_partial;            // split-KV: (num_splits, batch, nheads, seqlen_q, head_dim), normalised per split
  float* lse_partial;          // split-KV: (num_splits, batch, nheads, seqlen_q), -inf where a split saw no key

  // Element strides; the last dim of every tensor is contiguous.
  int64_t q_batch_stride, q_row_stride, q_head_stride;
  int64_t k_batch_stride, k_row_stride, k_head_stride;
  int64_t v_batch_stride, v_row_stride, v_head_stride;
  int64_t o_batch_stride, o_row_stride, o_head_stride;
  int64_t alibi_batch_stride;  // 0 when the slopes are shared across the batch
  int64_t lse_batch_stride, lse_head_stride;
  int64_t block_table_stride;

  int batch, nheads, nheads_k;
  int seqlen_q, seqlen_k;  // per entry when dense; the packed totals when varlen (seq_info.cuh); for a KV
                           // cache, seqlen_k is the rows an entry can hold (the cache length, or pages x page_size)
  // Visible keys of query i: [i + seqlen_k - seqlen_q - window_left, i + seqlen_k - seqlen_q + window_right].
  // The host turns "infinite" (-1) into a bound past the sequence, so the kernel compares plain integers.
  int window_left, window_right;
  int kv_batches;  // KV-cache kernels: cache entries (K/V batch dim) when not paged, pages when paged
  int page_size;   // paged: rows per page
  int num_splits;  // split-KV kernels: CTAs per (query tile, head, entry) along the keys
  int head_dim;    // runtime copy for the head-dim-generic combine kernel

  float score_scale;  // softcap only: QK^T is multiplied by softmax_scale / softcap before tanh
  float scale_log2;   // turns a score into a base-2 logit: softmax_scale*log2(e), or softcap*log2(e)
  float alibi_scale;  // turns slope*distance into score units: 1/softmax_scale, or 1/softcap

  // Dropout (last, so the other fields keep their offsets in kernels built without it): a score is kept when its
  // 16 random bits (philox.cuh) are below dropout_threshold, and its probability then scaled by dropout_scale =
  // 1 / (1 - dropout_p). rng_state[0] is the call's seed; nullptr without dropout.
  unsigned dropout_threshold;
  float dropout_scale;
  const int64_t* rng_state;
};

}  // namespace flash_gen
