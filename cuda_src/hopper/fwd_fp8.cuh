// The Hopper forward's e4m3 pieces (attn_fwd_wgmma_tma_fp8): the descale factors, P's conversion to
// e4m3 A fragments, and vt's TMA boxes.
//
// vt: wgmma takes 8-bit operands K-major only, so P V reads V transposed, vt (B, Hkv, d, Nk'),
// built by the launcher (fp8_vt.cu): row c holds column c of V with the keys contiguous, Nk' = Nk
// rounded up to 32 (zeros past Nk), and within each group of 32 keys the order of fp8_keys.cuh
// (fwd_p_to_e4m3 says why).
#pragma once
#include "common.cuh"
#include "tma.cuh"
#include "wgmma.cuh"
#include "wgmma_e4m3_ops.cuh"
#include "fp8_keys.cuh"

// The descales of one launch, float32 in device memory, each read at b * sb + h * sh (+ q's
// hk * shk, for FlashAttention-3's q descale per K/V head; strides 0 broadcast a per-tensor one);
// a null pointer stands for 1.
struct FwdFp8Scales {
    const float* q;
    const float* k;
    const float* v;
    int q_sb, q_sh, q_shk, k_sb, k_sh, v_sb, v_sh;
    // The scores' factor q_descale * k_descale of query head h (its K/V head hk).
    __device__ __forceinline__ float qk(int b, int h, int hk) const {
        const float fq = q ? q[b * q_sb + h * q_sh + hk * q_shk] : 1.f;
        return fq * (k ? k[b * k_sb + hk * k_sh] : 1.f);
    }
    __device__ __forceinline__ float out(int b, int hk) const { return v ? v[b * v_sb + hk * v_sh] : 1.f; }
};

// Four floats -> four e4m3 bytes, a in the lowest; round to nearest even, saturating at +-448.
__device__ __forceinline__ u32 pack4_e4m3(float a, float b, float c, float d) {
    unsigned short lo, hi;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(lo) : "f"(b), "f"(a));  // (second operand: low byte)
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(hi) : "f"(d), "f"(c));
    u32 r;
    asm("mov.b32 %0, {%1, %2};" : "=r"(r) : "h"(lo), "h"(hi));
    return r;
}

// P (S's float32 accumulators) rounded to e4m3 as the A fragments of P V, one per 32 keys.
// The accumulator gives lane 4 g + c keys 8 j + 2 c and 8 j + 2 c + 1 (j = 0..3) of rows g and
// g + 8; the k32 A fragment wants keys 4 c .. 4 c + 3 and 16 + 4 c .. 16 + 4 c + 3. Instead of
// moving bytes between lanes (shuffles on the softmax's critical path), each lane packs the keys
// it holds into the positions it owns - position p gets key kFp8KeyOfPos(p) - and vt's keys are
// permuted the same way when the launcher builds it, so sum_p P[:, key(p)] vt[:, p] is still P V.
// Register r of a k-step holds row g + 8 (r & 1) at positions 16 (r >> 1) + 4 c + i, i.e. (c = 0
// plus 2 c, fp8_keys_follow_lanes) keys in accumulator block (key >> 3), element (key & 1) + 2 (r & 1):
// row g: keys 2c, 2c+1, 8+2c, 9+2c (blocks 0, 1) and 16+2c, 17+2c, 24+2c, 25+2c (blocks 2, 3).
template <int kNS, int kKSteps>
__device__ __forceinline__ void fwd_p_to_e4m3(u32 (&p_frag)[kKSteps][4], const float (&s)[kNS][4]) {
    static_assert(kNS == 4 * kKSteps, "32 keys = four 8-column accumulator blocks per k-step");
#pragma unroll
    for (int kk = 0; kk < kKSteps; ++kk)
#pragma unroll
        for (int r = 0; r < 4; ++r) {
            float x[4];
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const int key = kFp8KeyOfPos(16 * (r >> 1) + i);
                x[i] = s[4 * kk + (key >> 3)][(key & 1) + 2 * (r & 1)];
            }
            p_frag[kk][r] = pack4_e4m3(x[0], x[1], x[2], x[3]);
        }
}

// vt's key tile starting at key k0 into its ring slot: HEAD_DIM rows of Tr::kVtKeys keys (BLOCK_N
// rounded up to whole boxes), one 128-key box per 128-byte column block (rows past d and keys past
// vt's end are zero-filled, and count toward the transaction's bytes), completing on `bar`.
template <typename Tr>
__device__ __forceinline__ void fwd_tma_issue_vt(u32 dst, const TmaDesc* map, int k0, int hk, int b, u32 bar) {
    mbar_arrive_expect_tx(bar, Tr::TileV::kBytes);
#pragma unroll
    for (int cb = 0; cb < Tr::kVtKeys / 128; ++cb)
        tma_load_4d(dst + cb * Tr::TileV::kBlockBytes, map, k0 + 128 * cb, 0, hk, b, bar);
}
