// vt for the e4m3 forward (attn_fwd_wgmma_tma_fp8): V (bytes, any row stride) transposed to
// (B, Hkv, d, nk_pad) with each group of 32 keys in fp8_keys.cuh's order and zeros for keys past
// nk: vt[bh, c, p] = v[bh, 32 (p / 32) + kFp8KeyOfPos(p % 32), c] for p < nk_pad (a multiple of 32).
//
// One block per 128 keys x 128 columns of one (batch, head) (plan.hopper.FP8_VT_KEYS / _COLS): V's
// rows in through shared memory, 16 bytes per load; then each thread transposes 4 x 4-byte blocks
// in registers (byte permutes) and stores 16 bytes of each of 4 vt rows. Reading single bytes
// from shared memory instead (4 per stored word) bounds the pass at about 8 bytes per SM clock.
#include "common.cuh"
#include "fp8_keys.cuh"

constexpr int kVtKeys = 128, kVtCols = 128;  // a block's keys and columns
constexpr int kVtWords = kVtCols / 4;        // 4-byte words of a tile row

// The word of tile row r holding columns 4 w .. 4 w + 3. The store phase reads, at once, 8 rows
// 16 apart (one per 16-key chunk) at 4 consecutive words: XOR-ing the word's upper bits with the
// row's chunk puts them in 32 different banks. A 16-byte group of words stays contiguous.
__device__ __forceinline__ int vt_tile_word(int r, int w) {
    return r * kVtWords + (w ^ (((r >> 4) & 7) << 2));
}

// VEC: 16-byte loads (d, v's strides and base multiples of 16), else byte loads.
template <bool VEC>
__global__ void __launch_bounds__(256) fp8_pack_vt(const unsigned char* __restrict__ v, unsigned char* __restrict__ vt,
                                                   i64 v_sb, i64 v_sh, i64 v_sn, int heads, int nk, int nk_pad, int d,
                                                   int bh0) {
    __shared__ __align__(16) u32 tile[kVtKeys * kVtWords];
    const int bh = bh0 + blockIdx.z, b = bh / heads, h = bh - b * heads;
    const int k0 = blockIdx.x * kVtKeys, c0 = blockIdx.y * kVtCols;
    const unsigned char* src = v + b * v_sb + h * v_sh;
    if constexpr (VEC) {
#pragma unroll
        for (int it = 0; it < kVtKeys * kVtCols / 16 / 256; ++it) {
            const int i = threadIdx.x + 256 * it;
            const int r = i / (kVtCols / 16), q = i % (kVtCols / 16);  // row, 16-byte chunk
            const int key = k0 + r, c = c0 + 16 * q;
            uint4 x = make_uint4(0u, 0u, 0u, 0u);
            if (key < nk && c < d) x = *reinterpret_cast<const uint4*>(src + key * v_sn + c);
            *reinterpret_cast<uint4*>(&tile[vt_tile_word(r, 4 * q)]) = x;
        }
    } else {
        unsigned char* bytes = reinterpret_cast<unsigned char*>(tile);
        for (int i = threadIdx.x; i < kVtKeys * kVtCols; i += 256) {
            const int r = i / kVtCols, c = i % kVtCols;
            const int key = k0 + r;
            bytes[4 * vt_tile_word(r, c >> 2) + (c & 3)] =
                (key < nk && c0 + c < d) ? src[key * v_sn + c0 + c] : (unsigned char)0;
        }
    }
    __syncthreads();
    // Thread: 16-key chunk j (positions 16 j .. 16 j + 15) of columns 4 w .. 4 w + 3; a warp's 8
    // lanes of one w cover a vt row's 128 bytes.
    const int lane = threadIdx.x & 31, j = lane & 7, w = 4 * (threadIdx.x >> 5) + (lane >> 3);
    if (k0 + 16 * j >= nk_pad) return;  // (nk_pad is whole 32-key groups: a chunk is in or out)
    // Positions 16 j + 4 c + i hold keys 16 j + kFp8KeyOfPos(4 c + i) = 16 j + 2 c + {0, 1, 8, 9}[i]
    // (fp8_keys.cuh, within the chunk's half of its group), so word c of a column is one 4 x 4
    // transpose of tile rows 16 j + 2 c + {0, 1, 8, 9}.
    u32 out[4][4];  // [column][c]
#pragma unroll
    for (int c = 0; c < 4; ++c) {
        const int r = 16 * j + kFp8KeyOfPos(4 * c);
        const u32 w0 = tile[vt_tile_word(r, w)], w1 = tile[vt_tile_word(r + 1, w)];
        const u32 w2 = tile[vt_tile_word(r + 8, w)], w3 = tile[vt_tile_word(r + 9, w)];
        const u32 t0 = __byte_perm(w0, w1, 0x5140), t1 = __byte_perm(w0, w1, 0x7362);  // (w0, w1) bytes 0-1 / 2-3
        const u32 t2 = __byte_perm(w2, w3, 0x5140), t3 = __byte_perm(w2, w3, 0x7362);
        out[0][c] = __byte_perm(t0, t2, 0x5410);
        out[1][c] = __byte_perm(t0, t2, 0x7632);
        out[2][c] = __byte_perm(t1, t3, 0x5410);
        out[3][c] = __byte_perm(t1, t3, 0x7632);
    }
    unsigned char* dst = vt + ((i64)bh * d + c0 + 4 * w) * nk_pad + k0 + 16 * j;
#pragma unroll
    for (int e = 0; e < 4; ++e)
        if (c0 + 4 * w + e < d)
            *reinterpret_cast<uint4*>(dst + (i64)e * nk_pad) = make_uint4(out[e][0], out[e][1], out[e][2], out[e][3]);
}
