// An e4m3 (FP8) K/V cache in the split-KV decode kernel: K and V stay 8-bit in shared memory (half
// the bytes of a 16-bit cache through DRAM and the rings) and become 16-bit only in registers, right
// before their mma. Every e4m3 value is exact in float16 and in bfloat16, so the conversion adds no
// rounding; the descales enter as S = (q k8) k_descale and O = (P v8) v_descale.
//
// The 8-bit rows are read by ldmatrix as 16-bit words (a d-byte row is d / 2 words), so a lane gets
// four consecutive bytes where the 16-bit mma fragments hold two pairs 8 apart:
// - K (non-transposed ldmatrix): lane (g, t) holds K[key g][4t .. 4t+3] of a 16-column step; the
//   fragment's k slots 2t, 2t+1 take columns 4t, 4t+1 and slots 2t+8, 2t+9 take 4t+2, 4t+3. Q's
//   columns are stored in sQ in that same order (decode_q_store_kv8), and a dot product does not
//   depend on the order of its terms.
// - V (transposed ldmatrix): lane (g, t) holds V[keys 2t, 2t+1][columns 2g, 2g+1]; one byte permute
//   splits it into the B fragments of two 8-column tiles, the even and the odd columns of a
//   16-column group. O's accumulator then holds columns 16c + 4t .. 4t+3 in tiles 2c (even) and
//   2c+1 (odd): decode_merge_warps writes them back in order (KV8_COLS).
// P V multiplies in float16 whatever q's type: P is in [0, 1] (float16 keeps 3 more bits of it than
// bfloat16) and the values are exact in float16; Q K^T takes q's type, so K converts to bfloat16 for
// a bfloat16 q (through float32: there is no direct e4m3 -> bf16x2 conversion).
#pragma once
#include "common.cuh"

// K/V element types of the decode kernel: 16-bit (q's type) or e4m3 with its per-block scales.
struct KvSame {
    static constexpr bool kE4m3 = false;
    static constexpr int kBytes = 2;
};
struct KvE4m3 {
    static constexpr bool kE4m3 = true;
    static constexpr int kBytes = 1;
    float k_scale = 1.f;  // k_descale of the block's (sequence, K/V head)
};

// The descale factors of an e4m3 cache: float32 per (sequence, K/V head) at b * sb + h * sh (strides
// 0 and 0 for one factor per tensor).
struct KvDescales {
    const float* k = nullptr;
    const float* v = nullptr;
    i64 sb = 0, sh = 0;
};

// Two e4m3 values (low byte first) as a float16x2 / bfloat16x2 word (exact).
__device__ __forceinline__ u32 e4m3x2_to_f16x2(u32 x) {
    u32 h;
    asm("{\n.reg .b16 t;\ncvt.u16.u32 t, %1;\ncvt.rn.f16x2.e4m3x2 %0, t;\n}\n" : "=r"(h) : "r"(x));
    return h;
}
template <typename T>
__device__ __forceinline__ u32 e4m3x2_to(u32 x) {
    const u32 h = e4m3x2_to_f16x2(x);
    if constexpr (T::is_bf16) {
        float lo, hi;
        u32 b;
        asm("{\n.reg .b16 l, h;\nmov.b32 {l, h}, %2;\ncvt.f32.f16 %0, l;\ncvt.f32.f16 %1, h;\n}\n"
            : "=f"(lo), "=f"(hi)
            : "r"(h));
        asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(b) : "f"(hi), "f"(lo));
        return b;
    } else {
        return h;
    }
}
__device__ __forceinline__ u32 byte_perm(u32 x, u32 sel) {
    u32 r;
    asm("prmt.b32 %0, %1, 0, %2;\n" : "=r"(r) : "r"(x), "r"(sel));
    return r;
}

// One 8-column piece w[0..3] (16-bit columns col .. col+7, as word pairs) of a packed Q row into sQ
// (Swizzle<HEAD_DIM>) in the column order of the e4m3 K fragments: within each 16 columns, words
// 0, 2, 4, 6 of the row's column pairs go to the first 8 columns and 1, 3, 5, 7 to the second.
template <int HEAD_DIM>
__device__ __forceinline__ void decode_q_store_kv8(u16* sQ, int row, int col, const u32 (&w)[4]) {
    using Swz = Swizzle<HEAD_DIM>;
    const int c16 = col & ~15, h = (col >> 3) & 1;
    *reinterpret_cast<uint2*>(sQ + Swz::offset(row, c16) + 4 * h) = make_uint2(w[0], w[2]);
    *reinterpret_cast<uint2*>(sQ + Swz::offset(row, c16 + 8) + 4 * h) = make_uint2(w[1], w[3]);
}

// S += Q K^T over HEAD_DIM for BLOCK_N e4m3 keys: aK addresses the K tile as d / 2-word rows with the
// lane pattern of a transposed load (row (lane >> 3 & 1) * 8 + lane & 7, chunk lane >> 4), so one
// ldmatrix.x4 covers 16 keys x two 16-column steps.
template <typename T, int HEAD_DIM, int ROW_TILES, int BLOCK_N, typename QFrags, typename AddrK>
__device__ __forceinline__ void kv8_scores(float (&acc_s)[ROW_TILES][BLOCK_N / 8][4], const QFrags& qa,
                                           const AddrK& aK, u32 k_off) {
    static_assert(HEAD_DIM % 32 == 0 && BLOCK_N % 16 == 0, "two 16-column steps and 16 keys per load");
#pragma unroll
    for (int kk2 = 0; kk2 < HEAD_DIM / 32; ++kk2) {
        u32 a0[ROW_TILES][4], a1[ROW_TILES][4];
#pragma unroll
        for (int mi = 0; mi < ROW_TILES; ++mi) {
            qa.get(a0[mi], mi, 2 * kk2);
            qa.get(a1[mi], mi, 2 * kk2 + 1);
        }
#pragma unroll
        for (int n16 = 0; n16 < BLOCK_N / 16; ++n16) {
            u32 r[4];  // keys 0-7 / 8-15 of step 2 kk2, then of step 2 kk2 + 1
            ldmatrix_x4(r, aK.at(n16 * 16, 2 * kk2) + k_off);
            u32 b[4][2];
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                b[j][0] = e4m3x2_to<T>(r[j] & 0xffffu);
                b[j][1] = e4m3x2_to<T>(r[j] >> 16);
            }
#pragma unroll
            for (int mi = 0; mi < ROW_TILES; ++mi) {
                mma_16816<T>(acc_s[mi][2 * n16], a0[mi], b[0][0], b[0][1]);
                mma_16816<T>(acc_s[mi][2 * n16 + 1], a0[mi], b[1][0], b[1][1]);
                mma_16816<T>(acc_s[mi][2 * n16], a1[mi], b[2][0], b[2][1]);
                mma_16816<T>(acc_s[mi][2 * n16 + 1], a1[mi], b[3][0], b[3][1]);
            }
        }
    }
}

// O += P V for BLOCK_N e4m3 keys (float16 products); aV as aK. O's tile 2c holds the even and tile
// 2c + 1 the odd columns of 16-column group c (see the top of this file).
template <int HEAD_DIM, int ROW_TILES, int BLOCK_N, typename AddrV>
__device__ __forceinline__ void kv8_pv(float (&acc_o)[ROW_TILES][HEAD_DIM / 8][4],
                                       const float (&acc_s)[ROW_TILES][BLOCK_N / 8][4], const AddrV& aV, u32 v_off) {
#pragma unroll
    for (int kk = 0; kk < BLOCK_N / 16; ++kk) {
        u32 a[ROW_TILES][4];
#pragma unroll
        for (int mi = 0; mi < ROW_TILES; ++mi) acc_to_a<Fp16>(a[mi], acc_s[mi], kk);
#pragma unroll
        for (int cc = 0; cc < HEAD_DIM / 32; ++cc) {
            u32 r[4];  // keys 0-7 / 8-15 of columns 32 cc .. +15, then of 32 cc + 16 .. +31
            ldmatrix_x4_trans(r, aV.at(kk * 16, 2 * cc) + v_off);
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                // bytes (key 2t, col 2g), (2t, 2g+1), (2t+1, 2g), (2t+1, 2g+1) -> the even column's
                // pair of keys in the low half, the odd column's in the high half
                const u32 lo = byte_perm(r[2 * h], 0x3120), hi = byte_perm(r[2 * h + 1], 0x3120);
                const u32 even0 = e4m3x2_to_f16x2(lo & 0xffffu), even1 = e4m3x2_to_f16x2(hi & 0xffffu);
                const u32 odd0 = e4m3x2_to_f16x2(lo >> 16), odd1 = e4m3x2_to_f16x2(hi >> 16);
#pragma unroll
                for (int mi = 0; mi < ROW_TILES; ++mi) {
                    mma_16816<Fp16>(acc_o[mi][4 * cc + 2 * h], a[mi], even0, even1);
                    mma_16816<Fp16>(acc_o[mi][4 * cc + 2 * h + 1], a[mi], odd0, odd1);
                }
            }
        }
    }
}
