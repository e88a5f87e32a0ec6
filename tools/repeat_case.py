"""Rerun one forward accuracy case of tests/test_gpu_forward.py under many seeds (GPU machine), to
tell a rare failure from a systematic one and print the seeds and messages of those that fail:

    python3 tools/repeat_case.py N dtype nq nk d causal [kernels]      e.g. 300 f32 1 239 96 top_left mma_sync
"""
import os
import sys

import numpy as np

sys.path.insert(0, ".")
sys.path.insert(0, "tests")
n, dt, nq, nk, d, causal = sys.argv[1:7]
os.environ["CUFLASH_KERNELS"] = sys.argv[7] if len(sys.argv) > 7 else "auto"
import test_gpu_forward as t  # noqa: E402

dtype = {"f16": t.FLOAT16, "bf16": t.BFLOAT16, "f32": t.FLOAT32}[dt]
causal = {"full": False}.get(causal, causal)
fails = 0
for seed in range(int(n)):
    try:
        t.run_and_check(np.random.default_rng(seed), dtype, (1,), 2, 1, int(nq), int(nk), int(d), causal=causal)
    except AssertionError as e:
        fails += 1
        print("FAIL seed", seed, str(e).splitlines()[0][:300], flush=True)
print(f"{fails} of {n} seeds failed", flush=True)
