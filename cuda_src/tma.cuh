// The bulk tensor copy engine (TMA, sm_90): tile loads described by a host-built tensor map,
// issued by one thread and completing on an mbarrier with a transaction byte count.
#pragma once
#include "common.cuh"

// cuTensorMapEncodeTiled's opaque 128-byte descriptor. Kernels take it by value as a
// __grid_constant__ parameter, so the copy engine reads it from parameter space.
struct __align__(64) TmaDesc {
    unsigned long long opaque[16];
};

// This phase of `bar` completes when one arrival and `bytes` of copies have landed.
__device__ __forceinline__ void mbar_arrive_expect_tx(u32 bar, u32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}

// Add `bytes` to this phase's expected transaction count without arriving (the thread arrives
// later, e.g. after stores of its own that the waiters must see).
__device__ __forceinline__ void mbar_expect_tx(u32 bar, u32 bytes) {
    asm volatile("mbarrier.expect_tx.relaxed.cta.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}

// Make barrier initialization visible to the copy engine before the first copy names it.
__device__ __forceinline__ void fence_mbar_init() { asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory"); }

// One box of a rank-4 tensor at coordinates (c0 innermost .. c3) into shared memory at `dst`
// (a 128-byte-swizzled box needs a 1024-byte aligned destination); completes on `bar`.
// Coordinates past the tensor's extent are zero-filled and still counted in the bytes.
__device__ __forceinline__ void tma_load_4d(u32 dst, const TmaDesc* map, int c0, int c1, int c2, int c3, u32 bar) {
    asm volatile(
        "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, %5}], "
        "[%6];\n" ::"r"(dst),
        "l"(reinterpret_cast<unsigned long long>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(bar)
        : "memory");
}

// ---- bulk (non-tensor) reductions from shared memory (sm_90) ----
// global[0 .. bytes) += shared[0 .. bytes) as float32, element-wise, by the copy engine (bytes a
// multiple of 16, both addresses 16-byte aligned); tracked in this thread's bulk async-group.
__device__ __forceinline__ void bulk_reduce_add_f32(float* gmem, u32 smem, u32 bytes) {
    asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n" ::"l"(gmem), "r"(smem),
                 "r"(bytes)
                 : "memory");
}
__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }
// This thread's bulk groups but the newest N have finished reading shared memory (the source
// may be overwritten) / have completed.
template <int N>
__device__ __forceinline__ void bulk_wait_read() { asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(N) : "memory"); }
template <int N>
__device__ __forceinline__ void bulk_wait() { asm volatile("cp.async.bulk.wait_group %0;\n" ::"n"(N) : "memory"); }
