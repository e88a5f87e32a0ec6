"""What a decode launch costs outside its blocks (GPU machine). The block trace
(tools/decode_trace.py) put the small cell's blocks within 37 us while the timed call took 42.6:
this compares, for cuDNN and cuflash at a few cache lengths (B=8, Hq=32, Hkv=8, d=128, bf16),
  - the benchmark's timing (L2 flushed, launch hidden) and the same without the flush;
  - each kernel's device duration from CUPTI (torch.profiler), one flushed call;
  - cuflash's block span (the trace) and the same with the preferred shared-memory carveout set
    to the maximum (no L1/shared reconfiguration between the timer's kernels and ours).

    python3 tools/decode_overhead.py out.json
"""
import json
import os
import sys

BLOCKS = 1 << 14
os.environ["CUFLASH_NVRTC_OPTIONS"] = (os.environ.get("CUFLASH_NVRTC_OPTIONS", "") + f" -DCUFLASH_DECODE_TRACE={BLOCKS}").strip()
sys.path.insert(0, ".")
import cupy as cp  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from benchmarks.peers import Timer  # noqa: E402
from cuflash import _build, gpu_decode  # noqa: E402
from cuflash._problem import validate_forward  # noqa: E402
from decode_cells import decode_inputs  # noqa: E402  (tools/, this script's folder)

launched = []
_get_function = gpu_decode.get_function
gpu_decode.get_function = lambda spec: (launched.append(spec), _get_function(spec))[1]


class WarmTimer(Timer):
    def flush(self):  # L2 keeps the operands (and the code) from the previous call
        if self.spin is not None:
            self.spin(self.SPIN_CYCLES)


def cupti_us(fn, flusher):
    """{kernel name: device us} of one flushed call."""
    flusher.flush()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    out = {}
    for e in prof.events():
        if e.device_type.name == "CUDA" and "sleep" not in e.name.lower() and "spin" not in e.name.lower():
            out[e.name[:60]] = round(out.get(e.name[:60], 0.0) + e.time_range.elapsed_us(), 2)
    return out


def span_us(spec, fn, flusher):
    trace = cp.ndarray((BLOCKS, 6), cp.uint64, _build.get_module(spec).get_global("cuflash_decode_trace"))
    trace.fill(0)
    flusher.flush()
    fn()
    cp.cuda.Device().synchronize()
    t = cp.asnumpy(trace)
    t = t[t[:, 1] > 0].astype(np.float64)
    return float((t[:, 1].max() - t[:, 0].min()) / 1e3)


timer = Timer(warmup=3, repeats=40, seconds_per_impl=0.3)
warm = WarmTimer(warmup=3, repeats=40, seconds_per_impl=0.3)
out = []
for L in (16, 256, 1024, 4096, 16384):
    B, hq, hkv, d = 8, 32, 8, 128
    q, k, v, _ = decode_inputs(L, B, hkv, hq, d)
    qc, kc, vc = (cp.from_dlpack(x) for x in (q, k, v))
    p = validate_forward(qc, kc, vc)
    o4 = cp.empty_like(qc)
    lse3 = cp.empty((B, hq, 1), dtype=cp.float32)
    row = {"L": L}

    def cudnn():
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)

    def ours(**kw):
        return lambda: gpu_decode.forward(p, qc, kc, vc, o4, lse3, **kw)

    for name, fn in (("cudnn", cudnn), ("api", ours()), ("combine", ours(cluster=False))):
        row[name] = {"flushed_us": timer(fn)[0] * 1e3, "warm_us": warm(fn)[0] * 1e3, "cupti_us": cupti_us(fn, timer)}
        if name != "cudnn":
            launched.clear()
            fn()
            spec = launched[0]
            row[name]["span_us"] = span_us(spec, fn, timer)
            f = _get_function(spec)
            row[name]["smem"] = spec.smem_bytes
            try:
                f.preferred_shared_memory_carveout = 100
                row[name]["carveout100_flushed_us"] = timer(fn)[0] * 1e3
                row[name]["carveout100_span_us"] = span_us(spec, fn, timer)
                row[name]["carveout100_cupti_us"] = cupti_us(fn, timer)
            except Exception as e:  # noqa: BLE001
                row[name]["carveout_error"] = repr(e)[:200]
            finally:
                try:
                    f.preferred_shared_memory_carveout = -1
                except Exception:  # noqa: BLE001
                    pass
    print(json.dumps(row), flush=True)
    out.append(row)
    json.dump(out, open(sys.argv[1], "w"), indent=1)
