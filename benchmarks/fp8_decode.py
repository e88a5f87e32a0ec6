"""An e4m3 (FP8) K/V cache against the bfloat16 cache: cuflash's split-KV decode with each, and
torch SDPA's cuDNN and FlashAttention backends on the bfloat16 cache, in one process on the same
shapes (one bf16 query token per head, d = 128), with the device's copy and read rates measured
in the same run.

    python benchmarks/fp8_decode.py --out fp8_decode.json     # on a GPU with torch and CuPy
    python benchmarks/fp8_decode.py --dry-run                  # the plan, anywhere

Rows are peers.py's; an e4m3 row has "dtype": "float8_e4m3fn" and counts the cache's bytes at one
byte per element (q and o two), "vs_copy" is its rate over the measured copy rate, "vs_bf16" the
bfloat16 cache's cuflash time over its own, and "max_abs_diff_vs_bf16" how far its output is from
the bfloat16 cache's (the cache's quantization error, per-(sequence, head) scales).
"""

from __future__ import annotations

import sys

from bench_main import bench_arguments, dash, failure_reason, ratio_column, run_cases
from peers import DEVICE, Case, Timer, measure_ceilings, quantize_e4m3, record, torch_stream_ptr

SHAPES = ((8, 32, 8, 16384), (8, 32, 8, 65536), (64, 32, 8, 16384), (8, 32, 32, 16384), (1, 32, 8, 131072))
D = 128


def plan(shapes=SHAPES):
    return [Case("decode", dtype, D, b, hq, hkv, 1, n, False) for b, hq, hkv, n in shapes
            for dtype in ("bfloat16", "float8_e4m3fn")]


class Fp8Decode:
    def __init__(self, timer):
        import cupy
        import torch

        import cuflash
        from cuflash.api.interop import external_stream
        from cuflash.core.arrays import widen_to_float32

        self.torch, self.cupy, self.cuflash, self.timer = torch, cupy, cuflash, timer
        self.widen = widen_to_float32
        self._stream = lambda: external_stream(torch_stream_ptr(), cupy.cuda.Device().id)

    def cell(self, case, rows, bf16_out):
        torch, cp = self.torch, self.cupy
        torch.manual_seed(0)
        q = torch.randn(case.b, case.hq, 1, case.d, device=DEVICE, dtype=torch.bfloat16)
        k, v = (torch.randn(case.b, case.hkv, case.nk, case.d, device=DEVICE, dtype=torch.bfloat16) for _ in "kv")
        with self._stream():
            qc, kc, vc = (cp.from_dlpack(t) for t in (q, k, v))
        extra = {}
        if case.dtype == "bfloat16":
            fn = lambda: self.cuflash.attention(qc, kc, vc)  # noqa: E731
        else:
            (k8, kd), (v8, vd) = self._quantized(k), self._quantized(v)
            del k, v, kc, vc  # (the e4m3 cell times its own cache only)
            fn = lambda: self.cuflash.attention(qc, k8, v8, k_descale=kd, v_descale=vd)  # noqa: E731
        with self._stream():
            o = fn()
        key = (case.b, case.hq, case.hkv, case.nk)
        if case.dtype == "bfloat16":
            bf16_out[key] = o
        elif key in bf16_out:
            diff = cp.abs(self.widen(o) - self.widen(bf16_out[key])).max()
            extra["max_abs_diff_vs_bf16"] = float(diff)

        def timed():
            with self._stream():
                return fn()
        ms, _ = self.timer(timed)
        rows.append(record(case, "cuflash", "ok", ms, **extra))
        if case.dtype != "bfloat16":
            return
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend, sdpa_kernel

        for impl, backend in (("torch-cudnn", SDPBackend.CUDNN_ATTENTION), ("torch-flash", SDPBackend.FLASH_ATTENTION)):
            def run():
                with sdpa_kernel([backend]):
                    return F.scaled_dot_product_attention(q, k, v, enable_gqa=case.hq != case.hkv)
            try:
                run()
                ms, _ = self.timer(run)
                rows.append(record(case, impl, "ok", ms))
            except Exception as exc:  # noqa: BLE001 - a peer that fails is a row, not a crash
                rows.append(record(case, impl, "error", reason=failure_reason(exc)))

    def _quantized(self, t):
        """t (B, H, L, d) bfloat16 as e4m3 bits (CuPy uint8: the form CuPy holds; the descales mark
        them) and its per-(sequence, head) descales, on the device (peers.quantize_e4m3)."""
        x8, descale = quantize_e4m3(t)
        with self._stream():
            return self.cupy.from_dlpack(x8.view(self.torch.uint8)), self.cupy.from_dlpack(descale.contiguous())


def add_ratios(rows, copy_tbps):
    """vs_copy: the row's rate over the copy rate; vs_bf16 (cuflash rows): cuflash's time on the
    bfloat16 cache of the same shape over the row's."""
    for r in rows:
        r["vs_copy"] = r["tbps"] / copy_tbps if r.get("tbps") else None
    ratio_column(rows, "vs_bf16", lambda r: (r["b"], r["hq"], r["hkv"], r["nk"]),
                 lambda r: r["impl"] == "cuflash" and r["dtype"] == "bfloat16",
                 applies=lambda r: r["impl"] == "cuflash")


def main(argv=None):
    args = bench_arguments(__doc__, seconds_per_impl=0.5).parse_args(argv)
    cases = plan()
    if args.dry_run:
        for c in cases:
            print(c.label)
        return 0
    timer = Timer(3, 30, args.seconds_per_impl)
    ceilings = measure_ceilings(timer)
    runner = Fp8Decode(timer)
    bf16_out = {}  # the bfloat16 cell's output, for the e4m3 cell of the same shape that follows it

    def run_case(case, rows):
        try:
            runner.cell(case, rows, bf16_out)
        finally:
            if case.dtype != "bfloat16":
                bf16_out.clear()

    doc = run_cases(cases, run_case, error_row=lambda case, reason: record(case, "cuflash", "error", reason=reason),
                    out=args.out, header={"ceilings": ceilings},
                    derive=lambda rows: add_ratios(rows, ceilings["copy_tbps"]))
    print(f"copy {ceilings['copy_tbps']:.2f} TB/s, read {ceilings['read_tbps']:.2f} TB/s")
    for r in doc["bench"]:
        print(f"{r['impl']:11} {r['dtype']:13} B={r['b']:3} Hq={r['hq']} Hkv={r['hkv']:2} L={r['nk']:6} "
              f"ms={dash(r['ms'], '.4f'):>8} TB/s={dash(r.get('tbps'), '.2f')} vs_copy={dash(r.get('vs_copy'), '.2f')} "
              f"vs_bf16={dash(r.get('vs_bf16'), '.2f')} diff={r.get('max_abs_diff_vs_bf16', '-')} {r['status']} "
              f"{r.get('reason', '')[:150]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
