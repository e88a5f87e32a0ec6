// Online softmax over mma accumulator fragments (the m16n8 C layout: lane = 4*g + t holds rows g
// and g+8, columns 2t and 2t+1 of every 8-column tile). Base 2: scores are multiplied by
// scale*log2(e) inside one FFMA with the running max subtracted, so exp2 is a single SFU op.
#pragma once
#include "common.cuh"

template <int ROWS>  // rows held per thread: 2 per 16-row mma tile
struct OnlineSoftmax {
    float m[ROWS];  // running max of raw scores (unscaled); -inf until a visible key appears
    float l[ROWS];  // running sum of exp2, partial over this thread's columns until finalize

    __device__ __forceinline__ OnlineSoftmax() {
#pragma unroll
        for (int r = 0; r < ROWS; ++r) {
            m[r] = -INFINITY;
            l[r] = 0.f;
        }
    }

    // An attention sink: one more key of raw score m_raw that carries no value (-inf: none). The
    // running max starts at it and one lane of each quad holds its exp2(0) = 1 (l is summed over
    // the quad in finalize), so a row that sees no key ends with O = 0 and lse = the sink.
    __device__ __forceinline__ void add_sink(float m_raw, int lane) {
        if (m_raw == -INFINITY) return;
#pragma unroll
        for (int r = 0; r < ROWS; ++r) {
            m[r] = m_raw;
            l[r] = (lane & 3) == 0 ? 1.f : 0.f;
        }
    }
    // add_sink for row r alone (the decode kernel packs rows of several heads, each its own sink).
    __device__ __forceinline__ void add_sink_row(int r, float m_raw, int lane) {
        if (m_raw == -INFINITY) return;
        m[r] = m_raw;
        l[r] = (lane & 3) == 0 ? 1.f : 0.f;
    }

    // STALE: a row keeps its running max while the tile's max stays within 2^kStaleLog2 of it
    // (scaled, base 2), so its probabilities reach at most 2^8 - still exact, since O and l share
    // the max; its alpha is then exactly 1 and O's rows need no rescale (the caller skips it when
    // no row of the warp moved). In 16-bit P, 2^8 costs no precision (same significand width).
    static constexpr float kStaleLog2 = 8.f;

    // Turn the score tile s into unnormalized probabilities (in place), update the running max and
    // sum, and return in alpha[r] the factor that O's row r must be multiplied by. Returns whether
    // any of this thread's rows moved its max.
    template <int MMA_M, int NS, bool STALE = false>
    __device__ __forceinline__ bool probs(float (&s)[MMA_M][NS][4], float scale_log2, float (&alpha)[ROWS]) {
        bool moved = false;
#pragma unroll
        for (int mi = 0; mi < MMA_M; ++mi)
#pragma unroll
            for (int hf = 0; hf < 2; ++hf) {
                const int r = 2 * mi + hf;
                float mx = m[r];
#pragma unroll
                for (int ni = 0; ni < NS; ++ni) mx = fmaxf(mx, fmaxf(s[mi][ni][2 * hf], s[mi][ni][2 * hf + 1]));
                mx = quad_max(mx);
                // (STALE: -inf - -inf is NaN, which compares false: a row still without keys keeps -inf)
                if constexpr (STALE) {
                    if (!((mx - m[r]) * scale_log2 > kStaleLog2)) mx = m[r];
                }
                // A row with every key so far masked keeps max -inf; use 0 so -inf - (-inf) never forms.
                const float base = (mx == -INFINITY ? 0.f : mx) * scale_log2;
                alpha[r] = fast_exp2(m[r] * scale_log2 - base);  // exp2(-inf) = 0 on the first tile
                if constexpr (STALE) alpha[r] = mx == m[r] ? 1.f : alpha[r];  // exactly 1: O not rescaled
                moved |= (mx != m[r]);
                m[r] = mx;
                float sum = 0.f;
#pragma unroll
                for (int ni = 0; ni < NS; ++ni)
#pragma unroll
                    for (int e = 0; e < 2; ++e) {
                        const float p = fast_exp2(fmaf(s[mi][ni][2 * hf + e], scale_log2, -base));
                        s[mi][ni][2 * hf + e] = p;
                        sum += p;
                    }
                l[r] = l[r] * alpha[r] + sum;
            }
        return moved;
    }

    template <int MMA_M, int NO>
    static __device__ __forceinline__ void rescale(float (&o)[MMA_M][NO][4], const float (&alpha)[ROWS]) {
#pragma unroll
        for (int mi = 0; mi < MMA_M; ++mi)
#pragma unroll
            for (int ni = 0; ni < NO; ++ni)
#pragma unroll
                for (int e = 0; e < 4; ++e) o[mi][ni][e] *= alpha[2 * mi + e / 2];
    }

    // probs() and O's rescale in one step.
    // LAZY: skip O's rescale when no row of the warp moved its max (a vote and a branch, which
    // also splits the basic block between softmax and the P V product).
    // STALE: probs' stale max (a vote that then rarely finds a moved row).
    template <int MMA_M, int NS, int NO, bool LAZY = true, bool STALE = false>
    __device__ __forceinline__ void update(float (&s)[MMA_M][NS][4], float (&o)[MMA_M][NO][4], float scale_log2) {
        float alpha[ROWS];
        const bool moved = probs<MMA_M, NS, STALE>(s, scale_log2, alpha);
        if (!LAZY || __any_sync(0xffffffffu, moved)) rescale(o, alpha);
    }

    // Divide o by the row sums; lse = ln(sum_j exp(scale * s_ij)), -inf for rows with no key.
    template <int MMA_M, int NO>
    __device__ __forceinline__ void finalize(float (&o)[MMA_M][NO][4], float scale_log2, float (&lse)[ROWS]) {
        constexpr float kLn2 = 0.6931471805599453f;
#pragma unroll
        for (int r = 0; r < ROWS; ++r) {
            const float sum = quad_sum(l[r]);
            const float inv = sum > 0.f ? 1.f / sum : 0.f;
            lse[r] = sum > 0.f ? (m[r] * scale_log2 + __log2f(sum)) * kLn2 : -INFINITY;
            l[r] = inv;
        }
#pragma unroll
        for (int mi = 0; mi < MMA_M; ++mi)
#pragma unroll
            for (int ni = 0; ni < NO; ++ni)
#pragma unroll
                for (int e = 0; e < 4; ++e) o[mi][ni][e] *= l[2 * mi + e / 2];
    }
};
