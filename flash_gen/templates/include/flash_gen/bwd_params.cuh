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
  const float* lse;           // (batch, nheads, seqlen_q) from the forward, natural log
  float* lse_log2;            // (batch, nheads, seqlen_q_rounded): lse * log2(e), +inf on padding rows
  float* dsum;                // (batch, nheads, seqlen_q_rounded): rowsum(dO * O), 0 on padding rows
  float* dq_accum;            // (batch, nheads, seqlen_q_rounded, dq_accum_cols) fp32, zeroed by preprocess
  int* dq_semaphore;          // (batch, nheads, num_m_blocks), deterministic kernels only (else nullptr)
  const float* alibi_slopes;  // (nheads,) or (batch, nheads); nullptr unless built with ALiBi

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

  int batch, nheads, nheads_k, seqlen_q, seqlen_k;
  int seqlen_q_rounded;  // seqlen_q rounded up to the main kernel's block_m: the fp32 buffers' row count
  int head_dim;          // runtime copy for the head-dim-generic preprocess/convert kernels
  int dq_accum_cols;     // the main kernel's padded head dim
  int num_m_blocks;      // seqlen_q_rounded / block_m
  int window_left, window_right;  // as in FwdParams

  float score_scale;    // as in FwdParams
  float scale_log2;     // as in FwdParams
  float alibi_scale;    // as in FwdParams
  float softmax_scale;  // dQ and dK are softmax_scale * (dS K) and softmax_scale * (dS^T Q)
};

}  // namespace flash_gen
