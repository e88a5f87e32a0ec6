"""Paged vs contiguous KV cache for cuflash's decode on the peers' decode grid (GPU machine):
same keys, pages shuffled; timed like benchmarks/peers.py.   python tools/paged_bench.py out.json"""
import json
import sys

sys.path.insert(0, ".")
import cupy as cp

import cuflash
from benchmarks.benchmarks.bench_attention import shuffled_pages
from benchmarks.peers import Timer

timer = Timer(warmup=3, repeats=30, seconds_per_impl=0.3)
rows = []
for L in (4096, 16384, 65536):
    for B, hkv in ((8, 8), (64, 8), (8, 32)):
        hq, d = 32, 128
        rs = cp.random.RandomState(L + B + hkv)
        q = rs.standard_normal((B, hq, 1, d), dtype=cp.float32).astype(cp.float16)
        k = rs.standard_normal((B, hkv, L, d), dtype=cp.float32).astype(cp.float16)
        v = rs.standard_normal((B, hkv, L, d), dtype=cp.float32).astype(cp.float16)
        nbytes = 2 * B * hkv * L * d * 2 + 2 * B * hq * d * 2
        row = {"L": L, "B": B, "hkv": hkv}
        ms, _ = timer(lambda: cuflash.attention(q, k, v))
        row["contiguous_ms"] = ms
        ref = cuflash.attention(q, k, v)
        for bs in (16, 64, 256):
            kc, vc, table = shuffled_pages(cp, k, v, bs, seed=bs)
            f = lambda: cuflash.attention(q, kc, vc, block_table=table, validate=False)
            err = float(cp.abs(f().astype(cp.float32) - ref.astype(cp.float32)).max())
            ms, _ = timer(f)
            row[f"paged{bs}_ms"] = ms
            row[f"paged{bs}_vs_contiguous"] = row["contiguous_ms"] / ms
            row[f"paged{bs}_maxdiff"] = err
            del kc, vc
        row["contiguous_tbps"] = nbytes / row["contiguous_ms"] / 1e9
        print("PAGED", L, B, hkv, " ".join(f"{k_}={v_:.3g}" for k_, v_ in row.items() if k_.endswith(("vs_contiguous", "tbps", "maxdiff"))), flush=True)
        rows.append(row)
        del q, k, v
json.dump(rows, open(sys.argv[1], "w"), indent=1)
