// Parameters of the Hopper backward kernel (bwd_sm90.cuh); mirrored by flash_gen.runtime.bwd.Sm90BwdParams.
#pragma once
#include "flash_gen/bwd_params.cuh"
#include "flash_gen/fwd_sm90_params.cuh"  // TensorMap

namespace flash_gen {

// BwdParams after TMA maps of q and dout (b, s, h, d) with boxes of 64 columns by block_m rows, and of dq_accum
// (1, rows, 1, head dim) in fp32 with boxes of 32 columns by block_m rows (bulk dQ; unused otherwise).
struct Sm90BwdParams {
  TensorMap tma_q, tma_do, tma_dq;
  BwdParams base;
};

}  // namespace flash_gen
