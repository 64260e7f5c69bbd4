"""How fast the tensor cores run chains of SS wgmmas issued by one warpgroup alone against two at once: the
backward's S^T/dP^T step (docs/hopper_backward.md, "One warpgroup's S^T and dP^T alone") as a micro benchmark.

    python3 benchmarks/wgmma_rate.py [--iters 2000]

One CTA of two warpgroups per SM (132 CTAs), the operands in shared memory as the backward keeps them (K and V:
64 rows per warpgroup; Q and dO: N rows shared by both, head dim 128, bf16, 128-byte swizzle). Warpgroup 0 runs
`iters` batches of GEMMs (64 x N x 128 each: 8 k-blocks of HGMMA.64xNx16) and, per the variant, waits for every
batch or keeps two in flight; warpgroup 1 idles, runs the same GEMMs, or loads and stores shared memory with
16-byte accesses meanwhile (as a softmax and dS store would). Prints the tensor rate per SM as a share of the dense
peak (4096 FLOP per SM and cycle, bf16), from each warpgroup's clock64 span. Needs an sm_90 GPU; compiles through
NVRTC.
"""

from __future__ import annotations

import argparse
import ctypes

import torch

from flash_gen.build import nvrtc
from flash_gen.runtime import driver

PEAK_FLOP_PER_CYCLE = 4096  # dense bf16 per SM: 989 TFLOP/s / (132 SMs x 1.83 GHz)

SOURCE = r"""
#define CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED  // N = 80 (the backward's 80-query steps)
#include <cute/tensor.hpp>
#include "flash_gen/sm90_wgmma.cuh"
using namespace cute;
using namespace flash_gen;

struct RateParams {
  float* sink;          // written only if the accumulators sum to an impossible value (keeps them live)
  long long* cycles;    // (CTA, warpgroup): clock64 span of the loop
  int iters;
  int mode;             // warpgroup 1: 0 idle, 1 the same GEMMs, 2 shared-memory stores and loads (no GEMMs)
};

// kGemms GEMMs per batch (S^T = K Q^T, then dP^T = V dO^T); kWaitEach: wait for every batch, else keep two in flight.
template <int N, int kGemms, bool kWaitEach>
__device__ __forceinline__ void rate_body(RateParams const& p) {
  using Elt = cute::bfloat16_t;
  using LayoutA = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<Elt>{}, Shape<_128, _128>{}));
  using LayoutB = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<Elt>{}, Shape<Int<N>, _128>{}));
  using Mma = decltype(make_tiled_mma(GMMA::ss_op_selector<Elt, Elt, float, Shape<_64, Int<N>, _128>>(),
                                      Layout<Shape<_2, _1, _1>>{}));
  extern __shared__ __align__(1024) char smem[];
  constexpr int kA = 128 * 128, kB = N * 128;
  Elt* base = reinterpret_cast<Elt*>(smem);
  volatile int* done = reinterpret_cast<volatile int*>(base + 2 * (kA + kB));
  uint4* scratch = reinterpret_cast<uint4*>(base + 2 * (kA + kB) + 512);  // 32 KB of its own
  for (int i = threadIdx.x; i < 2 * (kA + kB) / 8; i += blockDim.x)
    reinterpret_cast<uint4*>(base)[i] = make_uint4(0x3c003c00u, 0, 0x3c003c00u, 0);
  if (threadIdx.x == 0) *done = 0;
  __syncthreads();
  const int wg = threadIdx.x / 128;
  if (wg == 1 && p.mode == 0) return;
  if (wg == 1 && p.mode == 2) {  // a softmax-like neighbour: 16-byte stores and loads, 2 KB per warpgroup pass
    const int t = threadIdx.x % 128;
    uint4 v = make_uint4(t, 1, 2, 3);
    long long n = 0;
    while (!*done) {
      CUTE_UNROLL
      for (int r = 0; r < 8; ++r) {
        scratch[(r * 128 + t) % 2048] = v;
        const uint4 w = scratch[((r + 4) * 128 + t) % 2048];
        v.x += w.y;
      }
      ++n;
    }
    if (v.x == 0xdeadbeef) p.sink[t] = float(n);
    return;
  }
  Tensor sK = make_tensor(make_smem_ptr(base), LayoutA{});
  Tensor sV = make_tensor(make_smem_ptr(base + kA), LayoutA{});
  Tensor sQ = make_tensor(make_smem_ptr(base + 2 * kA), LayoutB{});
  Tensor sdO = make_tensor(make_smem_ptr(base + 2 * kA + kB), LayoutB{});
  Mma mma;
  auto desc = mma.get_thread_slice(wg * 128);
  Tensor tK = desc.partition_fragment_A(sK), tV = desc.partition_fragment_A(sV);
  Tensor tQ = desc.partition_fragment_B(sQ), tdO = desc.partition_fragment_B(sdO);
  Tensor acc_s = partition_fragment_C(mma, Shape<_128, Int<N>>{});
  Tensor acc_dp = partition_fragment_C(mma, Shape<_128, Int<N>>{});
  clear(acc_s);
  clear(acc_dp);
  const long long t0 = clock64();
  for (int it = 0; it < p.iters; ++it) {
    wgmma_issue<false>(mma, tK, tQ, acc_s);
    if constexpr (kGemms == 2) wgmma_issue<false>(mma, tV, tdO, acc_dp);
    if constexpr (kWaitEach) warpgroup_wait<0>();
    else warpgroup_wait<kGemms>();
  }
  warpgroup_wait<0>();
  const long long t1 = clock64();
  float s = 0.f;
  for (int i = 0; i < size(acc_s); ++i) s += acc_s(i) + acc_dp(i);
  if (s == -1.2345f) p.sink[threadIdx.x] = s;
  if (threadIdx.x % 128 == 0) p.cycles[blockIdx.x * 2 + wg] = t1 - t0;
  if (threadIdx.x == 0) *done = 1;
}

#define RATE_KERNEL(N, G, W) \
  extern "C" __global__ void __launch_bounds__(256, 1) rate_n##N##_g##G##_w##W(const __grid_constant__ RateParams p) { \
    rate_body<N, G, W>(p); \
  }
RATE_KERNEL(80, 1, 1)
RATE_KERNEL(80, 2, 1)
RATE_KERNEL(80, 2, 0)
RATE_KERNEL(128, 1, 1)
RATE_KERNEL(128, 2, 1)
RATE_KERNEL(128, 2, 0)
"""

MODES = ("idle", "the same GEMMs", "shared-memory traffic")
VARIANTS = [(n, g, w) for n in (80, 128) for g, w in ((1, 1), (2, 1), (2, 0))]


class RateParams(ctypes.Structure):
    _fields_ = [("sink", ctypes.c_void_p), ("cycles", ctypes.c_void_p), ("iters", ctypes.c_int),
                ("mode", ctypes.c_int)]


def entry(n: int, g: int, w: int) -> str:
    return f"rate_n{n}_g{g}_w{w}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iters", type=int, default=2000)
    args = ap.parse_args()
    results = nvrtc.compile_many(SOURCE, [entry(*v) for v in VARIANTS], "sm90")
    for r in results:
        if r.spill_stores or r.wgmma_serialized:
            print(f"{r.entry}: spills {r.spill_stores} B, serialised {r.wgmma_serialized}")
    sms = driver.sm_count(0)
    sink = torch.zeros(256, device="cuda")
    cycles = torch.zeros(sms * 2, dtype=torch.int64, device="cuda")
    stream = torch.cuda.current_stream().cuda_stream
    print("| N | GEMMs per batch | wait | warpgroup 1 | cycles per batch | share of peak per SM |")
    print("|---|---|---|---|---|---|")
    for (n, g, w), r in zip(VARIANTS, results):
        smem = 2 * (128 * 128 + n * 128) * 2 + 1024 + 32768
        kernel = driver.load_kernel(r.cubin, r.entry, smem, 0)
        for mode in (0, 1, 2):
            params = RateParams(sink.data_ptr(), cycles.data_ptr(), args.iters, mode)
            for _ in range(2):  # the first launch warms the clocks up
                cycles.zero_()
                kernel.launch((sms, 1, 1), (256, 1, 1), smem, stream, params)
            torch.cuda.synchronize()
            gemm_wgs = 2 if mode == 1 else 1
            span = cycles.view(sms, 2)[:, :gemm_wgs].max(dim=1).values.double().median().item()
            flop = gemm_wgs * g * 2 * 64 * n * 128 * args.iters
            print(f"| {n} | {g} | {'each' if w else 'two in flight'} | {MODES[mode]} | {span / args.iters:.0f} | "
                  f"{flop / span / PEAK_FLOP_PER_CYCLE:.2f} |")


if __name__ == "__main__":
    main()
