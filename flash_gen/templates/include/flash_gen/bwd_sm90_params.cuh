// Parameters of the Hopper backward kernel (bwd_sm90.cuh); mirrored by flash_gen.runtime.bwd.Sm90BwdParams.
#pragma once
#include "flash_gen/bwd_params.cuh"
#include "flash_gen/fwd_sm90_params.cuh"  // TensorMap

namespace flash_gen {

// BwdParams after TMA maps of q and dout (b, s, h, d) with boxes of 64 columns by block_m rows.
struct Sm90BwdParams {
  TensorMap tma_q, tma_do;
  BwdParams base;
};

}  // namespace flash_gen
