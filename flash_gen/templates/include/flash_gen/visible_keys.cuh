// The key tiles a forward query tile needs: those that any of its rows may see under the mask.
#pragma once
#include "flash_gen/attn_mask.cuh"

namespace flash_gen {

// Key tiles [n_min, n_max) of kBlockN keys that a query position in [pos0, pos_last] can see (attn_mask.cuh's
// convention: position i sees key j iff i + diag - window_left <= j <= i + diag + window_right). n_min may exceed
// n_max when no row sees any key.
template <Mask kMask, int kBlockN>
__device__ __forceinline__ void visible_key_tiles(int pos0, int pos_last, int seqlen_k, int diag, int window_left,
                                                  int window_right, int& n_min, int& n_max) {
  n_max = (seqlen_k + kBlockN - 1) / kBlockN;
  n_min = 0;
  if constexpr (MaskBounds<kMask>::kRight) {
    const int last_col = pos_last + diag + window_right;  // inclusive
    n_max = min(n_max, max(0, last_col + kBlockN) / kBlockN);
  }
  if constexpr (MaskBounds<kMask>::kLeft) n_min = max(0, pos0 + diag - window_left) / kBlockN;
}

}  // namespace flash_gen
