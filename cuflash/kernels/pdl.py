"""Programmatic dependent launch (sm_90+): a kernel launched so that it may start while the
previous kernel on the stream is still running - once every block of that kernel has executed
`griddepcontrol.launch_dependents` or exited. CuPy's launch cannot ask for it, so this launches a
CuPy RawKernel's function through cuda-bindings' cuLaunchKernelEx with the programmatic
stream-serialization attribute.

The dependent kernel must not read what the previous one writes before `griddepcontrol.wait`
(cuda_src/common.cuh, pdl_wait). Its user: decode's combine kernel, whose blocks are resident and
waiting when the split kernel's last block ends instead of launching after it (H200: +0.3% on the
long-context cell that merges that way, +3% where the combine is forced on a 4k cache). On the
H200 the stream order stays transitive: work after a dependent that never waits still starts after
the kernel before it (tests/test_gpu_pdl.py). Where this is unavailable (no cuda-bindings, a GPU
before sm_90) `launch` is CuPy's ordinary launch, also correct: the instructions are no-ops
without a programmatic dependency.

Host cost: ~25-45 us more per launch than CuPy's (the ctypes parameter buffers and the
cuda-bindings call), so it is used only where the GPU time is long next to it."""

from __future__ import annotations

import ctypes

import numpy as np

from . import device

_ENABLED = True  # tests switch it off to compare against the ordinary launch


def available() -> bool:
    """cuda-bindings is installed and the current device is sm_90 or newer."""
    if not _ENABLED:
        return False
    try:
        from cuda.bindings import driver  # noqa: F401
    except ImportError:
        return False
    return device.compute_capability(device.current_id()) >= 90


def _param_bytes(arg) -> bytes:
    """The bytes CuPy would pass for one kernel argument: a device pointer for an ndarray, the
    value of a NumPy scalar (a structured scalar, such as a tensor map, by value)."""
    import cupy

    if isinstance(arg, cupy.ndarray):
        return np.uint64(arg.data.ptr).tobytes()
    if isinstance(arg, (np.generic, np.ndarray)):
        return np.asarray(arg).tobytes()
    raise TypeError(f"kernel argument of type {type(arg).__name__}: pass NumPy scalars or CuPy arrays")


_configs: dict = {}  # (grid, block, shared memory, stream) -> CUlaunchConfig with the attribute


def _config(grid, block, shared_mem: int, stream: int):
    key = (grid, block, shared_mem, stream)
    cfg = _configs.get(key)
    if cfg is None:
        from cuda.bindings import driver as cu

        attr = cu.CUlaunchAttribute()
        attr.id = cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
        attr.value.programmaticStreamSerializationAllowed = 1
        cfg = cu.CUlaunchConfig()
        cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ = grid
        cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ = block
        cfg.sharedMemBytes = shared_mem
        cfg.hStream = cu.CUstream(init_value=stream)
        cfg.attrs = [attr]
        cfg.numAttrs = 1
        if len(_configs) > 256:
            _configs.clear()
        _configs[key] = cfg
    return cfg


def launch(fn, grid, block, args, shared_mem: int = 0) -> None:
    """Launch RawKernel `fn` like `fn(grid, block, args, shared_mem=...)`, on the current stream,
    as a programmatic dependent of the kernel before it (ordinary launch where unavailable)."""
    if not available():
        fn(grid, block, args, shared_mem=shared_mem)
        return
    import cupy
    from cuda.bindings import driver as cu

    grid = tuple(int(x) for x in grid) + (1,) * (3 - len(grid))
    block = tuple(int(x) for x in block) + (1,) * (3 - len(block))
    cfg = _config(grid, block, int(shared_mem), cupy.cuda.get_current_stream().ptr)
    # The driver copies each parameter from its buffer at the launch: they need only outlive it.
    bufs = [ctypes.create_string_buffer(_param_bytes(a)) for a in args]
    ptrs = (ctypes.c_void_p * max(len(bufs), 1))(*[ctypes.addressof(b) for b in bufs])
    (err,) = cu.cuLaunchKernelEx(cfg, cu.CUfunction(init_value=fn.kernel.ptr), ctypes.addressof(ptrs), 0)
    if err != cu.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"cuLaunchKernelEx failed ({err}) for {getattr(fn, 'name', fn)}")
