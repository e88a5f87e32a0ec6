// Score modifiers of the *_mod kernels: softcap, ALiBi and attention sinks, applied to the raw
// scores q.k of an mma accumulator where the scores are formed, before the mask.
//
// The kernels scale raw scores inside the softmax's FFMA (scale * log2 e), so a modifier works in
// raw units: softcap c gives raw' = (c / scale) tanh(raw * scale / c), ALiBi adds
// -(slope / scale) |i + Nk - Nq - j|, a sink logit enters as sink / scale. The plain kernels
// instantiate MOD = false, which compiles every use away (their code is unchanged).
#pragma once
#include "common.cuh"

// The softcap c tanh(x / c) = c - c r with r = 1 / (exp(2x / c) / 2 + 1 / 2), on the special
// function unit (ex2 and rcp.approx): absolute error a few 2^-23 of c, where tanh.approx.f32's
// relative 2^-11 would move a capped score by more than a 16-bit rounding of P. exp = inf and
// rcp's 0 for huge denominators give c; exp = 0 gives -c. Per score one FMUL, two SFU ops and two
// FFMA, the launch passing exp2's factor 2 log2(e) scale / c (cap_ex2) so that no kernel holds a
// register for it (c (1 - 2 / (exp(2x) + 1)) from scale / c took three FMULs and two FADDs).
// The reciprocal by FMA Newton steps instead (one SFU op fewer, six more FMA-pipe ones) ran the
// forward's softcap at 0.49-0.55x the plain kernel against 0.56-0.60x (H100, d = 128, N = 4k and
// 16k, same run): the forward's softmax is bound by instruction issue, not by the SFU.
__device__ __forceinline__ float fast_rcp(float x) {
    float y;
    asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// What one kernel launch passes: a zero cap_ex2 / null pointer leaves a modifier off.
struct ScoreModArgs {
    float cap_ex2;       // 2 log2(e) scale / softcap: exp(2 tanh's argument) = exp2(raw * cap_ex2) (0: no softcap)
    float cap_out;       // softcap / scale
    float inv_scale;     // 1 / scale
    const float* alibi;  // slopes, (batch or sequence) * alibi_sb + head (null: no ALiBi)
    int alibi_sb;
    const float* sinks;  // (Hq,) logits (null: no sinks)
};

// The modifier of one (batch entry or sequence, query head): the policy the kernel bodies call.
// apply(): raw scores of an accumulator tile -> modified raw scores, keeping for the backward
// the softcap's derivative factor 1 - tanh^2 (grad()).
struct ScoreMod {
    float cap_ex2, cap_out;
    float bias;    // -slope / scale (0: no ALiBi)
    int dist_off;  // the sequence's nk - nq: ALiBi's distance is |row + dist_off - col|

    static constexpr float kHalfLn2 = 0.34657359027997264f;  // scale / softcap = cap_ex2 ln(2) / 2

    ScoreMod() = default;
    __device__ __forceinline__ ScoreMod(const ScoreModArgs& a, int b, int h, int nq_b, int nk_b)
        : cap_ex2(a.cap_ex2), cap_out(a.cap_out),
          bias(a.alibi != nullptr ? -a.alibi[(i64)b * a.alibi_sb + h] * a.inv_scale : 0.f), dist_off(nk_b - nq_b) {}

    // (a kernel that keeps only the softcap of a ScoreMod)
    __device__ __forceinline__ void set_softcap(float ex2, float out) {
        cap_ex2 = ex2;
        cap_out = out;
    }

    __device__ __forceinline__ bool capped() const { return cap_ex2 != 0.f; }

    __device__ __forceinline__ float cap_in() const { return cap_ex2 * kHalfLn2; }  // scale / softcap

    // The softcap's r = 2 / (exp(2 s cap_in) + 1): tanh(s cap_in) = 1 - r and the capped score
    // cap_out - cap_out r (one FFMA, the same in every kernel, so a backward recomputes the
    // forward's scores exactly).
    __device__ __forceinline__ float cap_recip(float s) const {
        return fast_rcp(fmaf(fast_exp2(s * cap_ex2), 0.5f, 0.5f));
    }
    __device__ __forceinline__ float soft_cap(float s) const { return fmaf(-cap_out, cap_recip(s), cap_out); }
    __device__ __forceinline__ bool biased() const { return bias != 0.f; }

    // One score at (query row, key col); t receives tanh (0 without softcap).
    __device__ __forceinline__ float apply(float s, int row, int col, float& t) const {
        t = 0.f;
        if (capped()) {
            const float r = cap_recip(s);
            t = 1.f - r;
            s = fmaf(-cap_out, r, cap_out);
        }
        if (biased()) s = fmaf(bias, fabsf((float)(row + dist_off - col)), s);
        return s;
    }

    // d(modified)/d(raw) from apply()'s t.
    static __device__ __forceinline__ float grad(float t) { return fmaf(-t, t, 1.f); }

    // The same from the score's probability p = exp2(modified * scale_log2 - lse2), for a kernel
    // that keeps P rather than t: modified = (log2 p + lse2) / scale_log2, less the bias, is
    // cap_out * t, so t = (log2 p + lse2) * tanh_per_log2 (the caller's cap_in() / scale_log2, hoisted:
    // a divide here was one more SFU reciprocal per score). p = 0 (masked, or underflowed) gives 0:
    // dS is 0 there anyway. dist: ALiBi's row + dist_off - col.
    __device__ __forceinline__ float grad_from_prob(float p, float lse2, float tanh_per_log2, float dist) const {
        if (!(p > 0.f)) return 0.f;
        float t = (__log2f(p) + lse2) * tanh_per_log2;
        if (biased()) t = fmaf(-bias * cap_in(), fabsf(dist), t);
        return grad(t);
    }

    // The softcap of every score of an accumulator tile, behind one uniform branch.
    template <int NS>
    __device__ __forceinline__ void cap_tile(float (&acc)[NS][4]) const {
        if (capped()) {
#pragma unroll
            for (int ni = 0; ni < NS; ++ni)
#pragma unroll
                for (int e = 0; e < 4; ++e) acc[ni][e] = soft_cap(acc[ni][e]);
        }
    }

    // A forward accumulator tile of one 16-row mma tile (rows row_g, row_g + 8; columns of this
    // lane), the softcap and the bias each behind one uniform branch.
    template <int NS>
    __device__ __forceinline__ void apply_rows(float (&acc)[NS][4], int row_g, int n0, int lane) const {
        cap_tile(acc);
        if (biased()) {
            // (an integer distance converted per score: 0.88/0.92x the plain forward at N = 4k/16k,
            // causal, d = 128; one conversion per row pair and float constants added, in the same
            // run: 0.76/0.89x, and the softcap there 0.54 against 0.60x at 4k)
#pragma unroll
            for (int ni = 0; ni < NS; ++ni)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int row = row_g + 8 * (e / 2), col = n0 + ni * 8 + 2 * (lane & 3) + (e & 1);
                    acc[ni][e] = fmaf(bias, fabsf((float)(row + dist_off - col)), acc[ni][e]);
                }
        }
    }

    // A backward S^T tile of the wgmma kernel: rows are keys (key0, key0 + 8), columns queries
    // (q0 + ni * 8 + 2 * (lane & 3) + (e & 1)).
    template <int NS>
    __device__ __forceinline__ void apply_cols(float (&acc)[NS][4], int q0, int key0, int lane) const {
        cap_tile(acc);
        if (biased()) {
            const float d0 = col_dist0(q0, key0, lane);
#pragma unroll
            for (int ni = 0; ni < NS; ++ni)
#pragma unroll
                for (int e = 0; e < 4; ++e) acc[ni][e] = fmaf(bias, fabsf(d0 + col_dist(ni, e)), acc[ni][e]);
        }
    }
    // ALiBi's distance in apply_cols' tile: col_dist0 + col_dist(ni, e).
    __device__ __forceinline__ float col_dist0(int q0, int key0, int lane) const {
        return (float)(q0 + 2 * (lane & 3) + dist_off - key0);
    }
    static __device__ __forceinline__ float col_dist(int ni, int e) { return (float)(ni * 8 + (e & 1) - 8 * (e >> 1)); }
};

// The sink of head h in raw units (for the softmax's running max), or -inf without sinks.
__device__ __forceinline__ float sink_raw(const ScoreModArgs& a, int h) {
    return a.sinks != nullptr ? a.sinks[h] * a.inv_scale : -INFINITY;
}
