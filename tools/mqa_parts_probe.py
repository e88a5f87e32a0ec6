"""Where the time of MQA decode with few sequences goes, per launch variant (GPU machine): the GPU
timeline (tools/bwd_parts_probe.timeline: CUPTI, queued behind a spin) of gpu_decode.forward with
forced tiles / split counts / merges, after a check against cuDNN's output. At B=1 Hq=64 Hkv=1
L=32k d=128 (the table's one-row-tile blocks, 64 splits) the split kernel took 15.0 us and the
combine ended 2.8 us later, where FA2's split kernel took 8.7 us and cuDNN's whole call 16.8.

    python3 tools/mqa_parts_probe.py [B,Hq,L ...]    (Hkv=1, d=128, bf16)
"""
import sys

sys.path.insert(0, ".")
import cupy as cp  # noqa: E402

from bwd_parts_probe import timeline  # noqa: E402
from decode_cells import ProbeCase  # noqa: E402

from cuflash import gpu_decode, plan_cache, schedule  # noqa: E402

plan_cache.enabled = False


def main(cells):
    sms = gpu_decode._sm_count(0)
    for cell in cells:
        b, hq, n = (int(x) for x in cell.split(","))
        case = ProbeCase(n, b, 1, hq, 128, 1)
        wide, long = schedule.DECODE_TILES_WIDE_ROWS[128], schedule.DECODE_TILES_WIDE_ROWS_LONG[128]
        variants = {"planner": {}}
        for s in (2 * sms // b, sms // b, sms // (2 * b), sms // (4 * b)):
            variants[f"wide s{s}"] = dict(tile=wide, splits=s)
            variants[f"wide s{s} last"] = dict(tile=wide, splits=s, merge="last")
        for s in (sms // b, sms // (2 * b)):
            variants[f"ring4 s{s}"] = dict(tile=long, splits=s)
        for name, kw in variants.items():
            try:
                lp = gpu_decode.launch_plan(case.p, sms, **{k: v for k, v in kw.items() if k != "merge"})
                case.o4.fill(float("nan"))
                gpu_decode.forward(case.p, case.qc, case.kc, case.vc, case.o4, case.lse3, **kw)
                err = float(cp.abs(case.o4.astype(cp.float32) - case.ref).max())
            except Exception as e:  # noqa: BLE001
                print(f"== {name} B={b} Hq={hq} L={n}: {e!r}"[:200])
                continue
            label = f"{name} B={b} Hq={hq} L={n} [{lp.splits}x{lp.chunk} rt{lp.row_tiles} ring{lp.tile.ring}] err {err:.3g}"
            timeline(lambda kw=kw: gpu_decode.forward(case.p, case.qc, case.kc, case.vc, case.o4, case.lse3, **kw),
                     label)
        case = None


if __name__ == "__main__":
    main(sys.argv[1:] or ["1,64,32768", "2,64,16384", "1,64,8192"])
