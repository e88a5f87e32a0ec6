// What the cp.async and the TMA split-KV decode kernels share: packing the query rows of one K/V
// head into a tile, and the end of a block - merge the warps' online-softmax states, then write O
// and LSE (one split) or the split's normalized partial O and its log-sum-exp (several splits;
// attn_decode_combine merges them).
#pragma once
#include "common.cuh"
#include "band.cuh"
#include "softmax.cuh"
#include "kv_e4m3.cuh"
#include "score_mod.cuh"

// Piece i (row r = i / (HEAD_DIM / 8), 8 columns from col = 8 (i % (HEAD_DIM / 8))) of the packed
// query rows as four bf16/fp16 pairs: row r is (head hk * group + r / nq, token r % nq); columns
// past d, rows past `rows` (group * nq) and pieces with !valid are zero.
template <int HEAD_DIM>
__device__ __forceinline__ void decode_q_piece(u32 (&w)[4], const u16* q, i64 q_sb, i64 q_sh, i64 q_sn, int b,
                                               int hk, int group, int nq, int rows, int d, int i, bool valid) {
    constexpr int kChunks = HEAD_DIM / 8;
    const int r = i / kChunks, col = (i % kChunks) * 8;
#pragma unroll
    for (int e = 0; e < 4; ++e) w[e] = 0u;
    if (valid && r < rows) {
        const u16* src = q + b * q_sb + (i64)(hk * group + r / nq) * q_sh + (i64)(r % nq) * q_sn + col;
        if (col + 8 <= d && (reinterpret_cast<unsigned long long>(src) & 15) == 0) {
            // (the whole 8-column piece, 16-byte aligned: one vector load instead of eight)
            const uint4 x = *reinterpret_cast<const uint4*>(src);
            w[0] = x.x, w[1] = x.y, w[2] = x.z, w[3] = x.w;
            return;
        }
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const u32 lo = col + 2 * e < d ? src[2 * e] : 0u;
            const u32 hi = col + 2 * e + 1 < d ? src[2 * e + 1] : 0u;
            w[e] = lo | (hi << 16);
        }
    }
}

// Rows r = (head hk * group + r / nq, token r % nq) of q into sQ (Swizzle<HEAD_DIM> layout),
// zero-padded to 16 * ROW_TILES rows and HEAD_DIM columns, in two steps: load() reads this
// thread's 8-column pieces into registers (element loads: q is a few hundred bytes), store()
// writes them to shared memory - so that the K/V copies can be issued in between.
template <int HEAD_DIM, int ROW_TILES, int THREADS>
struct DecodeQPack {
    static constexpr int kChunks = HEAD_DIM / 8, kItems = (16 * ROW_TILES * kChunks + THREADS - 1) / THREADS;
    u32 w[kItems][4];
    __device__ __forceinline__ void load(const u16* q, i64 q_sb, i64 q_sh, i64 q_sn, int b, int hk, int group, int nq,
                                         int d) {
        const int rows = group * nq;
#pragma unroll
        for (int it = 0; it < kItems; ++it) {
            const int i = threadIdx.x + it * THREADS;
            decode_q_piece<HEAD_DIM>(w[it], q, q_sb, q_sh, q_sn, b, hk, group, nq, rows, d, i,
                                     i < 16 * ROW_TILES * kChunks);
        }
    }
    // KV8: the columns in the order of e4m3 K fragments (decode_q_store_kv8)
    template <bool KV8 = false>
    __device__ __forceinline__ void store(u16* sQ) const {
#pragma unroll
        for (int it = 0; it < kItems; ++it) {
            const int i = threadIdx.x + it * THREADS;
            if (i < 16 * ROW_TILES * kChunks) {
                if constexpr (KV8)
                    decode_q_store_kv8<HEAD_DIM>(sQ, i / kChunks, (i % kChunks) * 8, w[it]);
                else
                    *reinterpret_cast<uint4*>(sQ + Swizzle<HEAD_DIM>::offset(i / kChunks, (i % kChunks) * 8)) =
                        make_uint4(w[it][0], w[it][1], w[it][2], w[it][3]);
            }
        }
    }
};

template <int HEAD_DIM, int ROW_TILES, int THREADS, bool KV8 = false>
__device__ __forceinline__ void decode_pack_q(u16* sQ, const u16* q, i64 q_sb, i64 q_sh, i64 q_sn, int b, int hk,
                                              int group, int nq, int d) {
    constexpr int kChunks = HEAD_DIM / 8;
    const int rows = group * nq;
    for (int i = threadIdx.x; i < 16 * ROW_TILES * kChunks; i += THREADS) {
        u32 w[4];
        decode_q_piece<HEAD_DIM>(w, q, q_sb, q_sh, q_sn, b, hk, group, nq, rows, d, i, true);
        if constexpr (KV8)
            decode_q_store_kv8<HEAD_DIM>(sQ, i / kChunks, (i % kChunks) * 8, w);
        else
            *reinterpret_cast<uint4*>(sQ + Swizzle<HEAD_DIM>::offset(i / kChunks, (i % kChunks) * 8)) =
                make_uint4(w[0], w[1], w[2], w[3]);
    }
}

// The keys [s0, s1) that split `split` of sequence b reads: its chunk of the first kv_lens[b]
// keys (all nk without kv_lens) = len, cut at the last token's causal limit; packed row r (token
// r % nq) sees keys j <= token + hi0 (CAUSAL). WINDOW: the band kernels' band (gpu.band_offsets):
// token i sees keys diag + band_lo .. diag + band_hi, diag = i + len - nq (align) or i, an open
// side +-OPEN, clamped in 64 bits as band.cuh does; row r then sees [token + lo0, token + hi0],
// and the splits cut [begin, end), the keys some token sees, into chunks, begin rounded down to
// 16 keys so that a 16-key group never straddles two pages (the host's chunk allows for it).
template <bool CAUSAL, bool WINDOW = false>
struct DecodeSpan {
    int s0, s1, lo0 = 0, hi0 = 0;
    __device__ __forceinline__ DecodeSpan(const int* kv_lens, int b, int nk, int nq, int align, int split, int chunk,
                                          int band_lo, int band_hi) {
        const int len = kv_lens ? min(kv_lens[b], nk) : nk;
        if constexpr (WINDOW) {
            const i64 shift = align ? (i64)len - nq : 0;
            hi0 = (int)min((i64)band_hi + shift, (i64)len);
            lo0 = (int)max((i64)band_lo + shift, -(i64)nq);
            s0 = (max(0, lo0) & ~15) + split * chunk;
            s1 = min(min(len, max(0, nq + hi0)), s0 + chunk);
        } else {
            hi0 = CAUSAL ? (align ? len - nq : 0) : 0;
            s0 = split * chunk;
            s1 = min(len, s0 + chunk);
            if constexpr (CAUSAL) s1 = min(s1, max(0, nq - 1 + hi0 + 1));
        }
    }
};

// The packed Q tile's A fragments: kept in registers when they are few, else re-read from sQ
// (at shared byte address sq) for every key tile.
template <int HEAD_DIM, int ROW_TILES>
struct DecodeQ {
    static constexpr int kKS = HEAD_DIM / 16;
    static constexpr bool kRegs = ROW_TILES * HEAD_DIM <= 128;
    LaneAddr<HEAD_DIM> aQ;
    u32 frag[kRegs ? ROW_TILES : 1][kRegs ? kKS : 1][4];
    __device__ __forceinline__ DecodeQ(u32 sq, int lane) : aQ(sq, lane & 15, lane >> 4) {
        if constexpr (kRegs) {
#pragma unroll
            for (int mi = 0; mi < ROW_TILES; ++mi)
#pragma unroll
                for (int kk = 0; kk < kKS; ++kk) ldmatrix_x4(frag[mi][kk], aQ.at(mi * 16, kk * 2));
        }
    }
    __device__ __forceinline__ void get(u32 (&a)[4], int mi, int kk) const {
        if constexpr (kRegs) {
#pragma unroll
            for (int e = 0; e < 4; ++e) a[e] = frag[mi][kk][e];
        } else {
            ldmatrix_x4(a, aQ.at(mi * 16, kk * 2));
        }
    }
};

// One warp's BLOCK_N keys starting at key n0: S = Q K^T, keys >= s1 (the split's end) and, under
// causality past each packed row's token + hi0, with a WINDOW before its token + lo0 too,
// masked to -inf (band.cuh's mask_score_row with the split's end for the sequence's), online softmax, O += P V. K and V
// come from shared memory through lane address generators (LaneAddr or Sw128LaneAddr) plus byte
// offsets k_off / v_off (the ring slot).
// (WINDOW) the tokens (r % nq) of this thread's packed rows r, computed once per block: a
// division per tile and row made ptxas spill at d=32.
// row0: the block row of the warp's first row (attn_decode RING 3: warp w computes rows 16w..).
template <int ROW_TILES, bool WINDOW>
struct DecodeRowTokens {
    int token[WINDOW ? 2 * ROW_TILES : 1];
    int row0;
    __device__ __forceinline__ DecodeRowTokens(int lane, int nq, int row0_ = 0) : row0(row0_) {
        if constexpr (WINDOW) {
#pragma unroll
            for (int i = 0; i < 2 * ROW_TILES; ++i) token[i] = (row0 + (i / 2) * 16 + (lane >> 2) + 8 * (i % 2)) % nq;
        }
    }
};

// Nothing to do between a step's softmax and its P V product (the per-warp rings).
struct DecodeNoStep {
    __device__ __forceinline__ void operator()() const {}
};

// Score modifiers (score_mod.cuh) of a block's packed rows: off (the plain kernels: nothing is
// stored or computed), or on (attn_decode_mod): the softcap is the launch's, but the ALiBi slope and
// the sink belong to each row's query head. Applied in raw units before the mask, as the prefill
// kernels apply them. ALiBi's per-row (bias, distance) pairs live in shared memory, read once per row
// and tile: held in registers (with the loop-invariant distances ptxas derived from them), they made
// the two-row-tile kernels at d = 32 / 64 spill.
template <int ROW_TILES, bool ON>
struct DecodeMods {
    static constexpr bool kOn = false;
};
template <int ROW_TILES>
struct DecodeMods<ROW_TILES, true> {
    static constexpr bool kOn = true;
    ScoreMod cap;         // the softcap (its bias unused: per row below)
    const float2* rows_;  // block row r: (-slope / scale of its head, 0 on padding rows; token + len - nq as int bits)
    bool biased;          // ALiBi given (uniform)

    __device__ __forceinline__ void init(const ScoreModArgs& a, float2* shared) {
        cap.set_softcap(a.cap_ex2, a.cap_out);
        rows_ = shared;
        biased = a.alibi != nullptr;
    }
    // All threads of the block (THREADS) fill init's `shared` (BLOCK_ROWS float2, idle until the block's
    // merge: the caller keeps it so with a barrier after its loop) for (sequence b, K/V head hk), whose
    // block rows r < group * nq are (head hk * group + r / nq, token r % nq), over its len keys.
    template <int THREADS, int BLOCK_ROWS>
    __device__ __forceinline__ void fill(const ScoreModArgs& a, int b, int hk, int group, int nq, int len) const {
        if (biased) {
            float2* shared = const_cast<float2*>(rows_);
            for (int r = threadIdx.x; r < BLOCK_ROWS; r += THREADS) {
                const float bias =
                    r < group * nq ? -a.alibi[(i64)b * a.alibi_sb + hk * group + r / nq] * a.inv_scale : 0.f;
                shared[r] = make_float2(bias, __int_as_float(r % nq + len - nq));
            }
        }
    }
    // The sinks of this thread's rows (block rows row0 + (i / 2) * 16 + (lane >> 2) + 8 (i % 2)) as extra
    // keys of its softmax state (sink_raw; the caller picks the one state per row that carries them).
    template <int R>
    __device__ __forceinline__ void add_sinks(OnlineSoftmax<R>& softmax, const ScoreModArgs& a, int hk, int group,
                                              int nq, int row0, int lane) const {
#pragma unroll
        for (int i = 0; i < 2 * ROW_TILES; ++i) {
            const int r = row0 + (i / 2) * 16 + (lane >> 2) + 8 * (i % 2);
            if (r < group * nq) softmax.add_sink_row(i, sink_raw(a, hk * group + r / nq), lane);
        }
    }
    // One key tile's raw scores (keys from n0) of the warp's rows from block row row0: the softcap,
    // then ALiBi's fmaf(bias, |token + len - nq - key|, s) (ScoreMod::apply_rows' arithmetic).
    template <int NS>
    __device__ __forceinline__ void apply(float (&acc)[ROW_TILES][NS][4], int row0, int n0, int lane) const {
#pragma unroll
        for (int mi = 0; mi < ROW_TILES; ++mi) cap.cap_tile(acc[mi]);
        if (biased) {
            const int c0 = n0 + 2 * (lane & 3);
#pragma unroll
            for (int mi = 0; mi < ROW_TILES; ++mi)
#pragma unroll
                for (int hf = 0; hf < 2; ++hf) {
                    const float2 rp = rows_[row0 + mi * 16 + (lane >> 2) + 8 * hf];
                    const int dist = __float_as_int(rp.y) - c0;
#pragma unroll
                    for (int ni = 0; ni < NS; ++ni)
#pragma unroll
                        for (int e = 0; e < 2; ++e)
                            acc[mi][ni][2 * hf + e] =
                                fmaf(rp.x, fabsf((float)(dist - ni * 8 - e)), acc[mi][ni][2 * hf + e]);
                }
        }
    }
};

// One warp's key tile: S = Q K^T, masks, the online softmax, O += P V. `before_pv` runs between the
// softmax and P V (the block ring's wait for V and its next V copy, attn_decode_block RING 2).
// kv: KvSame (K and V in q's type) or KvE4m3 (kv_e4m3.cuh; S scaled by its k_scale before the masks).
// mods: DecodeMods (off, or the rows' softcap and ALiBi, applied after kv's scale, before the masks).
template <typename T, int HEAD_DIM, int ROW_TILES, int BLOCK_N, bool CAUSAL, bool WINDOW, typename AddrK, typename AddrV,
          typename BeforePV = DecodeNoStep, typename KV = KvSame, typename MODS = DecodeMods<ROW_TILES, false>>
__device__ __forceinline__ void decode_tile_step(const DecodeQ<HEAD_DIM, ROW_TILES>& qa, const AddrK& aK,
                                                 const AddrV& aV, u32 k_off, u32 v_off, int n0, int s1,
                                                 const DecodeRowTokens<ROW_TILES, WINDOW>& rows, int lo0, int hi0,
                                                 int nq, int lane, OnlineSoftmax<2 * ROW_TILES>& softmax,
                                                 float (&acc_o)[ROW_TILES][HEAD_DIM / 8][4], float scale_log2,
                                                 const BeforePV& before_pv = BeforePV{}, const KV& kv = KV{},
                                                 const MODS& mods = MODS{}) {
    constexpr int kNS = BLOCK_N / 8, kNO = HEAD_DIM / 8, kKS = HEAD_DIM / 16;
    float acc_s[ROW_TILES][kNS][4];
    zero_acc(acc_s);
    if constexpr (KV::kE4m3) {
        kv8_scores<T, HEAD_DIM, ROW_TILES, BLOCK_N>(acc_s, qa, aK, k_off);
#pragma unroll
        for (int mi = 0; mi < ROW_TILES; ++mi)
#pragma unroll
            for (int ni = 0; ni < kNS; ++ni)
#pragma unroll
                for (int e = 0; e < 4; ++e) acc_s[mi][ni][e] *= kv.k_scale;
    }
#pragma unroll
    for (int kk = 0; kk < (KV::kE4m3 ? 0 : kKS); ++kk) {
        u32 a[ROW_TILES][4];
#pragma unroll
        for (int mi = 0; mi < ROW_TILES; ++mi) qa.get(a[mi], mi, kk);
        mma_a_times_kt<T>(acc_s, a, aK, kk, k_off);
    }
    if constexpr (MODS::kOn) mods.apply(acc_s, rows.row0, n0, lane);  // softcap and ALiBi before the mask
    if (n0 + BLOCK_N > s1 || CAUSAL || WINDOW) {
#pragma unroll
        for (int mi = 0; mi < ROW_TILES; ++mi)
#pragma unroll
            for (int hf = 0; hf < 2; ++hf) {
                const int token = WINDOW ? rows.token[2 * mi + hf] : (rows.row0 + mi * 16 + (lane >> 2) + 8 * hf) % nq;
                mask_score_row<CAUSAL || WINDOW, WINDOW>(acc_s[mi], hf, token, n0, s1, hi0, lo0, lane);
            }
    }
    softmax.template update<ROW_TILES, kNS, kNO, true, false>(acc_s, acc_o, scale_log2);
    before_pv();
    if constexpr (KV::kE4m3) {
        kv8_pv<HEAD_DIM, ROW_TILES, BLOCK_N>(acc_o, acc_s, aV, v_off);
    } else {
#pragma unroll
        for (int kk = 0; kk < BLOCK_N / 16; ++kk) mma_acc_times_bt<T>(acc_o, acc_s, kk, aV, kk * 16, 0, v_off);
    }
}

// Four consecutive output columns acc * inv as T (inv: 1 / the row's sum, 0 for a row without
// keys), `valid` of them inside the head dim: one 8-byte store where the address allows (every output
// the library allocates), else element by element. (A division per element and four 2-byte stores
// made the end of a two-row-tile decode block 3.1 us: block trace, H200, Hq=32 Hkv=1.)
template <typename T>
__device__ __forceinline__ void store_quad(u16* dst, const float (&acc)[4], float inv, int valid) {
    u16 e[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) e[k] = from_float<T>(acc[k] * inv);
    if (valid >= 4 && (reinterpret_cast<unsigned long long>(dst) & 7) == 0) {
        *reinterpret_cast<uint2*>(dst) = make_uint2(e[0] | (u32)e[1] << 16, e[2] | (u32)e[3] << 16);
    } else {
#pragma unroll
        for (int k = 0; k < 4; ++k)
            if (k < valid) dst[k] = e[k];
    }
}

// How many warps' O tiles (16 * ROW_TILES rows x HEAD_DIM floats each) merge side by side
// (decode_merge_warps): as many as fit in the merge buffer of BUFFER_BYTES. One at a time below
// d=128 with two or more row tiles: ptxas, holding these kernels at 168 registers (3 blocks per
// SM), spilled 12 bytes in the loop of the d=64 two-row-tile cluster kernels with side-by-side
// slots. (At d=128 with two row tiles, one at a time made a block's warp merge take 11 us, against
// 0.8 with one row tile: block trace, H200, B=1 Hkv=1 Hq=32 L=32k.)
template <int HEAD_DIM, int ROW_TILES, int WARPS, int BUFFER_BYTES>
__host__ __device__ constexpr int decode_merge_slots() {
    constexpr int fit = BUFFER_BYTES / (16 * ROW_TILES * HEAD_DIM * 4);
    static_assert(fit >= 1, "the merge buffer holds at least one O tile");
    return ROW_TILES > 1 && HEAD_DIM < 128 ? 1 : fit < WARPS ? fit : WARPS;
}

// Each computing warp publishes (max, sum) per packed row in s_stat [WARPS][rows16][2]; then the
// warps rescale their O to the common max and write it into SLOTS slots of sO (float, each
// rows16 x HEAD_DIM; shared memory that is idle by now): warp w into slot w % SLOTS in round
// w / SLOTS, adding to what the earlier round's warp left there. With a slot per warp this is one
// round: the warps write side by side, with no read-modify-write and one barrier. (Adding into one
// buffer in warp order cost a barrier and a dependent read per warp: the end of a block was 4.6 us
// on the small decode cell, block trace.) Only the first `rows` (valid packed) rows are written.
// The readers then add a row's slots in slot order: a fixed summation order. The slots hold
// the block's un-normalized O: row r's sum of exp2((s - m) * scale_log2) v over its keys, m the
// row's max over the warps (see decode_row_stat). `computes` is false for a warp with no
// statistics (a TMA producer). All threads of the block must call this; it ends with a block barrier.
// KV8_COLS: acc_o in the column order of the e4m3 P V product (kv8_pv), written back in order.
template <int HEAD_DIM, int ROW_TILES, int WARPS, int SLOTS, bool KV8_COLS = false>
__device__ __forceinline__ void decode_merge_warps(const OnlineSoftmax<2 * ROW_TILES>& softmax,
                                                   const float (&acc_o)[ROW_TILES][HEAD_DIM / 8][4], bool computes,
                                                   float* s_stat, float* sO, int warp, int lane, int rows,
                                                   float scale_log2) {
    constexpr int kRows = 16 * ROW_TILES, kNO = HEAD_DIM / 8, kRounds = (WARPS + SLOTS - 1) / SLOTS;
    if (computes) {
#pragma unroll
        for (int r2 = 0; r2 < 2 * ROW_TILES; ++r2) {
            const float sum = quad_sum(softmax.l[r2]);
            if ((lane & 3) == 0) {
                const int r = (r2 / 2) * 16 + (lane >> 2) + 8 * (r2 % 2);
                s_stat[(warp * kRows + r) * 2] = softmax.m[r2];
                s_stat[(warp * kRows + r) * 2 + 1] = sum;
            }
        }
    }
    __syncthreads();  // statistics visible; every warp is past its loop, so the buffers are free
    float* slot = sO + (warp % SLOTS) * kRows * HEAD_DIM;
    for (int round = 0; round < kRounds; ++round) {
        if (computes && warp / SLOTS == round) {
#pragma unroll
            for (int mi = 0; mi < ROW_TILES; ++mi)
#pragma unroll
                for (int hf = 0; hf < 2; ++hf) {
                    const int r = mi * 16 + (lane >> 2) + 8 * hf;
                    float mx = -INFINITY;
#pragma unroll
                    for (int w2 = 0; w2 < WARPS; ++w2) mx = fmaxf(mx, s_stat[(w2 * kRows + r) * 2]);
                    const float mine = softmax.m[2 * mi + hf];
                    const float f = mine == -INFINITY ? 0.f : fast_exp2((mine - mx) * scale_log2);
                    if constexpr (KV8_COLS) {
#pragma unroll
                        for (int ni = 0; ni < kNO; ni += 2) {  // tiles ni, ni + 1: columns 8 ni + 4t .. +3
                            float4* dst = reinterpret_cast<float4*>(&slot[r * HEAD_DIM + ni * 8 + 4 * (lane & 3)]);
                            float4 add = make_float4(acc_o[mi][ni][2 * hf] * f, acc_o[mi][ni + 1][2 * hf] * f,
                                                     acc_o[mi][ni][2 * hf + 1] * f, acc_o[mi][ni + 1][2 * hf + 1] * f);
                            if (r < rows) {
                                if (round > 0) {
                                    const float4 old = *dst;
                                    add.x += old.x, add.y += old.y, add.z += old.z, add.w += old.w;
                                }
                                *dst = add;
                            }
                        }
                        continue;
                    }
#pragma unroll
                    for (int ni = 0; ni < kNO; ++ni) {
                        float2* dst = reinterpret_cast<float2*>(&slot[r * HEAD_DIM + ni * 8 + 2 * (lane & 3)]);
                        float2 add = make_float2(acc_o[mi][ni][2 * hf] * f, acc_o[mi][ni][2 * hf + 1] * f);
                        if (r < rows) {
                            if (round > 0) {
                                const float2 old = *dst;
                                add.x += old.x;
                                add.y += old.y;
                            }
                            *dst = add;
                        }
                    }
                }
        }
        __syncthreads();
    }
}

// The end of a block whose warps own whole row tiles (attn_decode RING 3): warp w's online-softmax
// state is final for rows 16w..16w+15, so there is nothing to merge. It writes them as one warp's
// would (s_stat's slot 0: (max, sum); sO: the un-normalized O) and decode_store<..., WARPS = 1,
// SLOTS = 1> writes the result. Only the first `rows` (valid packed) rows. All threads of the block
// must call this; it ends with a block barrier.
// sO's rows are swizzled by 8-column chunks (decode_o_chunk): each store instruction of the
// fragment writes 8 rows, 512 bytes apart unswizzled - all in the same banks, 8-way conflicts
// (ncu, Hq=64 Hkv=1 d=128: ~1000 per block, 27x FA2's); decode_store reads them back the same way.
template <int HEAD_DIM>
__host__ __device__ constexpr bool decode_o_swizzled() {
    return HEAD_DIM % 64 == 0;
}
// The physical 8-column chunk of row r's logical chunk c in a swizzled sO (c ^ (r mod 8): the
// fragment's 8 rows of one store land in 8 distinct chunks, a permutation within each 64 columns).
template <int HEAD_DIM>
__device__ __forceinline__ int decode_o_chunk(int r, int c) {
    if constexpr (decode_o_swizzled<HEAD_DIM>()) return c ^ (r & 7);
    return c;
}
template <int HEAD_DIM>
__device__ __forceinline__ void decode_publish_row_tile(const OnlineSoftmax<2>& softmax,
                                                        const float (&acc_o)[1][HEAD_DIM / 8][4], bool computes,
                                                        float* s_stat, float* sO, int warp, int lane, int rows) {
    constexpr int kNO = HEAD_DIM / 8;
    __syncthreads();  // every warp is past its loop: the rings (sO) are free
    if (computes) {
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
            const int r = warp * 16 + (lane >> 2) + 8 * hf;
            const float sum = quad_sum(softmax.l[hf]);
            const float f = softmax.m[hf] == -INFINITY ? 0.f : 1.f;  // (a row without keys: zeros, as the merge writes)
            if (r < rows) {
                if ((lane & 3) == 0) *reinterpret_cast<float2*>(s_stat + 2 * r) = make_float2(softmax.m[hf], sum);
#pragma unroll
                for (int ni = 0; ni < kNO; ++ni)
                    *reinterpret_cast<float2*>(&sO[r * HEAD_DIM + decode_o_chunk<HEAD_DIM>(r, ni) * 8 + 2 * (lane & 3)]) =
                        make_float2(acc_o[0][ni][2 * hf] * f, acc_o[0][ni][2 * hf + 1] * f);
            }
        }
    }
    __syncthreads();
}

// Row r's statistics over the block's warps (s_stat as decode_merge_warps left it): the max raw
// score mx (-inf when no warp saw a visible key) and the sum of exp2((s - mx) * scale_log2).
template <int ROW_TILES, int WARPS>
__device__ __forceinline__ void decode_row_stat(const float* s_stat, int r, float scale_log2, float& mx, float& sum) {
    constexpr int kRows = 16 * ROW_TILES;
    mx = -INFINITY;
    sum = 0.f;
    for (int w = 0; w < WARPS; ++w) mx = fmaxf(mx, s_stat[(w * kRows + r) * 2]);
    if (mx != -INFINITY)
        for (int w = 0; w < WARPS; ++w) {
            const float mw = s_stat[(w * kRows + r) * 2];
            if (mw != -INFINITY) sum += s_stat[(w * kRows + r) * 2 + 1] * fast_exp2((mw - mx) * scale_log2);
        }
}

// Each valid row's statistics over the warps (decode_row_stat) into warp 0's slot of s_stat as
// (mx, sum): thread r reads and rewrites row r's slots, which no other thread reads meanwhile. The
// caller's barrier makes them visible.
template <int ROW_TILES, int WARPS, int THREADS>
__device__ __forceinline__ void decode_reduce_row_stats(float* s_stat, int rows, float scale_log2) {
    for (int r = threadIdx.x; r < rows; r += THREADS) {
        float mx, sum;
        decode_row_stat<ROW_TILES, WARPS>(s_stat, r, scale_log2, mx, sum);
        *reinterpret_cast<float2*>(s_stat + 2 * r) = make_float2(mx, sum);
    }
}

// The block's result after decode_merge_warps: O and LSE (one split) or the split's normalized
// partial O and its log-sum-exp (several splits, merged by the last of them or attn_decode_combine),
// valid rows only.
// Each row's statistics are reduced once (decode_reduce_row_stats), then each thread writes 4
// consecutive columns of a row. (Every element
// reduced its row's statistics itself before: with 4 packed rows, 4 dependent passes per thread,
// and a block's end took 2.6 us against 1.3 with one row - block trace, B=64 Hkv=8 L=4k.) The
// arithmetic per element is unchanged, so are the results, bit for bit. All threads of the block
// must call this (it has a block barrier).
// SWIZZLED: sO as decode_publish_row_tile writes it (decode_o_chunk), one slot.
template <typename T, int HEAD_DIM, int ROW_TILES, int WARPS, int THREADS, int SLOTS, bool SWIZZLED = false>
__device__ __forceinline__ void decode_store(float* s_stat, const float* sO, u16* o, float* lse, float* part_o,
                                             float* part_lse, i64 o_sb, i64 o_sh, i64 o_sn, int b, int hk, int hkv,
                                             int split, int n_splits, int hq, int nq, int d, int group,
                                             float scale_log2) {
    constexpr float kLn2 = 0.6931471805599453f;
    const int rows = group * nq;
    constexpr int kGroups = HEAD_DIM / 4;
    static_assert(HEAD_DIM % 4 == 0, "whole 4-column groups");
    decode_reduce_row_stats<ROW_TILES, WARPS, THREADS>(s_stat, rows, scale_log2);
    __syncthreads();
    auto store_group = [&](int i) {
        const int r = i / kGroups, c0 = (i % kGroups) * 4;
        if (c0 >= d) return;
        const float2 st = *reinterpret_cast<const float2*>(s_stat + 2 * r);
        const float mx = st.x, sum = st.y;
        static_assert(!SWIZZLED || SLOTS == 1, "a swizzled sO holds one slot");
        const int phys = SWIZZLED ? decode_o_chunk<HEAD_DIM>(r, c0 >> 3) * 8 + (c0 & 7) : c0;
        float4 acc = *reinterpret_cast<const float4*>(sO + r * HEAD_DIM + phys);
#pragma unroll
        for (int s = 1; s < SLOTS; ++s) {
            const float4 x = *reinterpret_cast<const float4*>(sO + s * 16 * ROW_TILES * HEAD_DIM + r * HEAD_DIM + c0);
            acc.x += x.x;
            acc.y += x.y;
            acc.z += x.z;
            acc.w += x.w;
        }
        const float part[4] = {acc.x, acc.y, acc.z, acc.w};
        const float row_lse = sum > 0.f ? (mx * scale_log2 + __log2f(sum)) * kLn2 : -INFINITY;
        const float inv = sum > 0.f ? 1.f / sum : 0.f;
        const int h = hk * group + r / nq, tok = r % nq;
        const i64 prow = (((i64)b * hkv + hk) * n_splits + split) * rows + r;
        if (n_splits == 1)
            store_quad<T>(o + b * o_sb + h * o_sh + tok * o_sn + c0, part, inv, d - c0);
        else  // (d % 8 == 0: whole float4s, 16-byte aligned rows)
            *reinterpret_cast<float4*>(part_o + prow * d + c0) =
                make_float4(part[0] * inv, part[1] * inv, part[2] * inv, part[3] * inv);
        if (c0 == 0) {
            if (n_splits == 1)
                lse[((i64)b * hq + h) * nq + tok] = row_lse;
            else
                part_lse[prow] = row_lse;
        }
    };
    // (unrolled at d=128 with two row tiles: 32 packed rows give a thread 8 groups, and one at a time
    // took 2.8 us, block trace; elsewhere left to the compiler - forcing it spilled)
    if constexpr (ROW_TILES > 1 && HEAD_DIM == 128) {
#pragma unroll 4
        for (int i = threadIdx.x; i < rows * kGroups; i += THREADS) store_group(i);
    } else {
        for (int i = threadIdx.x; i < rows * kGroups; i += THREADS) store_group(i);
    }
}

// decode_merge_warps then decode_store: the end of a block whose splits (if any) a combine kernel
// merges. BUFFER_BYTES: the shared memory at sO free for the merge.
template <typename T, int HEAD_DIM, int ROW_TILES, int WARPS, int THREADS, int BUFFER_BYTES, bool KV8_COLS = false>
__device__ __forceinline__ void decode_merge_store(const OnlineSoftmax<2 * ROW_TILES>& softmax,
                                                   const float (&acc_o)[ROW_TILES][HEAD_DIM / 8][4], bool computes,
                                                   float* s_stat, float* sO, int warp, int lane, u16* o, float* lse,
                                                   float* part_o, float* part_lse, i64 o_sb, i64 o_sh, i64 o_sn,
                                                   int b, int hk, int hkv, int split, int n_splits, int hq, int nq,
                                                   int d, int group, float scale_log2) {
    constexpr int kSlots = decode_merge_slots<HEAD_DIM, ROW_TILES, WARPS, BUFFER_BYTES>();
    decode_merge_warps<HEAD_DIM, ROW_TILES, WARPS, kSlots, KV8_COLS>(softmax, acc_o, computes, s_stat, sO, warp,
                                                                     lane, group * nq, scale_log2);
    decode_store<T, HEAD_DIM, ROW_TILES, WARPS, THREADS, kSlots>(s_stat, sO, o, lse, part_o, part_lse, o_sb, o_sh,
                                                                 o_sn, b, hk, hkv, split, n_splits, hq, nq, d, group,
                                                                 scale_log2);
}

// ---- Merging the splits' partials through memory (attn_decode_combine, or a pair's last split) ----
// part_o holds each split's normalized partial O, rows of d floats at (((b * hkv + hk) * n_splits +
// split) * rows + r), part_lse its log-sum-exp; every split wrote every row (zeros and -inf where it
// saw no key). One thread merges 4 columns of one row in a single pass over the splits by the
// log-sum-exp rule, kMergeBatch splits' loads in flight at a time (L2 round trips, not arithmetic,
// are its cost):
//     O = sum_s w_s O_s / sum_s w_s,  w_s = exp(lse_s - m),  LSE = m + log(sum_s w_s),
// with m the running maximum (the sums rescaled when it grows). The combine kernel cuts more than
// kMergeBatch splits into at most kMergeSlices slices of whole batches (decode_merge_slice), each
// its own running merge on its own thread, and merges the slices' states in order: a thread then
// waits for at most ceil(batches / kMergeSlices) round trips, where one K/V head at B=1 (128-256
// splits, 16-32 batches) had the combine end 13 us after the split kernel. The last split's merge
// reads its partials from shared memory and runs one pass; up to kMergeBatch splits both give the
// same bits.
constexpr int kMergeBatch = 8;
constexpr int kMergeSlices = 8;  // (a power of two <= 32: a group's slices are adjacent lanes of one warp)

// Splits per slice: n_splits' batches in at most kMergeSlices slices of equal whole batches (the
// last may be short). Up to kMergeBatch splits: one slice.
__host__ __device__ __forceinline__ int decode_merge_slice(int n_splits) {
    const int batches = (n_splits + kMergeBatch - 1) / kMergeBatch;
    return (batches + kMergeSlices - 1) / kMergeSlices * kMergeBatch;
}

// The combine kernel's threads per 4-column group: the slices rounded up to a power of two (1, 2, 4
// or 8; gpu_decode.combine_lanes sizes the grid by the same rule).
__host__ __device__ __forceinline__ int decode_merge_lanes(int n_splits) {
    const int slice = decode_merge_slice(n_splits), slices = (n_splits + slice - 1) / slice;
    int lanes = 1;
    while (lanes < slices) lanes *= 2;
    return lanes;
}

// One 4-column group's running merge: the max of the splits' LSEs so far, the sum of their
// weights and the weighted sum of their O columns.
struct DecodeMergeState {
    static constexpr int kParked = 6;  // floats of a state parked in shared memory: m, l, acc[4]
    float m = -INFINITY, l = 0.f, acc[4] = {0.f, 0.f, 0.f, 0.f};

    __device__ __forceinline__ void park(float* x) const {
        x[0] = m, x[1] = l, x[2] = acc[0], x[3] = acc[1], x[4] = acc[2], x[5] = acc[3];
    }
    __device__ __forceinline__ static DecodeMergeState unpark(const float* x) {
        DecodeMergeState s;
        s.m = x[0], s.l = x[1], s.acc[0] = x[2], s.acc[1] = x[3], s.acc[2] = x[4], s.acc[3] = x[5];
        return s;
    }

    // A batch of kMergeBatch splits (lse -inf past the last split: weight 0): rescale to the batch's
    // max (false: no split so far saw a key of this row, nothing to add), then add() each split in
    // order. Split this way so that a merge reading O from shared memory holds one float4 at a time.
    __device__ __forceinline__ bool rescale(const float (&ls)[kMergeBatch], float& mb) {
        mb = m;
#pragma unroll
        for (int j = 0; j < kMergeBatch; ++j) mb = fmaxf(mb, ls[j]);
        if (mb == -INFINITY) return false;
        const float a = __expf(m - mb);  // (m = -inf: 0, and l, acc are 0)
        l *= a;
#pragma unroll
        for (int k = 0; k < 4; ++k) acc[k] *= a;
        m = mb;
        return true;
    }
    __device__ __forceinline__ void add(float ls, float mb, float4 po) {
        const float w = __expf(ls - mb);
        l += w;
        acc[0] += w * po.x;
        acc[1] += w * po.y;
        acc[2] += w * po.z;
        acc[3] += w * po.w;
    }
    // The next slice's merge s, after this one's (both rescaled to the larger max).
    __device__ __forceinline__ void merge(const DecodeMergeState& s) {
        const float mb = fmaxf(m, s.m);
        if (mb == -INFINITY) return;
        const float a = __expf(m - mb), c = __expf(s.m - mb);
        l = l * a + s.l * c;
#pragma unroll
        for (int k = 0; k < 4; ++k) acc[k] = acc[k] * a + s.acc[k] * c;
        m = mb;
    }

    // O's 4 columns from c0 and (c0 == 0) the row's LSE, for packed row r of (b, hk).
    template <typename T>
    __device__ __forceinline__ void store(u16* o, float* lse, i64 o_sb, i64 o_sh, i64 o_sn, int b, int hk, int hq,
                                          int nq, int d, int group, int r, int c0) const {
        const int h = hk * group + r / nq, tok = r % nq;
        store_quad<T>(o + b * o_sb + h * o_sh + tok * o_sn + c0, acc, l > 0.f ? 1.f / l : 0.f, d - c0);
        if (c0 == 0) lse[((i64)b * hq + h) * nq + tok] = l > 0.f ? m + __logf(l) : -INFINITY;
    }
};

// Splits [a, e) of row r's columns c0..c0+3 into st, a batch's loads at a time from global memory
// (row0: the row's partial in split 0; split s at row0 + s * rows).
__device__ __forceinline__ void decode_merge_splits(DecodeMergeState& st, const float* part_o, const float* part_lse,
                                                    i64 row0, int rows, int d, int c0, int a, int e) {
    for (int s0 = a; s0 < e; s0 += kMergeBatch) {
        float ls[kMergeBatch];
        float4 po[kMergeBatch];
#pragma unroll
        for (int j = 0; j < kMergeBatch; ++j) {  // independent loads, issued back to back
            const i64 row = row0 + (i64)(s0 + j) * rows;
            const bool in = s0 + j < e;
            // (.cg: another block's stores, read past this SM's L1; d % 8 == 0, so whole float4s)
            ls[j] = in ? __ldcg(part_lse + row) : -INFINITY;
            po[j] = in ? __ldcg(reinterpret_cast<const float4*>(part_o + row * d + c0)) : make_float4(0.f, 0.f, 0.f, 0.f);
        }
        float mb;
        if (st.rescale(ls, mb)) {
#pragma unroll
            for (int j = 0; j < kMergeBatch; ++j) st.add(ls[j], mb, po[j]);
        }
    }
}

// Row r's columns c0..c0+3 of pair (b, hk) in one pass, each batch's loads straight from global
// memory (the last split's merge with several row tiles).
template <typename T>
__device__ __forceinline__ void decode_merge_quad(const float* part_o, const float* part_lse, u16* o, float* lse,
                                                  i64 o_sb, i64 o_sh, i64 o_sn, int b, int hk, int hkv, int n_splits,
                                                  int hq, int nq, int d, int group, int r, int c0) {
    const int rows = group * nq;
    DecodeMergeState st;
    decode_merge_splits(st, part_o, part_lse, ((i64)b * hkv + hk) * n_splits * rows + r, rows, d, c0, 0, n_splits);
    st.template store<T>(o, lse, o_sb, o_sh, o_sn, b, hk, hq, nq, d, group, r, c0);
}

// attn_decode_combine's block `block` (kCombineThreads threads) of pair (b, hk): its threads cover
// kCombineThreads / lanes consecutive 4-column groups of the pair's rows x lanes slices
// (decode_merge_lanes), thread `tid` the slice tid / (kCombineThreads / lanes) of one group, so that
// a warp's loads stay whole runs of consecutive groups; each slice's state goes to shared memory,
// and the group's first slice merges the others in slice order and stores.
constexpr int kCombineThreads = 128;  // (gpu_decode._COMBINE_THREADS)
template <typename T, int HEAD_DIM>
__device__ __forceinline__ void decode_combine_slices(const float* part_o, const float* part_lse, u16* o, float* lse,
                                                      i64 o_sb, i64 o_sh, i64 o_sn, int b, int hk, int hkv,
                                                      int n_splits, int hq, int nq, int d, int group, int block,
                                                      int tid) {
    constexpr int kGroups = HEAD_DIM / 4;
    __shared__ float s_state[kCombineThreads * DecodeMergeState::kParked];
    const int lanes = decode_merge_lanes(n_splits), per_block = kCombineThreads / lanes;
    const int rows = group * nq, slot = tid / per_block, unit = block * per_block + tid % per_block;
    const int r = unit / kGroups, c0 = (unit % kGroups) * 4, slice = decode_merge_slice(n_splits);
    const bool valid = r < rows && c0 < d;
    const i64 row0 = ((i64)b * hkv + hk) * n_splits * rows + r;
    DecodeMergeState st;
    if (valid && slot * slice < n_splits)
        decode_merge_splits(st, part_o, part_lse, row0, rows, d, c0, slot * slice, min((slot + 1) * slice, n_splits));
    if (lanes > 1) {  // (the same for the whole grid)
        st.park(s_state + DecodeMergeState::kParked * tid);
        __syncthreads();
        for (int k = 1; slot == 0 && k < lanes && k * slice < n_splits; ++k)
            st.merge(DecodeMergeState::unpark(s_state + DecodeMergeState::kParked * (tid + k * per_block)));
    }
    if (slot == 0 && valid) st.template store<T>(o, lse, o_sb, o_sh, o_sn, b, hk, hq, nq, d, group, r, c0);
}

// The 4-column groups first, first + stride, ... of (sequence b, K/V head hk)'s rows, merged.
template <typename T, int HEAD_DIM>
__device__ __forceinline__ void decode_merge_pair(const float* part_o, const float* part_lse, u16* o, float* lse,
                                                  i64 o_sb, i64 o_sh, i64 o_sn, int b, int hk, int hkv, int n_splits,
                                                  int hq, int nq, int d, int group, int first, int stride) {
    constexpr int kGroups = HEAD_DIM / 4;
    for (int i = first; i < group * nq * kGroups; i += stride) {
        const int r = i / kGroups, c0 = (i % kGroups) * 4;
        if (c0 < d)
            decode_merge_quad<T>(part_o, part_lse, o, lse, o_sb, o_sh, o_sn, b, hk, hkv, n_splits, hq, nq, d, group, r,
                                 c0);
    }
}

// The last split's merge of its pair: a pair's partials are one contiguous run (splits x rows x d
// floats, and splits x rows LSEs), so the splits are copied into shared memory (`buffer`,
// BUFFER_BYTES free there) with 16-byte cp.async and merged from there: one L2 round trip when
// they all fit, where loading a group's splits 8 at a time took one per 8 splits and per group
// of the thread. When they do not, runs of `chunk` splits (a multiple of kMergeBatch) go through in
// turn, each group's running state parked in shared memory between runs: one pass over the
// batches, as decode_merge_quad makes (and the combine kernel, up to kMergeBatch splits: the same
// bits). Where not even kMergeBatch splits fit (64 rows at d=256) it loads from global memory as
// decode_merge_quad does. Every thread of the block must call this.
template <typename T, int HEAD_DIM, int THREADS, int BUFFER_BYTES>
__device__ __noinline__ void decode_merge_pair_staged(const float* part_o, const float* part_lse, u16* o,
                                                         float* lse, i64 o_sb, i64 o_sh, i64 o_sn, int b, int hk,
                                                         int hkv, int n_splits, int hq, int nq, int d, int group,
                                                         float* buffer) {
    constexpr int kGroups = HEAD_DIM / 4, kCap = BUFFER_BYTES / 4;  // (floats)
    constexpr int kState = DecodeMergeState::kParked;
    const int rows = group * nq, n_groups = rows * kGroups, per_split = rows * d + rows;  // O rows, then LSEs
    const bool one_run = n_splits * per_split <= kCap;
    const int chunk = one_run ? n_splits : (kCap - kState * n_groups) / per_split / kMergeBatch * kMergeBatch;
    if (chunk <= 0) {
        decode_merge_pair<T, HEAD_DIM>(part_o, part_lse, o, lse, o_sb, o_sh, o_sn, b, hk, hkv, n_splits, hq, nq, d,
                                       group, threadIdx.x, THREADS);
        return;
    }
    const i64 row0 = ((i64)b * hkv + hk) * n_splits * rows;  // the pair's first partial row
    float* sO = buffer;
    float* sL = buffer + chunk * rows * d;
    float* sState = buffer + kCap - kState * n_groups;  // (several runs only: past the runs' floats)
    for (int s0 = 0; s0 < n_splits; s0 += chunk) {
        const int ns = min(chunk, n_splits - s0);
        __syncthreads();  // the previous run's reads are done
        const float* gO = part_o + (row0 + (i64)s0 * rows) * d;
        for (int i = threadIdx.x; i < ns * rows * d / 4; i += THREADS) cp_async16(sO + 4 * i, gO + 4 * i, true);
        cp_async_commit();
        for (int i = threadIdx.x; i < ns * rows; i += THREADS) sL[i] = __ldcg(part_lse + row0 + (i64)s0 * rows + i);
        cp_async_wait<0>();
        __syncthreads();
        for (int i = threadIdx.x; i < n_groups; i += THREADS) {
            const int r = i / kGroups, c0 = (i % kGroups) * 4;
            if (c0 >= d) continue;
            DecodeMergeState st = s0 > 0 ? DecodeMergeState::unpark(sState + kState * i) : DecodeMergeState();
            for (int j0 = 0; j0 < ns; j0 += kMergeBatch) {
                float ls[kMergeBatch], mb;
#pragma unroll
                for (int j = 0; j < kMergeBatch; ++j) ls[j] = j0 + j < ns ? sL[(j0 + j) * rows + r] : -INFINITY;
                if (!st.rescale(ls, mb)) continue;
#pragma unroll
                for (int j = 0; j < kMergeBatch; ++j) {
                    const int sp = j0 + j;
                    const float4 po = sp < ns ? *reinterpret_cast<const float4*>(sO + (sp * rows + r) * d + c0)
                                              : make_float4(0.f, 0.f, 0.f, 0.f);
                    st.add(ls[j], mb, po);
                }
            }
            if (s0 + ns < n_splits) {
                st.park(sState + kState * i);
            } else {
                st.template store<T>(o, lse, o_sb, o_sh, o_sn, b, hk, hq, nq, d, group, r, c0);
            }
        }
    }
}

// The end of a split block whose pair's splits merge in the last of them (split_done: a counter
// per (sequence, K/V head), zero at launch): after this block's partials are stored, one thread
// publishes them (fence, then the count); the block that brings the count to n_splits merges all
// of them (decode_merge_pair_staged, through `buffer`) and resets the counter to zero for the next
// launch on its stream. This replaces the combine kernel's launch, its wait for the whole grid and
// its start (H200, B=1 Hkv=8 L=32k: the combine ended ~10 us after the split kernel; CUPTI).
// Every thread of the block must call this (block barriers).
template <typename T, int HEAD_DIM, int ROW_TILES, int THREADS, int BUFFER_BYTES>
__device__ __forceinline__ void decode_last_split_merges(int* split_done, const float* part_o,
                                                         const float* part_lse, u16* o, float* lse, i64 o_sb,
                                                         i64 o_sh, i64 o_sn, int b, int hk, int hkv, int n_splits,
                                                         int hq, int nq, int d, int group, float* buffer) {
    __shared__ int s_last;
    __syncthreads();  // every thread's partial stores are issued
    if (threadIdx.x == 0) {
        int* count = split_done + (i64)b * hkv + hk;
        __threadfence();  // ... and visible to the device before the count says so
        const bool last = atomicAdd(count, 1) == n_splits - 1;
        if (last) {
            atomicExch(count, 0);  // every split has counted: zero for the next launch
            __threadfence();       // the other splits' partials are visible to this block's reads
        }
        s_last = last;
    }
    __syncthreads();
    if (!s_last) return;
    // (Staged with one row tile, where a thread may have a single column group to merge and the
    // planner uses this merge; with more rows, in one pass from global memory (decode_merge_pair):
    // the staging code pushed some of those instantiations over ptxas's register budget.)
    if constexpr (ROW_TILES == 1)
        decode_merge_pair_staged<T, HEAD_DIM, THREADS, BUFFER_BYTES>(
            part_o, part_lse, o, lse, o_sb, o_sh, o_sn, b, hk, hkv, n_splits, hq, nq, d, group, buffer);
    else
        decode_merge_pair<T, HEAD_DIM>(part_o, part_lse, o, lse, o_sb, o_sh, o_sn, b, hk, hkv, n_splits, hq, nq, d,
                                       group, threadIdx.x, THREADS);
}

#if __CUDA_ARCH__ >= 900
// ---- Thread-block clusters (sm_90): the splits of one (K/V head, sequence) as one cluster ----

// Every thread of every block of the cluster arrives; shared-memory writes before it are visible
// to the whole cluster after it (release / acquire at cluster scope).
__device__ __forceinline__ void cluster_sync() {
    asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}

// The same shared-memory offset in block `rank` of this cluster (a shared::cluster address).
__device__ __forceinline__ u32 cluster_map(u32 smem, int rank) {
    u32 out;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(out) : "r"(smem), "r"(rank));
    return out;
}

__device__ __forceinline__ float2 ld_cluster_f2(u32 addr) {
    float2 v;
    asm volatile("ld.shared::cluster.v2.f32 {%0, %1}, [%2];\n" : "=f"(v.x), "=f"(v.y) : "r"(addr) : "memory");
    return v;
}

__device__ __forceinline__ float4 ld_cluster_f4(u32 addr) {
    float4 v;
    asm volatile("ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [%4];\n"
                 : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
                 : "r"(addr)
                 : "memory");
    return v;
}

// The end of a block whose CLUSTER splits form one thread-block cluster (rank = split), after
// decode_merge_warps: no workspace and no combine kernel. Each block reduces its warps' row
// statistics to (m, l) in warp 0's slots of s_stat and its SLOTS merge slots into the first (sO);
// after a cluster barrier, rank `rank` merges its 1/CLUSTER share of the columns (whole 4-column
// groups) of every row from all blocks' sO and (m, l)
// through distributed shared memory with the log-sum-exp rule
//     O = sum_s w_s sO_s / sum_s w_s l_s,  w_s = exp2((m_s - max_s m_s) * scale_log2)
// (a block that saw no key of a row has m = -inf: weight 0), and writes O and LSE. A second
// cluster barrier keeps every block's shared memory alive until all reads are done. Every thread
// of every block must call this (blocks without keys included).
template <typename T, int HEAD_DIM, int ROW_TILES, int WARPS, int THREADS, int CLUSTER, int SLOTS>
__device__ __forceinline__ void decode_cluster_store(float* s_stat, float* sO, int rank, u16* o, float* lse,
                                                     i64 o_sb, i64 o_sh, i64 o_sn, int b, int hk, int hq, int nq,
                                                     int d, int group, float scale_log2) {
    constexpr float kLn2 = 0.6931471805599453f;
    // Rank r merges `quads` 4-column groups from column c0: HEAD_DIM / (4 CLUSTER) of them when that
    // divides (a compile-time count), else (sizes 3, 5, 6, 7) from group r * groups / CLUSTER to the next rank's.
    constexpr int kGroups = HEAD_DIM / 4;
    constexpr bool kEven = kGroups % CLUSTER == 0;
    const int c0 = kEven ? rank * (HEAD_DIM / CLUSTER) : rank * kGroups / CLUSTER * 4;
    const int quads = kEven ? kGroups / CLUSTER : (rank + 1) * kGroups / CLUSTER - rank * kGroups / CLUSTER;
    const int rows = group * nq;
    decode_reduce_row_stats<ROW_TILES, WARPS, THREADS>(s_stat, rows, scale_log2);
    if constexpr (SLOTS > 1) {  // the block's slots into slot 0, which the other ranks read
        for (int i = threadIdx.x; i < rows * HEAD_DIM; i += THREADS) {
            float acc = sO[i];
#pragma unroll
            for (int s = 1; s < SLOTS; ++s) acc += sO[s * 16 * ROW_TILES * HEAD_DIM + i];
            sO[i] = acc;
        }
    }
    cluster_sync();  // every block's sO and (m, l) are final and visible to the cluster
    const u32 stat0 = smem_addr(s_stat), o0 = smem_addr(sO);
    for (int i = threadIdx.x; i < rows * quads; i += THREADS) {
        const int r = i / quads, c = c0 + (i % quads) * 4;
        float2 st[CLUSTER];
        float4 part[CLUSTER];
#pragma unroll
        for (int s = 0; s < CLUSTER; ++s) {  // independent loads, issued back to back
            st[s] = ld_cluster_f2(cluster_map(stat0 + 8 * r, s));
            part[s] = ld_cluster_f4(cluster_map(o0 + 4 * (r * HEAD_DIM + c), s));
        }
        float mx = -INFINITY;
#pragma unroll
        for (int s = 0; s < CLUSTER; ++s) mx = fmaxf(mx, st[s].x);
        float sum = 0.f, acc[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
        for (int s = 0; s < CLUSTER; ++s) {  // rank order: a fixed summation order
            const float w = st[s].x == -INFINITY ? 0.f : fast_exp2((st[s].x - mx) * scale_log2);
            sum += w * st[s].y;
            acc[0] += w * part[s].x;
            acc[1] += w * part[s].y;
            acc[2] += w * part[s].z;
            acc[3] += w * part[s].w;
        }
        const int h = hk * group + r / nq, tok = r % nq;
        store_quad<T>(o + b * o_sb + h * o_sh + tok * o_sn + c, acc, sum > 0.f ? 1.f / sum : 0.f, d - c);
        if (c == 0) lse[((i64)b * hq + h) * nq + tok] = sum > 0.f ? (mx * scale_log2 + __log2f(sum)) * kLn2 : -INFINITY;
    }
    cluster_sync();  // no block exits (freeing its shared memory) while another may still read it
}
#endif
