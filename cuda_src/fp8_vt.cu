// vt for the e4m3 forward (attn_fwd_wgmma_tma_fp8): V (bytes, any row stride) transposed to
// (B, Hkv, d, nk_pad) with each group of 32 keys in fp8_keys.cuh's order and zeros for keys past
// nk: vt[bh, c, p] = v[bh, 32 (p / 32) + kFp8KeyOfPos(p % 32), c] for p < nk_pad (a multiple of 32).
// One block per 128 keys x 64 columns of one (batch, head): V's rows in through shared memory,
// vt's rows out, 4 bytes per store.
#include "common.cuh"
#include "fp8_keys.cuh"

// VEC: 16-byte loads (d, v's strides and base multiples of 16), else byte loads.
template <bool VEC>
__global__ void __launch_bounds__(256) fp8_pack_vt(const unsigned char* __restrict__ v, unsigned char* __restrict__ vt,
                                                   i64 v_sb, i64 v_sh, i64 v_sn, int heads, int nk, int nk_pad, int d,
                                                   int bh0) {
    constexpr int kKeys = 128, kCols = 64, kLd = kCols + 4;  // (+4: a warp's reads of one column spread over banks)
    __shared__ __align__(16) unsigned char tile[kKeys * kLd];
    const int bh = bh0 + blockIdx.z, b = bh / heads, h = bh - b * heads;
    const int k0 = blockIdx.x * kKeys, c0 = blockIdx.y * kCols;
    const unsigned char* src = v + b * v_sb + h * v_sh;
    if constexpr (VEC) {
        for (int i = threadIdx.x; i < kKeys * kCols / 16; i += 256) {
            const int r = i / (kCols / 16), q = i % (kCols / 16);
            const int key = k0 + r, c = c0 + 16 * q;
            uint4 x = make_uint4(0u, 0u, 0u, 0u);
            if (key < nk && c < d) x = *reinterpret_cast<const uint4*>(src + key * v_sn + c);
            u32* t = reinterpret_cast<u32*>(tile + r * kLd + 16 * q);
            t[0] = x.x;
            t[1] = x.y;
            t[2] = x.z;
            t[3] = x.w;
        }
    } else {
        for (int i = threadIdx.x; i < kKeys * kCols; i += 256) {
            const int r = i / kCols, c = i % kCols;
            const int key = k0 + r;
            tile[r * kLd + c] = (key < nk && c0 + c < d) ? src[key * v_sn + c0 + c] : (unsigned char)0;
        }
    }
    __syncthreads();
    unsigned char* dst = vt + ((i64)bh * d + c0) * nk_pad + k0;
    for (int i = threadIdx.x; i < kCols * kKeys / 4; i += 256) {
        const int c = i / (kKeys / 4), p = 4 * (i % (kKeys / 4));  // vt row c0 + c, positions p .. p + 3
        if (c0 + c >= d || k0 + p >= nk_pad) continue;
        u32 word = 0;
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int r = ((p + e) & ~31) | kFp8KeyOfPos((p + e) & 31);
            word |= (u32)tile[r * kLd + c] << (8 * e);
        }
        *reinterpret_cast<u32*>(dst + (i64)c * nk_pad + p) = word;
    }
}
