// Parameters of the Hopper forward kernel (fwd_sm90.cuh); mirrored by flash_gen.runtime.fwd.Sm90FwdParams.
#pragma once
#include "flash_gen/fwd_params.cuh"

namespace flash_gen {

// A CUtensorMap as filled on the host by cuTensorMapEncodeTiled (flash_gen/runtime/tma.py), passed inside a
// __grid_constant__ parameter so that TMA instructions can address it.
struct alignas(64) TensorMap {
  unsigned char bytes[128];
};

// The portable kernel's parameters after TMA maps of q, k, v, o (b, s, h, d) with boxes of 64 columns by one
// consumer warpgroup's 64 rows (q, o) or by a key tile's rows (k, v).
struct Sm90FwdParams {
  TensorMap tma_q, tma_k, tma_v, tma_o;
  FwdParams base;
};

}  // namespace flash_gen
