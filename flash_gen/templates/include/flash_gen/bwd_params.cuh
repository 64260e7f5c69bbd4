// Backward-pass launch parameters, shared by the preprocess, main and dQ-convert kernels and passed by value
// as one __grid_constant__ struct. flash_gen/runtime/bwd.py mirrors this layout with ctypes: change both
// together.
#pragma once
#include <cuda/std/cstdint>

namespace flash_gen {
using cuda::std::int64_t;

struct BwdParams {
  const void* q;
  const void* k;
  const void* v;
  const void* o;
  const void* dout;
  void* dq;
  void* dk;
  void* dv;
  const float* lse;           // the forward's, natural log: (batch, nheads, seqlen_q), or (nheads, total_q)
  // Row-padded fp32 buffers, one row per query row plus padding to the main kernel's block_m (see acc_row0):
  float* lse_log2;            // lse * log2(e), +inf on padding rows
  float* dsum;                // rowsum(dO * O), 0 on padding rows
  float* dq_accum;            // dq_accum_cols fp32 per row, zeroed by preprocess
  int* dq_semaphore;          // deterministic kernels only (else nullptr): entry at each query tile's first row
  const float* alibi_slopes;  // (nheads,) or (batch, nheads); nullptr unless built with ALiBi
  const int* cu_seqlens_q;    // (batch + 1) row offsets of a packed ragged batch; nullptr when dense
  const int* cu_seqlens_k;

  // Element strides; the last dim of every tensor is contiguous.
  int64_t q_batch_stride, q_row_stride, q_head_stride;
  int64_t k_batch_stride, k_row_stride, k_head_stride;
  int64_t v_batch_stride, v_row_stride, v_head_stride;
  int64_t o_batch_stride, o_row_stride, o_head_stride;
  int64_t do_batch_stride, do_row_stride, do_head_stride;
  int64_t dq_batch_stride, dq_row_stride, dq_head_stride;
  int64_t dk_batch_stride, dk_row_stride, dk_head_stride;
  int64_t dv_batch_stride, dv_row_stride, dv_head_stride;
  int64_t alibi_batch_stride;  // 0 when the slopes are shared across the batch
  int64_t lse_batch_stride, lse_head_stride;
  int64_t acc_batch_stride, acc_head_stride;  // rows of the padded fp32 buffers

  int batch, nheads, nheads_k;
  int seqlen_q, seqlen_k;  // as in FwdParams: per entry when dense, the packed totals when varlen
  int block_m;             // the main kernel's query tile: the fp32 buffers pad each entry to a multiple of it
  int head_dim;            // runtime copy for the head-dim-generic preprocess/convert kernels
  int dq_accum_cols;       // the main kernel's padded head dim
  int window_left, window_right;  // as in FwdParams

  float score_scale;    // as in FwdParams
  float scale_log2;     // as in FwdParams
  float alibi_scale;    // as in FwdParams
  float softmax_scale;  // dQ and dK are softmax_scale * (dS K) and softmax_scale * (dS^T Q)

  // The forward's dropout, as in FwdParams (last, so the other fields keep their offsets).
  unsigned dropout_threshold;
  float dropout_scale;
  const int64_t* rng_state;
};

// Row of the padded fp32 buffers where (batch, head)'s query rows start. Dense: (batch, nheads, rows rounded
// to block_m). Varlen: (nheads, total_q + batch * block_m), entry b from q_start + b * block_m, which leaves
// each entry room for its rows rounded up to block_m.
__device__ __forceinline__ int64_t acc_row0(BwdParams const& p, bool varlen, int batch, int head, int q_start) {
  const int64_t packed = varlen ? q_start + int64_t(batch) * p.block_m : 0;
  return batch * p.acc_batch_stride + head * p.acc_head_stride + packed;
}

}  // namespace flash_gen
