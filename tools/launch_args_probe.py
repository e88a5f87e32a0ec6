"""Host cost of a CuPy RawKernel launch by argument list (GPU machine): the decode kernel's 9
pointers and 24 scalars passed one by one, against the same scalars packed in one by-value struct
(a one-element NumPy structured array, or its 0-d element).

    python3 tools/launch_args_probe.py
"""
import time, numpy as np, cupy as cp, torch
src = r'''
struct P { long long a[13]; int b[8]; float s; int lo, hi; };
extern "C" __global__ void many(const void* q, const void* k, const void* v, void* o, float* lse, float* po, float* pl,
  const int* lens, const int* table, long long bt, int ps, long long a1, long long a2, long long a3, long long a4, long long a5,
  long long a6, long long a7, long long a8, long long a9, long long a10, long long a11, long long a12, int b1, int b2, int b3,
  int b4, int b5, int b6, int b7, int b8, float s, int lo, int hi) { if (threadIdx.x == 1024) ((int*)o)[0] = b1 + lo; }
extern "C" __global__ void one(const void* q, const void* k, const void* v, void* o, float* lse, float* po, float* pl,
  const int* lens, const int* table, const P p) { if (threadIdx.x == 1024) ((int*)o)[0] = p.b[0] + p.lo; }
'''
m = cp.RawModule(code=src)
many, one = m.get_function("many"), m.get_function("one")
x = cp.zeros(16, cp.float32)
scal = (np.int64(1), np.int32(2)) + tuple(np.int64(i) for i in range(11)) + tuple(np.int32(i) for i in range(8)) + (np.float32(1.0), np.int32(0), np.int32(0))
assert len(scal) == 24
dt = np.dtype({"names": ["a", "b", "s", "lo", "hi"], "formats": [("<i8", 13), ("<i4", 8), "<f4", "<i4", "<i4"],
               "offsets": [0, 104, 136, 140, 144], "itemsize": 152})
pk = np.zeros(1, dtype=dt)
ptrs = (x, x, x, x, x, x, x, np.uint64(0), np.uint64(0))
def t(fn, calls=3000):
    fn(); torch.cuda.synchronize(); torch.cuda._sleep(int(calls * 1.9e3 * 2))
    t0 = time.perf_counter()
    for _ in range(calls): fn()
    t1 = time.perf_counter(); torch.cuda.synchronize(); return (t1 - t0) / calls * 1e6
print("35 args  %.1f us" % t(lambda: many((4, 8, 8), (128,), ptrs + scal)))
print("struct   %.1f us" % t(lambda: one((4, 8, 8), (128,), ptrs + (pk,))))
print("struct0d %.1f us" % t(lambda: one((4, 8, 8), (128,), ptrs + (pk[0],))))
