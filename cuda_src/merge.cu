// Log-sum-exp merge of attention results computed over disjoint key sets (cuflash.merge_attention_states):
//
//   m = max_i lse_i,  w_i = exp(lse_i - m),  o = sum_i w_i o_i / sum_i w_i,  lse = m + log(sum_i w_i)
//
// One thread per output element (row, column), grid-stride. Each thread reads its column of every
// part and the parts' lse of its row (the lse reads repeat across a row's columns and hit the cache);
// the thread of column 0 writes the merged lse. A part with lse = -inf saw no key: it is skipped
// whatever its o holds, and a row no part saw gets o = 0, lse = -inf (cuflash.attention's rows that
// see no key). The arithmetic type A is float for 16-bit parts and double for float32 ones: one step
// wider than the inputs, as the attention kernels compute.
#include "common.cuh"

template <typename T>
struct MergeElem {  // 16-bit storage (Fp16, Bf16 tags)
    using S = u16;
    static __device__ __forceinline__ float load(u16 x) { return to_float<T>(x); }
    static __device__ __forceinline__ u16 store(float f) { return from_float<T>(f); }
};

template <>
struct MergeElem<float> {
    using S = float;
    static __device__ __forceinline__ float load(float x) { return x; }
    static __device__ __forceinline__ float store(float f) { return f; }
};

__device__ __forceinline__ float merge_exp(float x) { return expf(x); }
__device__ __forceinline__ double merge_exp(double x) { return exp(x); }
__device__ __forceinline__ float merge_log(float x) { return logf(x); }
__device__ __forceinline__ double merge_log(double x) { return log(x); }

// o: (P, B, H, N, d) parts, lse: (P, B, H, N) float32, out: (B, H, N, d), lse_out: (B, H, N) float32,
// all with element strides (any sign, any order).
template <typename TI, typename TO, typename A>
__global__ void __launch_bounds__(256) merge_states(
    const typename MergeElem<TI>::S* __restrict__ o, const float* __restrict__ lse,
    typename MergeElem<TO>::S* __restrict__ out, float* __restrict__ lse_out, int parts, int heads, int n, int d,
    i64 total, i64 so_p, i64 so_b, i64 so_h, i64 so_n, i64 so_d, i64 sl_p, i64 sl_b, i64 sl_h, i64 sl_n, i64 su_b,
    i64 su_h, i64 su_n, i64 su_d, i64 sv_b, i64 sv_h, i64 sv_n) {
    for (i64 idx = (i64)blockIdx.x * blockDim.x + threadIdx.x; idx < total; idx += (i64)gridDim.x * blockDim.x) {
        const int c = (int)(idx % d);
        i64 r = idx / d;
        const int s = (int)(r % n);
        r /= n;
        const int h = (int)(r % heads);
        const i64 b = r / heads;
        const float* lrow = lse + b * sl_b + h * sl_h + s * sl_n;
        A mx = -INFINITY;
        for (int i = 0; i < parts; ++i) mx = fmax(mx, (A)lrow[i * sl_p]);
        A acc = 0, sum = 0;
        if (mx != -INFINITY) {
            const typename MergeElem<TI>::S* ocol = o + b * so_b + h * so_h + s * so_n + c * so_d;
            for (int i = 0; i < parts; ++i) {
                const A l = (A)lrow[i * sl_p];
                if (l == -INFINITY) continue;  // saw no key: its o does not count (not even a NaN)
                const A w = merge_exp(l - mx);
                sum += w;
                acc += w * (A)MergeElem<TI>::load(ocol[i * so_p]);
            }
        }
        const bool seen = sum > 0;
        out[b * su_b + h * su_h + s * su_n + c * su_d] = MergeElem<TO>::store(seen ? (float)(acc / sum) : 0.0f);
        if (c == 0) lse_out[b * sv_b + h * sv_h + s * sv_n] = seen ? (float)(mx + merge_log(sum)) : -INFINITY;
    }
}
