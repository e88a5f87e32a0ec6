"""Decode's combine kernel launched as a programmatic dependent of the split kernel (pdl.launch)
vs an ordinary launch, next to cuDNN, on the peers' decode grid (GPU machine; timed like
benchmarks/peers.py, alternated A B A B in one process), plus each variant's host time per call.

    python3 tools/pdl_decode_probe.py out.json
Variants: api (the planner; PDL on), api-nopdl, and on the cells that split, combine / combine-nopdl
(the combine kernel forced instead of the cluster merge)."""
import json
import sys
import time

sys.path.insert(0, ".")
import cupy as cp  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

import cuflash  # noqa: E402
from benchmarks.peers import Timer  # noqa: E402
from cuflash import gpu_decode, pdl  # noqa: E402
from cuflash._problem import validate_forward  # noqa: E402

timer = Timer(warmup=3, repeats=30, seconds_per_impl=0.3)
from decode_cells import CELLS, decode_inputs  # noqa: E402  # the peers' decode grid (tools/, this script's folder)
out = []
for L, B, hkv in CELLS:
    hq, d = 32, 128
    q, k, v, nbytes = decode_inputs(L, B, hkv, hq, d)
    qc, kc, vc = (cp.from_dlpack(x) for x in (q, k, v))
    p = validate_forward(qc, kc, vc)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    lp = gpu_decode.launch_plan(p, sms, None, None, None, None, True)

    def call(use_pdl, **kw):
        pdl._ENABLED = use_pdl
        try:
            return cuflash.attention(qc, kc, vc, **kw) if not kw else _forced(**kw)
        finally:
            pdl._ENABLED = True

    def _forced(**kw):
        o = cp.empty_like(qc)
        lse = cp.empty((B, hq, 1), cp.float32)
        gpu_decode.forward(p, qc, kc, vc, o, lse, **kw)
        return o

    variants = {"api": (True, {}), "api-nopdl": (False, {})}
    if lp.splits > 1:
        variants["combine"] = (True, {"cluster": False})
        variants["combine-nopdl"] = (False, {"cluster": False})
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        ref = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    row = {"L": L, "B": B, "hkv": hkv, "plan": [lp.splits, bool(lp.cluster)], "ms": {}, "err": {}, "host_us": {}}
    for name, (u, kw) in variants.items():
        o = call(u, **kw)
        row["err"][name] = float(cp.abs(cp.asarray(o).astype(cp.float32) - cp.from_dlpack(ref).astype(cp.float32)).max())
    for rep in range(3):
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            ms, _ = timer(lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True))
        row["ms"].setdefault("cudnn", []).append(ms)
        for name, (u, kw) in variants.items():
            ms, _ = timer(lambda: call(u, **kw))
            row["ms"].setdefault(name, []).append(ms)
    for name, (u, kw) in variants.items():
        torch.cuda._sleep(50_000_000)
        t0 = time.perf_counter()
        for _ in range(50):
            call(u, **kw)
        row["host_us"][name] = (time.perf_counter() - t0) / 50 * 1e6
        torch.cuda.synchronize()
    c = sum(row["ms"]["cudnn"]) / 3
    print(f"DECODE L={L} B={B} hkv={hkv} plan={row['plan']} cudnn {nbytes / c / 1e9:.2f} TB/s "
          + " ".join(f"{n}: x{c / (sum(v) / 3):.3f} ({'/'.join(f'{c / x:.3f}' for x in v)}) host {row['host_us'][n]:.0f}us err {row['err'][n]:.2g}"
                     for n, v in row["ms"].items() if n != "cudnn"), flush=True)
    out.append(row)
json.dump(out, open(sys.argv[1], "w"), indent=1)
