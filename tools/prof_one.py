"""One forward and one backward launch at a benchmark shape, for ncu: python3 tools/prof_one.py d n causal"""
import sys

import cupy as cp

import cuflash

d, n, causal = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "1"
h, b = 2048 // d, 16384 // n
rs = cp.random.RandomState(0)
q, k, v, do = (rs.standard_normal((b, h, n, d), dtype=cp.float32).astype(cp.float16) for _ in range(4))
o, lse = cuflash.attention(q, k, v, causal=causal, return_lse=True)
cuflash.attention_backward(do, q, k, v, o, lse, causal=causal)
cp.cuda.Device().synchronize()
