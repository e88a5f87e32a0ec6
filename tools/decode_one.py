"""One decode call at a peers' grid cell, for ncu: python3 tools/decode_one.py L B Hkv"""
import sys

import cupy as cp

import cuflash

L, B, hkv = (int(a) for a in sys.argv[1:4])
rs = cp.random.RandomState(0)
q = rs.standard_normal((B, 32, 1, 128), dtype=cp.float32).astype(cp.float16)
k, v = (rs.standard_normal((B, hkv, L, 128), dtype=cp.float32).astype(cp.float16) for _ in range(2))
for _ in range(2):
    cuflash.attention(q, k, v)
cp.cuda.Device().synchronize()
