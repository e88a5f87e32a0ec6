"""Where a backward's time goes, block by block (GPU machine): the K/V kernel compiled with
-DCUFLASH_BWD_TRACE records each block's start and end (%globaltimer), SM and steps; this runs
one backward per cell and summarizes.

    python3 tools/bwd_trace.py out.json [d,n,causal ...]     (default: 64,4096,1 64,4096,0 128,4096,1)

Per cell: the kernel's span; the mean time per step of the blocks by step count (a linear fit
t = a + b * steps over full-length and over short blocks: b is the step, a the block's fixed
cost); the SMs' idle time between blocks and after their last block (the grid's tail); the
last 2% of blocks to end."""
import json
import os
import sys

BLOCKS = 1 << 16
os.environ["CUFLASH_NVRTC_OPTIONS"] = (os.environ.get("CUFLASH_NVRTC_OPTIONS", "") + f" -DCUFLASH_BWD_TRACE={BLOCKS}").strip()
sys.path.insert(0, ".")
import cupy as cp  # noqa: E402
import numpy as np  # noqa: E402

import cuflash  # noqa: E402
from cuflash import _build, gpu_hopper  # noqa: E402

cells = [tuple(int(x) for x in a.split(",")) for a in sys.argv[2:]] or [(64, 4096, 1), (64, 4096, 0), (128, 4096, 1)]
out = []
for d, n, causal in cells:
    h, b = 2048 // d, 16384 // n
    rs = cp.random.RandomState(0)
    q, k, v, do = (rs.standard_normal((b, h, n, d), dtype=cp.float32).astype(cp.float16) for _ in range(4))
    o, lse = cuflash.attention(q, k, v, causal=bool(causal), return_lse=True)
    cuflash.attention_backward(do, q, k, v, o, lse, causal=bool(causal))  # compiles everything
    spec = gpu_hopper.backward_kv_spec(np.dtype(np.float16), d, bool(causal), False)[0]
    trace = cp.ndarray((BLOCKS, 4), cp.uint64, _build.get_module(spec).get_global("cuflash_bwd_trace"))
    trace.fill(0)
    cp.cuda.Device().synchronize()
    cuflash.attention_backward(do, q, k, v, o, lse, causal=bool(causal))
    cp.cuda.Device().synchronize()
    t = cp.asnumpy(trace)
    t = t[t[:, 1] > 0].astype(np.float64)
    if not len(t):
        print("CELL", d, n, causal, "no trace: is", spec.expression, "the kernel that ran?", flush=True)
        continue
    t0 = t[:, 0].min()
    start, end, sm, steps = (t[:, 0] - t0) / 1e3, (t[:, 1] - t0) / 1e3, t[:, 2].astype(int), t[:, 3].astype(int)
    dur, span = end - start, end.max()
    row = {"d": d, "n": n, "causal": causal, "kernel": spec.expression, "blocks": len(t), "span_us": span}
    # block cost against its steps: a (fixed) + b (per step), fitted over all blocks
    A = np.stack([np.ones_like(dur), steps], 1)
    (a, bstep), *_ = np.linalg.lstsq(A, dur, rcond=None)
    row["fit_fixed_us"], row["fit_step_us"] = a, bstep
    by = {}
    for s_ in np.unique(steps):
        sel = steps == s_
        by[int(s_)] = {"blocks": int(sel.sum()), "mean_us": float(dur[sel].mean()), "per_step_us": float(dur[sel].mean() / max(s_, 1))}
    row["by_steps"] = by
    idle_between, idle_after = 0.0, 0.0
    for s_ in np.unique(sm):
        sel = np.argsort(start[sm == s_])
        st, en = start[sm == s_][sel], end[sm == s_][sel]
        idle_between += float(np.clip(st[1:] - en[:-1], 0, None).sum()) + float(st[0])
        idle_after += float(span - en.max())
    n_sm = len(np.unique(sm))
    row["sms"] = n_sm
    row["idle_between_blocks_pct"] = 100 * idle_between / (n_sm * span)
    row["idle_after_last_block_pct"] = 100 * idle_after / (n_sm * span)
    last = np.argsort(end)[-max(1, len(end) // 50):]
    row["last_2pct_blocks"] = {"first_end_us": float(end[last].min()), "steps_mean": float(steps[last].mean())}
    print("CELL", d, n, causal, f"span {span:.0f} us, {len(t)} blocks on {n_sm} SMs; fit {a:.2f} us + {bstep:.3f} us/step; "
          f"idle between blocks {row['idle_between_blocks_pct']:.1f}%, after last {row['idle_after_last_block_pct']:.1f}%", flush=True)
    for s_ in sorted(by)[:3] + sorted(by)[-3:]:
        print("   steps", s_, by[s_], flush=True)
    out.append(row)
json.dump(out, open(sys.argv[1], "w"), indent=1)
