"""Read-only streams in the access patterns of decoding (GPU machine): does DRAM's rate depend on
where the concurrent streams are in their regions?

    PYTHONPATH=. python3 tools/read_pattern_probe.py [out.json]

The buffer (REGIONS x REGION_BYTES, like B x Hkv caches of one K or V tensor) is read once per
repeat by one block per region (2 blocks per SM's worth of regions, as the decode kernel's
no-split tile), 16-byte loads in STEP-byte steps (a decode step: 64 keys x 256 bytes), in orders:
  same    every block walks its region from the start (the decode kernel: all blocks at the same
          offset of regions a power of two apart)
  spread  block r starts at r / REGIONS of its region and wraps (offsets spread evenly)
  sweep   grid-stride over the whole buffer (every block in every DRAM page; the read ceiling's
          fastest pattern)
Timed like benchmarks/peers.py (L2 flushed, launch behind a spin)."""
import json
import sys

import cupy as cp

from benchmarks.peers import Timer

KERNEL = r"""
template <int MODE, int UNROLL>
__global__ void read_regions(const uint4* __restrict__ src, long long region_units, int step_units,
                             unsigned* __restrict__ sink) {
    unsigned acc = 0;
    const int r = blockIdx.x, regions = gridDim.x;
    const long long steps = region_units / step_units;
    if (MODE == 2) {  // sweep
        const long long n = region_units * regions, stride = (long long)regions * blockDim.x;
        for (long long i = (long long)r * blockDim.x + threadIdx.x; i < n; i += stride) {
            uint4 x = __ldcs(src + i);
            acc ^= x.x ^ x.y ^ x.z ^ x.w;
        }
    } else {
        const long long shift = MODE == 1 ? (steps * r) / regions : 0;
        const uint4* base = src + (long long)r * region_units;
        for (long long t = 0; t < steps; t += UNROLL) {
            uint4 x[UNROLL][4];
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) {
                long long s = t + u + shift;
                s = s >= steps ? s - steps : s;
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    const int e = j * blockDim.x + threadIdx.x;
                    x[u][j] = e < step_units ? __ldcs(base + s * step_units + e) : make_uint4(0, 0, 0, 0);
                }
            }
#pragma unroll
            for (int u = 0; u < UNROLL; ++u)
#pragma unroll
                for (int j = 0; j < 4; ++j) acc ^= x[u][j].x ^ x[u][j].y ^ x[u][j].z ^ x[u][j].w;
        }
    }
    sink[(long long)r * blockDim.x + threadIdx.x] = acc;
}
"""
MODES = {"same": 0, "spread": 1, "sweep": 2}


def main(out=None):
    timer = Timer(warmup=3, repeats=30, seconds_per_impl=0.4)
    names = [f"read_regions<{m}, {u}>" for m in MODES.values() for u in (1, 2)]
    module = cp.RawModule(code=KERNEL, options=("-std=c++17",), name_expressions=names)
    rows = []
    for regions, region_bytes in ((256, 16 << 20), (512, 4 << 20), (256, 4 << 20)):
        buf = cp.empty(regions * region_bytes // 4, dtype=cp.uint32)
        buf[:] = 0x5A5A5A5A
        units, step_units = region_bytes // 16, 16384 // 16  # 16 KiB steps: 1024 units, 4 per thread
        sink = cp.empty(regions * 256, dtype=cp.uint32)
        for mode, m in MODES.items():
            for unroll in (1, 2):
                fn = module.get_function(f"read_regions<{m}, {unroll}>")
                ms, _ = timer(lambda: fn((regions,), (256,), (buf, cp.int64(units), cp.int32(step_units), sink)))
                tbps = regions * region_bytes / (ms * 1e-3) / 1e12
                rows.append({"regions": regions, "region_mib": region_bytes >> 20, "mode": mode, "unroll": unroll,
                             "ms": ms, "tbps": tbps})
                print(f"regions {regions:4d} x {region_bytes >> 20:3d} MiB  {mode:6s} unroll {unroll}: {tbps:.3f} TB/s",
                      flush=True)
        del buf
        cp.get_default_memory_pool().free_all_blocks()
    if out:
        json.dump(rows, open(out, "w"), indent=1)


if __name__ == "__main__":
    main(*sys.argv[1:])
