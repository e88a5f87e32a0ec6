import cupy as cp, numpy as np
SRC = r"""
extern "C" __global__ void k8(const double* A, const double* B, double* D) {
    int lane = threadIdx.x, g = lane >> 2, t = lane & 3;
    double a0 = A[g * 8 + t], a1 = A[(g + 8) * 8 + t], a2 = A[g * 8 + t + 4], a3 = A[(g + 8) * 8 + t + 4];
    double b0 = B[t * 8 + g], b1 = B[(t + 4) * 8 + g];
    double c0 = 0, c1 = 0, c2 = 0, c3 = 0;
    asm volatile("mma.sync.aligned.m16n8k8.row.col.f64.f64.f64.f64 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                 : "+d"(c0), "+d"(c1), "+d"(c2), "+d"(c3) : "d"(a0), "d"(a1), "d"(a2), "d"(a3), "d"(b0), "d"(b1));
    D[g * 8 + 2 * t] = c0; D[g * 8 + 2 * t + 1] = c1; D[(g + 8) * 8 + 2 * t] = c2; D[(g + 8) * 8 + 2 * t + 1] = c3;
}
"""
m = cp.RawModule(code=SRC, options=("-arch=sm_90a",))
rng = np.random.default_rng(0)
A = rng.integers(-8, 8, (16, 8)).astype(np.float64); B = rng.integers(-8, 8, (8, 8)).astype(np.float64)
D = cp.zeros((16, 8), cp.float64)
m.get_function("k8")((1,), (32,), (cp.asarray(A), cp.asarray(B), D))
print("m16n8k8 f64 layout ok:", np.array_equal(D.get(), A @ B), np.abs(D.get() - A @ B).max())
