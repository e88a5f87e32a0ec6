// Split-KV decoding fed by the bulk tensor copy engine (sm_90): the same blocks, packed rows and
// merge as attn_decode.cu, but the K/V stream is one block-wide ring filled by a producer warp.
//
// Reading the cache once is the whole cost, so what matters is how many bytes are in flight per
// SM. With cp.async every warp issues and waits for its own copies, and its ring's depth is paid
// once per warp; here one thread issues 16-row TMA boxes (128-byte swizzled, the layout the
// ldmatrix reads below expect) for a STAGES-deep ring, completion is counted by mbarriers, and
// the CWARPS consumer warps only compute: each takes 16 keys of every 16*CWARPS-key stage.
// A paged cache (block_table non-null) maps each 16-key box to its page: block sizes are powers
// of two >= 16, so a box never straddles two pages. Only the producer thread looks pages up, so
// this is a runtime branch, not an instantiation.
#include "common.cuh"
#include "softmax.cuh"
#include "wgmma.cuh"
#include "tma.cuh"
#include "decode_common.cuh"

template <int HEAD_DIM, int ROW_TILES, int CWARPS, int STAGES>
struct DecodeTmaTraits {
    static constexpr int kRows = 16 * ROW_TILES;     // packed (head, token) rows
    static constexpr int kStageKeys = 16 * CWARPS;   // keys per ring stage, 16 per consumer warp
    static constexpr int kBoxRows = 16;              // keys per TMA box (<= the smallest page)
    static constexpr int kColBlocks = HEAD_DIM / 64; // 128-byte column blocks per row
    static constexpr int kTileBytes = kStageKeys * HEAD_DIM * 2;  // K (or V) of one stage
    static constexpr int kBoxBytes = kBoxRows * 128;
    static constexpr int kThreads = (CWARPS + 1) * 32;  // + the producer warp
    // Shared memory, from a 1024-byte aligned base: the ring [STAGES][K, V], the packed Q tile,
    // the warps' (max, sum) statistics, the full/empty barriers.
    static constexpr int kQOff = STAGES * 2 * kTileBytes;
    static constexpr int kStatOff = kQOff + kRows * HEAD_DIM * 2;
    static constexpr int kBarOff = kStatOff + CWARPS * kRows * 2 * 4;
    static constexpr int kSmemBytes = kBarOff + 2 * STAGES * 8 + 1024;  // + alignment slack
    static_assert(HEAD_DIM % 64 == 0, "TMA boxes are 64 columns (128 bytes) wide");
};

template <typename T, int HEAD_DIM, int ROW_TILES, int CWARPS, int STAGES, bool CAUSAL>
__global__ void __launch_bounds__((CWARPS + 1) * 32)
attn_decode_tma(const __grid_constant__ TmaDesc tmap_k, const __grid_constant__ TmaDesc tmap_v,
                const u16* __restrict__ q, u16* __restrict__ o, float* __restrict__ lse,
                float* __restrict__ part_o, float* __restrict__ part_lse, const int* __restrict__ kv_lens,
                const int* __restrict__ block_table, i64 bt_sb, int page_shift,
                i64 q_sb, i64 q_sh, i64 q_sn, i64 o_sb, i64 o_sh, i64 o_sn,
                int hq, int nq, int nk, int group, int align, int chunk, float scale_log2, int band_lo, int band_hi) {
    using Tr = DecodeTmaTraits<HEAD_DIM, ROW_TILES, CWARPS, STAGES>;
    constexpr int kNO = HEAD_DIM / 8;
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    const u32 raw = smem_addr(smem_raw);
    const u32 base = (raw + 1023u) & ~1023u;  // 128-byte swizzled boxes need 1024-byte alignment
    unsigned char* gbase = smem_raw + (base - raw);
    u16* sQ = reinterpret_cast<u16*>(gbase + Tr::kQOff);
    float* s_stat = reinterpret_cast<float*>(gbase + Tr::kStatOff);
    const u32 bar_full = base + Tr::kBarOff, bar_empty = bar_full + STAGES * 8;

    const int split = blockIdx.x, hk = blockIdx.y, b = blockIdx.z, n_splits = gridDim.x;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const DecodeSpan<CAUSAL> span(kv_lens, b, nk, nq, align, split, chunk, band_lo, band_hi);  // (no window here)
    const int s0 = span.s0, s1 = span.s1;
    const int n_stages = (max(0, s1 - s0) + Tr::kStageKeys - 1) / Tr::kStageKeys;

    if (threadIdx.x == 0) {
        for (int s = 0; s < STAGES; ++s) {
            mbar_init(bar_full + 8 * s, 1);
            mbar_init(bar_empty + 8 * s, CWARPS);
        }
        fence_mbar_init();
    }
    decode_pack_q<HEAD_DIM, ROW_TILES, Tr::kThreads>(sQ, q, q_sb, q_sh, q_sn, b, hk, group, nq, HEAD_DIM);
    __syncthreads();

    float acc_o[ROW_TILES][kNO][4];
    OnlineSoftmax<2 * ROW_TILES> softmax;
    zero_acc(acc_o);
    if (warp == CWARPS) {
        // Producer: boxes of 16 keys; a box starting at or past s1 is never issued (keys beyond
        // kv_lens are not read, pages past the sequence never looked up).
        if (lane == 0) {
            for (int t = 0; t < n_stages; ++t) {
                const int slot = t % STAGES;
                if (t >= STAGES) mbar_wait(bar_empty + 8 * slot, ((t / STAGES) - 1) & 1);
                const int n0 = s0 + t * Tr::kStageKeys;
                const int boxes = min(Tr::kStageKeys, s1 - n0 + Tr::kBoxRows - 1) / Tr::kBoxRows;
                mbar_arrive_expect_tx(bar_full + 8 * slot, 2 * boxes * Tr::kColBlocks * Tr::kBoxBytes);
                const u32 dst_k = base + slot * 2 * Tr::kTileBytes, dst_v = dst_k + Tr::kTileBytes;
                for (int x = 0; x < boxes; ++x) {
                    const int n = n0 + x * Tr::kBoxRows;
                    int c1 = n, c2 = hk, c3 = b;  // contiguous cache: (d, key, head, batch)
                    if (block_table) {            // paged: (d, key in page, head, page)
                        c1 = n & ((1 << page_shift) - 1);
                        c3 = block_table[b * bt_sb + (n >> page_shift)];
                    }
#pragma unroll
                    for (int cb = 0; cb < Tr::kColBlocks; ++cb) {
                        const u32 box = cb * Tr::kStageKeys * 128 + x * Tr::kBoxBytes;
                        tma_load_4d(dst_k + box, &tmap_k, cb * 64, c1, c2, c3, bar_full + 8 * slot);
                        tma_load_4d(dst_v + box, &tmap_v, cb * 64, c1, c2, c3, bar_full + 8 * slot);
                    }
                }
            }
        }
    } else {
        DecodeQ<HEAD_DIM, ROW_TILES> qa(smem_addr(sQ), lane);
        // K fragments: non-transposed ldmatrix rows (lane>>4)*8 + lane&7, chunk (lane>>3)&1; V:
        // transposed, rows ((lane>>3)&1)*8 + lane&7, chunk lane>>4 (as attn_decode's LaneAddr).
        const Sw128LaneAddr<Tr::kStageKeys> aK(base, warp * 16 + (lane >> 4) * 8 + (lane & 7), (lane >> 3) & 1);
        const Sw128LaneAddr<Tr::kStageKeys> aV(base + Tr::kTileBytes, warp * 16 + ((lane >> 3) & 1) * 8 + (lane & 7),
                                               lane >> 4);
        for (int t = 0; t < n_stages; ++t) {
            const int slot = t % STAGES;
            mbar_wait(bar_full + 8 * slot, (t / STAGES) & 1);
            const int n0 = s0 + t * Tr::kStageKeys + warp * 16;
            const u32 slot_off = slot * 2 * Tr::kTileBytes;
            if (n0 < s1) {
                if (n0 + 16 > s1) {
                    // V rows past s1 hold stale bytes (a box never issued) or keys past kv_lens:
                    // P is 0 there, but 0 * NaN is not, so zero them. K rows are masked instead.
                    const int first = s1 - n0;
                    for (int i = lane; i < (16 - first) * Tr::kColBlocks * 8; i += 32) {
                        const int row = warp * 16 + first + i / (Tr::kColBlocks * 8);
                        const int cb = (i / 8) % Tr::kColBlocks, ch = i % 8;
                        *reinterpret_cast<uint4*>(gbase + slot_off + Tr::kTileBytes + cb * Tr::kStageKeys * 128 +
                                                  row * 128 + ch * 16) = make_uint4(0u, 0u, 0u, 0u);
                    }
                    fence_proxy_async();  // the next box into this slot is an async-proxy write
                    __syncwarp();
                }
                decode_tile_step<T, HEAD_DIM, ROW_TILES, 16, CAUSAL, false>(
                    qa, aK, aV, slot_off, slot_off, n0, s1, DecodeRowTokens<ROW_TILES, false>(lane, nq), 0, span.hi0,
                    nq, lane, softmax, acc_o, scale_log2);
            }
            __syncwarp();
            if (lane == 0) mbar_arrive(bar_empty + 8 * slot);
        }
    }
    // Every box issued has been waited for by the consumers, so the ring is idle: sO reuses it.
    decode_merge_store<T, HEAD_DIM, ROW_TILES, CWARPS, Tr::kThreads, Tr::kQOff>(
        softmax, acc_o, warp < CWARPS, s_stat, reinterpret_cast<float*>(gbase), warp, lane, o, lse, part_o, part_lse,
        o_sb, o_sh, o_sn, b, hk, gridDim.y, split, n_splits, hq, nq, HEAD_DIM, group, scale_log2);
}
