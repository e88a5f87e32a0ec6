"""Float64 throughput probe on the GPU: DFMA chains vs mma.sync f64 shapes (m8n8k4, and the
sm_90 m16n8k4 / m16n8k8 / m16n8k16), each warp running 8 independent accumulators; prints
TFLOP/s (2 flops per multiply-add). python3 tools/fp64_peak.py"""
import cupy as cp

SRC = r"""
extern "C" __global__ void dfma(double* out, int iters) {
    double a[8]; double x = threadIdx.x * 1e-9, y = 1.0000001;
    for (int i = 0; i < 8; ++i) a[i] = i;
    for (int it = 0; it < iters; ++it)
        #pragma unroll
        for (int i = 0; i < 8; ++i) a[i] = fma(a[i], y, x);
    double s = 0; for (int i = 0; i < 8; ++i) s += a[i];
    out[blockIdx.x * blockDim.x + threadIdx.x] = s;
}
extern "C" __global__ void mma884(double* out, int iters) {
    double a = threadIdx.x * 1e-3, b = 1.0 + threadIdx.x * 1e-9;
    double c[8][2];
    for (int i = 0; i < 8; ++i) c[i][0] = c[i][1] = 0;
    for (int it = 0; it < iters; ++it)
        #pragma unroll
        for (int i = 0; i < 8; ++i)
            asm volatile("mma.sync.aligned.m8n8k4.row.col.f64.f64.f64.f64 {%0,%1}, {%2}, {%3}, {%0,%1};"
                         : "+d"(c[i][0]), "+d"(c[i][1]) : "d"(a), "d"(b));
    double s = 0; for (int i = 0; i < 8; ++i) s += c[i][0] + c[i][1];
    out[blockIdx.x * blockDim.x + threadIdx.x] = s;
}
extern "C" __global__ void mma1684(double* out, int iters) {
    double a0 = threadIdx.x * 1e-3, a1 = a0 + 1, b = 1.0 + threadIdx.x * 1e-9;
    double c[8][4];
    for (int i = 0; i < 8; ++i) c[i][0] = c[i][1] = c[i][2] = c[i][3] = 0;
    for (int it = 0; it < iters; ++it)
        #pragma unroll
        for (int i = 0; i < 8; ++i)
            asm volatile("mma.sync.aligned.m16n8k4.row.col.f64.f64.f64.f64 {%0,%1,%2,%3}, {%4,%5}, {%6}, {%0,%1,%2,%3};"
                         : "+d"(c[i][0]), "+d"(c[i][1]), "+d"(c[i][2]), "+d"(c[i][3]) : "d"(a0), "d"(a1), "d"(b));
    double s = 0; for (int i = 0; i < 8; ++i) s += c[i][0] + c[i][1] + c[i][2] + c[i][3];
    out[blockIdx.x * blockDim.x + threadIdx.x] = s;
}
extern "C" __global__ void mma1688(double* out, int iters) {
    double a[4], b[2];
    for (int i = 0; i < 4; ++i) a[i] = threadIdx.x * 1e-3 + i;
    b[0] = 1.0; b[1] = 0.5;
    double c[8][4];
    for (int i = 0; i < 8; ++i) c[i][0] = c[i][1] = c[i][2] = c[i][3] = 0;
    for (int it = 0; it < iters; ++it)
        #pragma unroll
        for (int i = 0; i < 8; ++i)
            asm volatile("mma.sync.aligned.m16n8k8.row.col.f64.f64.f64.f64 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                         : "+d"(c[i][0]), "+d"(c[i][1]), "+d"(c[i][2]), "+d"(c[i][3])
                         : "d"(a[0]), "d"(a[1]), "d"(a[2]), "d"(a[3]), "d"(b[0]), "d"(b[1]));
    double s = 0; for (int i = 0; i < 8; ++i) s += c[i][0] + c[i][1] + c[i][2] + c[i][3];
    out[blockIdx.x * blockDim.x + threadIdx.x] = s;
}
extern "C" __global__ void mma16816(double* out, int iters) {
    double a[8], b[4];
    for (int i = 0; i < 8; ++i) a[i] = threadIdx.x * 1e-3 + i;
    for (int i = 0; i < 4; ++i) b[i] = 1.0 / (i + 1);
    double c[4][4];
    for (int i = 0; i < 4; ++i) c[i][0] = c[i][1] = c[i][2] = c[i][3] = 0;
    for (int it = 0; it < iters; ++it)
        #pragma unroll
        for (int i = 0; i < 4; ++i)
            asm volatile("mma.sync.aligned.m16n8k16.row.col.f64.f64.f64.f64 {%0,%1,%2,%3}, {%4,%5,%6,%7,%8,%9,%10,%11}, {%12,%13,%14,%15}, {%0,%1,%2,%3};"
                         : "+d"(c[i][0]), "+d"(c[i][1]), "+d"(c[i][2]), "+d"(c[i][3])
                         : "d"(a[0]), "d"(a[1]), "d"(a[2]), "d"(a[3]), "d"(a[4]), "d"(a[5]), "d"(a[6]), "d"(a[7]),
                           "d"(b[0]), "d"(b[1]), "d"(b[2]), "d"(b[3]));
    double s = 0; for (int i = 0; i < 4; ++i) s += c[i][0] + c[i][1] + c[i][2] + c[i][3];
    out[blockIdx.x * blockDim.x + threadIdx.x] = s;
}
"""
mod = cp.RawModule(code=SRC, options=("-arch=sm_90a",))
sms = cp.cuda.Device().attributes["MultiProcessorCount"]
out = cp.empty(sms * 8 * 256, cp.float64)
# (name, multiply-adds per warp per inner iteration: mma shape m*n*k x accumulators, or 32 lanes x 8 DFMA)
for name, fma_per_iter in (("dfma", 32 * 8), ("mma884", 8 * 8 * 4 * 8), ("mma1684", 16 * 8 * 4 * 8),
                           ("mma1688", 16 * 8 * 8 * 8), ("mma16816", 16 * 8 * 16 * 4)):
    fn = mod.get_function(name)
    iters = 2000
    for threads, blocks_per_sm in ((256, 4),):
        grid = sms * blocks_per_sm
        fn((grid,), (threads,), (out, cp.int32(50)))
        s, e = cp.cuda.Event(), cp.cuda.Event()
        s.record()
        fn((grid,), (threads,), (out, cp.int32(iters)))
        e.record()
        e.synchronize()
        ms = cp.cuda.get_elapsed_time(s, e)
        warps = grid * threads // 32
        tflops = 2.0 * fma_per_iter * iters * warps / (ms * 1e-3) / 1e12
        print(f"{name:9s} {grid} x {threads}: {ms:.2f} ms {tflops:.1f} TFLOP/s")
