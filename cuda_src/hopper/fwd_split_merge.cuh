// The end of one piece of the forward's key split (attn_fwd_wgmma_tma_split): write the partial or
// merge all of them by the log-sum-exp rule.
#pragma once
#include "hopper/fwd_traits.cuh"

// The key split's end of a piece (FwdSplit), called by every math thread with its normalized O
// fragment (rows row0 and row0 + 8) and their log-sum-exp. A piece before the last writes them
// and counts itself: returns true (nothing left to store). The last piece waits for the others,
// merges, and returns false with the tile's O and LSE in acc_o and row_lse.
template <int kNO, int kMath, int kBM>
__device__ __forceinline__ bool split_merge(const FwdSplit& split, int piece, int tile, int tid, int lane, int row0,
                                            float (&acc_o)[1][kNO][4], float (&row_lse)[2]) {
    const int last = split.splits - 1;
    const i64 slot0 = (i64)tile * last;
    float4* part_o = reinterpret_cast<float4*>(split.part_o);
    if (piece < last) {
        const i64 slot = slot0 + piece;
#pragma unroll
        for (int di = 0; di < kNO; ++di)  // (accumulator order: a warp's stores are 512 contiguous bytes)
            part_o[(slot * kNO + di) * kMath + tid] = make_float4(acc_o[0][di][0], acc_o[0][di][1], acc_o[0][di][2], acc_o[0][di][3]);
        if ((lane & 3) == 0) {
            split.part_lse[slot * kBM + row0] = row_lse[0];
            split.part_lse[slot * kBM + row0 + 8] = row_lse[1];
        }
        __threadfence();  // the partials are visible device-wide before the count says so
        named_barrier(1, kMath);
        if (tid == 0) atomicAdd(split.flags + tile, 1u);
        return true;
    }
    if (tid == 0) {
        unsigned seen;
        for (;;) {
            asm volatile("ld.acquire.gpu.global.u32 %0, [%1];\n" : "=r"(seen) : "l"(split.flags + tile) : "memory");
            if (seen >= (unsigned)last) break;
            __nanosleep(128);
        }
    }
    named_barrier(1, kMath);
    // O = sum_p w_p O_p / sum_p w_p, w_p = exp(lse_p - max); the partials are read from L2 (.cg).
    float mx[2], w[2], total[2];
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
        mx[hf] = row_lse[hf];
        for (int p = 0; p < last; ++p) mx[hf] = fmaxf(mx[hf], __ldcg(split.part_lse + (slot0 + p) * kBM + row0 + 8 * hf));
        w[hf] = mx[hf] == -INFINITY ? 0.f : expf(row_lse[hf] - mx[hf]);
        total[hf] = 0.f;
    }
    for (int p = -1; p < last; ++p) {  // -1: this piece's own O, then the partials in piece order
        if (p >= 0) {
#pragma unroll
            for (int hf = 0; hf < 2; ++hf) {
                const float l = __ldcg(split.part_lse + (slot0 + p) * kBM + row0 + 8 * hf);
                w[hf] = mx[hf] == -INFINITY ? 0.f : expf(l - mx[hf]);
            }
        }
        total[0] += w[0];
        total[1] += w[1];
#pragma unroll
        for (int di = 0; di < kNO; ++di) {
            if (p < 0) {
#pragma unroll
                for (int e = 0; e < 4; ++e) acc_o[0][di][e] *= w[e / 2];
            } else {
                const float4 v = __ldcg(part_o + ((slot0 + p) * kNO + di) * kMath + tid);
                acc_o[0][di][0] += w[0] * v.x;
                acc_o[0][di][1] += w[0] * v.y;
                acc_o[0][di][2] += w[1] * v.z;
                acc_o[0][di][3] += w[1] * v.w;
            }
        }
    }
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
        row_lse[hf] = total[hf] > 0.f ? mx[hf] + logf(total[hf]) : -INFINITY;
        total[hf] = total[hf] > 0.f ? 1.f / total[hf] : 0.f;
    }
#pragma unroll
    for (int di = 0; di < kNO; ++di)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc_o[0][di][e] *= total[e / 2];
    if (tid == 0) split.flags[tile] = 0u;  // every piece has counted itself: ready for the next launch
    return false;
}
