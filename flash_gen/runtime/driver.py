"""The CUDA driver layer: load a cubin into a device's primary context and launch its kernel.

Kernels take one by-value parameter struct (`__global__ void k(const __grid_constant__ Params p)`), passed
from a ctypes.Structure through the C launcher (_launch.c) or, without it, ctypes. PyTorch runs on each
device's primary context, so modules are loaded there and launch on PyTorch's streams.

Importing this module does not initialise CUDA (cuInit runs in load_kernel). torch is imported only inside
device_arch. Must not import anything under flash_gen.build.
"""

from __future__ import annotations

import ctypes
import functools

from cuda.bindings import driver as cu

from flash_gen import errors

try:  # setup.py builds it where a C compiler is present; without it launches go through ctypes (slower)
    from flash_gen.runtime import _launch as _c_launch
except ImportError:
    _c_launch = None

_MAX_DYNAMIC_SMEM = cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
_DEFAULT_SMEM_LIMIT = 48 * 1024  # dynamic shared memory a kernel may use without opting in
_primary_contexts: dict[int, cu.CUcontext] = {}  # retained once per device, never released (as PyTorch does)
_ParamPointer = ctypes.c_void_p * 1  # kernelParams: void*[1] -> the parameter struct (the type built once)


def check(result: tuple, call: str):
    """Unpack a cuda-bindings (CUresult, *values) tuple: raise errors.CudaError on failure, else return
    None, the single value, or a tuple of values."""
    err, *values = result
    if err:
        raise cuda_error(call, err)
    if not values:
        return None
    return values[0] if len(values) == 1 else tuple(values)


def cuda_error(call: str, err) -> errors.CudaError:
    return errors.CudaError(call, int(err), getattr(err, "name", str(err)))


@functools.cache
def _cu_launch_kernel() -> ctypes._CFuncPtr:
    """libcuda's cuLaunchKernel through ctypes, for builds without the C launcher. No argtypes: ctypes then passes
    Python ints as C ints (the grid, block and smem sizes, all below 2^31) and pointers as given, c_void_p objects
    and the kernelParams array, which skips a conversion per argument."""
    fn = ctypes.CDLL("libcuda.so.1").cuLaunchKernel
    fn.restype = ctypes.c_int
    return fn


def pack_params(params: ctypes.Structure, patches: tuple[int, ...], patch_base: int) -> ctypes.Structure:
    """A copy of `params` with `patches` applied: (offset, value, offset, value, ...), each value 8 bytes written at
    byte patch_base + offset. The C launcher's pack() does the same."""
    out = type(params).from_buffer_copy(params)
    for i in range(0, len(patches), 2):
        offset = patch_base + patches[i]
        if offset < 0 or offset + 8 > ctypes.sizeof(out):
            raise ValueError(f"patch at byte {offset} outside the {ctypes.sizeof(out)}-byte parameters")
        ctypes.c_uint64.from_buffer(out, offset).value = patches[i + 1]
    return out


class Kernel:
    """One kernel loaded on one device. The module is kept here so the function stays valid."""

    __slots__ = ("entry", "device", "module", "function", "_handle")

    def __init__(self, entry: str, device: int, module: cu.CUmodule, function: cu.CUfunction) -> None:
        self.entry, self.device, self.module, self.function = entry, device, module, function
        self._handle = int(function)  # the CUfunction pointer

    def launch(
        self,
        grid: tuple[int, int, int],
        block: tuple[int, int, int],
        smem: int,
        stream: int,
        params: ctypes.Structure,
        patches: tuple[int, ...] = (),
        patch_base: int = 0,
    ) -> None:
        """Launch on `stream` (a CUstream handle as an int, e.g. torch.cuda.current_stream().cuda_stream) with a
        copy of `params`, patched as pack_params says, as the kernel's single argument: the per-call tensor
        addresses go in as patches, so `params` can be a template kept per shape. The stream must belong to this
        kernel's device."""
        if _c_launch is not None:
            err = _c_launch.launch(self._handle, grid[0], grid[1], grid[2], block[0], block[1], block[2], smem,
                                   stream, params, patches, patch_base)
        else:
            if patches:
                params = pack_params(params, patches, patch_base)
            err = _cu_launch_kernel()(ctypes.c_void_p(self._handle), grid[0], grid[1], grid[2], block[0], block[1],
                                      block[2], smem, ctypes.c_void_p(stream),
                                      _ParamPointer(ctypes.addressof(params)), None)
        if err:
            raise cuda_error("cuLaunchKernel", cu.CUresult(err))


def load_kernel(cubin: bytes, entry: str, smem_bytes: int, device: int) -> Kernel:
    """Load `cubin` into `device`'s primary context and look up `entry`; `smem_bytes` is the dynamic shared
    memory the kernel will be launched with (above 48 KiB the kernel must opt in, done here)."""
    primary = _primary_context(device)
    current = check(cu.cuCtxGetCurrent(), "cuCtxGetCurrent")
    if not int(current):
        # Nothing current on this thread yet: make it the primary context, as the runtime API would.
        check(cu.cuCtxSetCurrent(primary), "cuCtxSetCurrent")
    # Another device's context is current: load under `device`'s context without changing PyTorch's device.
    switch = bool(int(current)) and int(current) != int(primary)
    if switch:
        check(cu.cuCtxPushCurrent(primary), "cuCtxPushCurrent")
    try:
        module = check(cu.cuModuleLoadData(cubin), "cuModuleLoadData")
        function = check(cu.cuModuleGetFunction(module, entry.encode()), f"cuModuleGetFunction({entry})")
        if smem_bytes > _DEFAULT_SMEM_LIMIT:
            check(cu.cuFuncSetAttribute(function, _MAX_DYNAMIC_SMEM, smem_bytes),
                  f"cuFuncSetAttribute({entry}, MAX_DYNAMIC_SHARED_SIZE_BYTES={smem_bytes})")
    finally:
        if switch:
            check(cu.cuCtxPopCurrent(), "cuCtxPopCurrent")
    return Kernel(entry, device, module, function)


def _primary_context(device: int) -> cu.CUcontext:
    ctx = _primary_contexts.get(device)
    if ctx is None:
        check(cu.cuInit(0), "cuInit")
        dev = check(cu.cuDeviceGet(device), "cuDeviceGet")
        ctx = _primary_contexts[device] = check(cu.cuDevicePrimaryCtxRetain(dev), "cuDevicePrimaryCtxRetain")
    return ctx


@functools.lru_cache(maxsize=None)  # called on per-call paths (KV-cache append, split-KV combine)
def device_arch(device: int) -> str:
    """The compile target for `device`: "sm80" (8.x), "sm90" (9.0) or "sm100" (10.x)."""
    import torch  # here, not at module level: only this helper needs it

    major, minor = torch.cuda.get_device_capability(device)
    if major == 8:
        return "sm80"
    if (major, minor) == (9, 0):
        return "sm90"
    if major == 10:
        return "sm100"
    raise RuntimeError(f"flash_gen has no kernels for compute capability {major}.{minor} (device {device}); "
                       "supported: 8.x, 9.0, 10.x")


@functools.lru_cache(maxsize=None)
def sm_count(device: int) -> int:
    """Streaming multiprocessors of `device` (split-KV's heuristic fills them)."""
    import torch

    return torch.cuda.get_device_properties(device).multi_processor_count
