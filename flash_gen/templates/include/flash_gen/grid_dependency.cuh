// Programmatic dependent launch (Hopper and later; no-ops on earlier archs). A kernel launched as dependent
// (flash_gen.runtime.driver.Kernel.launch(dependent=True)) may start once every CTA of the stream's previous kernel
// has called allow_dependent_launch, so its launch and setup overlap that kernel's tail; it must call
// wait_for_predecessor before reading anything the previous kernel writes.
#pragma once

namespace flash_gen {

// Let the stream's next kernel, if launched as dependent, start launching.
__device__ __forceinline__ void allow_dependent_launch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// Wait until the stream's previous kernel has finished and its writes are visible (at once unless this kernel was
// launched as dependent).
__device__ __forceinline__ void wait_for_predecessor() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

}  // namespace flash_gen
