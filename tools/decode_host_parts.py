"""Where one decode call's host time goes (GPU machine): each layer of cuflash.attention timed on
its own, back-to-back calls queued behind a GPU spin (decode_host_profile.host_us: the host never
waits for the GPU).

    python3 tools/decode_host_parts.py [--calls 300]   (more calls than the launch queue holds (~1000 launches) time the GPU instead)
"""
import argparse

import cupy as cp
import numpy as np
import torch

import cuflash
from cuflash.core import problem
from cuflash.api.functional import attention as api
from cuflash.kernels import forward as gpu
from cuflash.kernels import decode as gpu_decode
from cuflash.api import plan_cache
from cuflash.kernels.forward import _elem_strides
from cuflash.core.layout import to_bhsd
from cuflash.core.problem import validate_forward
from decode_host_profile import host_us  # (tools/, this script's folder)


def _device_context():
    with cp.cuda.Device(0):
        pass


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=300)
    args = ap.parse_args()
    b, hq, hkv, nk, d = 8, 32, 8, 4096, 128
    q = cp.random.standard_normal((b, hq, 1, d)).astype(cp.float16)
    k = cp.random.standard_normal((b, hkv, nk, d)).astype(cp.float16)
    v = cp.random.standard_normal((b, hkv, nk, d)).astype(cp.float16)
    p = validate_forward(q, k, v)
    q4, k4, v4 = (to_bhsd(a, p, h, n) for a, h, n in ((q, hq, 1), (k, hkv, nk), (v, hkv, nk)))
    o4 = cp.empty_like(q4)
    lse3 = cp.empty((b, hq, 1), dtype=cp.float32)
    dev = cp.cuda.Device().id
    lp = gpu_decode.launch_plan(p, gpu_decode._sm_count(dev))
    spec = gpu_decode.launch_spec(p.dtype, p.d, False, lp)
    fn = gpu_decode.get_function(spec)
    main_args, _ = gpu_decode._launch_scalars(p, tuple(_elem_strides(a) for a in (q4, k4, v4, o4)) + (0,),
                                              None, lp.chunk)
    grid = (lp.splits, p.hkv, p.batch)
    launch_args = (q4, k4, v4, o4, lse3, np.uint64(0), np.uint64(0), *main_args)
    def uncached():
        with plan_cache.disabled():
            return cuflash.attention(q, k, v)

    parts = {
        "attention (public, interop wrapper)": lambda: cuflash.attention(q, k, v),
        "attention, plan cache off": uncached,
        "plan_cache._key": lambda: plan_cache._key(q, k, v, None, None, (False, None, "bhsd", False, True, None)),
        "api._attention.__wrapped__ (no interop, no plan)": lambda: api._attention.__wrapped__(q, k, v),
        "validate_forward": lambda: validate_forward(q, k, v),
        "two outputs (cupy.empty)": lambda: (cp.empty(q.shape, q.dtype), cp.empty((b, hq, 1), cp.float32)),
        "gpu_decode.forward (outputs given)": lambda: gpu_decode.forward(p, q4, k4, v4, o4, lse3),
        "launch_plan": lambda: gpu_decode.launch_plan(p, gpu_decode._sm_count(dev)),
        "api._forward_outputs": lambda: api._forward_outputs(p, None),
        "problem.warn_if_capture_unsafe": lambda: problem.warn_if_capture_unsafe(),
        "cupy get_current_stream().is_capturing()": lambda: cp.cuda.get_current_stream().is_capturing(),
        "to_bhsd x3": lambda: (to_bhsd(q, p, hq, 1), to_bhsd(k, p, hkv, nk), to_bhsd(v, p, hkv, nk)),
        "gpu.forward (outputs given)": lambda: gpu.forward(p, q4, k4, v4, o4, lse3),
        "gpu_decode.applies": lambda: gpu_decode.applies(p, k4, v4),
        "launch_spec": lambda: gpu_decode.launch_spec(p.dtype, p.d, False, lp),
        "_launch_scalars (cached)": lambda: gpu_decode._launch_scalars(
            p, tuple(_elem_strides(a) for a in (q4, k4, v4, o4)) + (0,), None, lp.chunk),
        "with cupy.cuda.Device(0): pass": _device_context,
        "bare launch (same kernel, cached args)": lambda: fn(grid, (spec.threads,), launch_args,
                                                             shared_mem=spec.smem_bytes),
        "torch sdpa cuDNN (for scale)": None,
    }
    run = cuflash.prepare_attention(q, k, v)
    packed = run._decode.main
    ptrs = (q.data.ptr, k.data.ptr, v.data.ptr, o4.data.ptr, lse3.data.ptr)
    stream = cp.cuda.get_current_stream().ptr
    parts.update({
        "prepare_attention call (cupy)": lambda: run(q, k, v),
        "prepare_attention call (cupy, out=)": lambda: run(q, k, v, out=o4),
        "PackedLaunch.launch (same kernel)": lambda: packed.launch(stream, *ptrs),
    })
    tq, tk, tv = (torch.from_dlpack(a) for a in (q, k, v))
    from torch.nn.attention import SDPBackend, sdpa_kernel
    import torch.nn.functional as F

    def sdpa():
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            return F.scaled_dot_product_attention(tq, tk, tv, enable_gqa=True)
    parts["torch sdpa cuDNN (for scale)"] = sdpa
    trun = cuflash.prepare_attention(tq, tk, tv)
    parts["prepare_attention call (torch)"] = lambda: trun(tq, tk, tv)
    parts["attention (public, torch tensors)"] = lambda: cuflash.attention(tq, tk, tv)

    def torch_uncached():
        with plan_cache.disabled():
            return cuflash.attention(tq, tk, tv)
    parts["attention (public, torch), plan cache off"] = torch_uncached
    # the torch path's layers (cuflash.api.interop): imports, the stream context, the result's export
    import inspect

    from cuflash.api import interop

    torch_stream = interop.external_stream(torch.cuda.current_stream().cuda_stream, 0)

    def dlpack_imports():
        with torch_stream:
            return [cp.from_dlpack(t) for t in (tq, tk, tv)]

    def foreign_call():
        with interop.ForeignCall(interop.Placement(interop.TORCH, 0)):
            pass

    sig = inspect.signature(api._attention.__wrapped__)
    parts.update({
        "interop._import_torch x3": lambda: [interop._import_torch(t) for t in (tq, tk, tv)],
        "cupy.from_dlpack x3 (torch tensors)": dlpack_imports,
        "torch.from_dlpack(o) (the result's export)": lambda: torch.from_dlpack(o4),
        "ForeignCall(torch) enter + exit": foreign_call,
        "interop.common_placement (torch)": lambda: interop.common_placement([("q", tq), ("k", tk), ("v", tv)]),
        "Signature.bind (attention)": lambda: sig.bind(tq, tk, tv),
    })
    # the first row again, last: the first timed row of a run has read far more than later ones
    parts["attention (public, interop wrapper), again"] = parts["attention (public, interop wrapper)"]
    for name, f in parts.items():
        print(f"{name:45s} {host_us(f, args.calls):7.1f} us", flush=True)


if __name__ == "__main__":
    main()
