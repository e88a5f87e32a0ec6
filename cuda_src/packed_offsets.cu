// Packed sequences' offsets made safe to index with, on the device: what the band kernels read
// when the host has not checked the offsets (cuflash.attention with max_seqlen_q / max_seqlen_k and
// validate=False). Each offset is clamped into [0, total] and then raised to the largest offset
// before it, so that every sequence b spans rows [out[b], out[b + 1]) inside the packed arrays
// with a length >= 0. Valid offsets come back unchanged.
//
// One block per array (blockIdx.x: q's offsets, then k's); thread t takes a contiguous chunk of
// entries: the chunks' running maxima are combined by a block-wide scan (warp shuffles, then the
// warps' totals), and each thread rewrites its chunk from the maximum of the chunks before it.
#include "common.cuh"

constexpr int kOffsetThreads = 1024;

__device__ __forceinline__ int warp_inclusive_max(int x, int lane) {
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
        const int y = __shfl_up_sync(0xffffffffu, x, d);
        if (lane >= d) x = max(x, y);
    }
    return x;
}

__global__ void __launch_bounds__(kOffsetThreads)
clamp_packed_offsets(const int* __restrict__ cu_q, const int* __restrict__ cu_k, int* __restrict__ out_q,
                     int* __restrict__ out_k, int n, int total_q, int total_k) {
    __shared__ int warp_max[kOffsetThreads / 32];
    const int* in = blockIdx.x == 0 ? cu_q : cu_k;
    int* out = blockIdx.x == 0 ? out_q : out_k;
    const int total = blockIdx.x == 0 ? total_q : total_k;
    const int per = (n + kOffsetThreads - 1) / kOffsetThreads;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int begin = min(n, (int)threadIdx.x * per), end = min(n, begin + per);
    int chunk = 0;  // (0: no offset is below the first clamped one)
    for (int i = begin; i < end; ++i) chunk = max(chunk, min(max(in[i], 0), total));
    const int inclusive = warp_inclusive_max(chunk, lane);
    if (lane == 31) warp_max[warp] = inclusive;
    __syncthreads();
    if (warp == 0) warp_max[lane] = warp_inclusive_max(warp_max[lane], lane);
    __syncthreads();
    // The largest offset of the chunks before this thread's: its warp's earlier lanes, earlier warps.
    int run = max(__shfl_up_sync(0xffffffffu, inclusive, 1) * (lane > 0), warp > 0 ? warp_max[warp - 1] : 0);
    for (int i = begin; i < end; ++i) {
        run = max(run, min(max(in[i], 0), total));
        out[i] = run;
    }
}
