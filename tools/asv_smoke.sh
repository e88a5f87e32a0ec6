#!/usr/bin/env bash
# One setup + CUDA-event time of a few asv suites (the float32 ones, the graph-replayed decode
# and the plain decode), without asv: checks on the device that the suites run. From the repo root.
cd benchmarks/benchmarks && PYTHONPATH=../.. python3 - <<'PY'
import bench_attention as b
for cls, params in ((b.CuflashForwardFloat32, (4096, 128, False, "float32")), (b.CuflashBackwardFloat32, (1024, 256, True, "float32")),
                    (b.CuflashDecodeGraph, (4096, "8x32x8")), (b.CuflashDecode, (4096, "8x32x8"))):
    s = cls(); s.setup(*params)
    t = s.track_gpu_ms(*params)
    peak = s.track_peak_bytes(*params) if hasattr(s, "track_peak_bytes") else None
    getattr(s, "teardown", lambda *a: None)(*params)
    print(cls.__name__, params, f"gpu {t:.3f} ms", "peak", peak)
PY
