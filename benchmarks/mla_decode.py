"""MLA decoding (DeepSeek's latent cache: q and k 576 wide, v = k[..., :512]) on attn_decode_mla:
the cache read's TB/s and the TFLOP/s, beside the device's copy bandwidth and matmul rate measured
in the same process (torch has no MLA decode to time beside it). One query token, Hkv = 1, v a
view of k's first 512 columns, bfloat16.

    python benchmarks/mla_decode.py --out mla_decode.json   # on an sm_90 GPU with torch and CuPy
    python benchmarks/mla_decode.py --dry-run                # each cell's plan, anywhere

Rows as peers.py's ("op": "decode", "d": 576, "dv": 512): "tbps" counts the cache once (576 x 2
bytes per key: V is read from K's rows) plus q and o; "tflops" 2 x Hq x L x (576 + 512) per
sequence (Q K^T over 576 columns, P V over 512); "of_copy" is tbps over the copy rate. Timings are
peers.Timer's (CUDA events, L2 flushed before each repeat).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from types import SimpleNamespace

from bench_main import bench_arguments, dash, run_cases
from peers import DEVICE, Case, Timer, measure_ceilings, torch_stream_ptr

BATCHES = (1, 8, 64)
HEADS = (16, 128)
LENGTHS = (4096, 32768)
D, DV = 576, 512
DTYPE = "bfloat16"


@dataclass(frozen=True)
class MlaCase(Case):
    """peers.Case of one MLA decode cell (d is q's and k's head dim; v's is DV)."""

    def cache_bytes(self) -> int:
        """The cache read once, q read and o written (16-bit)."""
        return 2 * (self.b * self.hkv * self.nk * D + self.b * self.hq * self.nq * (D + DV))

    def mla_flops(self) -> float:
        return 2.0 * self.b * self.hq * self.nq * self.nk * (D + DV)


def plan():
    return [MlaCase("decode", DTYPE, D, b, h, 1, 1, n, False) for b in BATCHES for h in HEADS for n in LENGTHS]


def row(case: MlaCase, status: str, ms=None, ceilings=None, **extra) -> dict:
    r = {"op": "decode", "impl": "cuflash", "dtype": DTYPE, "d": D, "dv": DV, "b": case.b, "hq": case.hq,
         "hkv": case.hkv, "nq": case.nq, "nk": case.nk, "causal": False, "ms": ms, "tflops": None, "tbps": None,
         "of_copy": None, "status": status}
    if ms:
        r["tbps"] = case.cache_bytes() / (ms * 1e-3) / 1e12
        r["tflops"] = case.mla_flops() / (ms * 1e-3) / 1e12
        if ceilings and ceilings.get("copy_tbps"):
            r["of_copy"] = r["tbps"] / ceilings["copy_tbps"]
    r.update(extra)
    return r


class MlaDecode:
    def __init__(self, timer, ceilings):
        import cupy
        import torch

        import cuflash
        from cuflash.api.interop import external_stream

        self.torch, self.cupy, self.cuflash, self.timer, self.ceilings = torch, cupy, cuflash, timer, ceilings
        self._stream = lambda: external_stream(torch_stream_ptr(), cupy.cuda.Device().id)

    def cell(self, case: MlaCase, rows):
        torch, cp = self.torch, self.cupy
        torch.manual_seed(0)
        q = torch.randn(case.b, case.hq, 1, D, device=DEVICE, dtype=torch.bfloat16)
        cache = torch.randn(case.b, 1, case.nk, D, device=DEVICE, dtype=torch.bfloat16)
        with self._stream():
            qc, kc = cp.from_dlpack(q), cp.from_dlpack(cache)
            out = cp.empty((case.b, case.hq, 1, DV), dtype=qc.dtype)

        def run():
            with self._stream():
                return self.cuflash.attention(qc, kc, kc[..., :DV], scale=1 / 192 ** 0.5, out=out)
        run()
        ms, n = self.timer(run)
        rows.append(row(case, "ok", ms, self.ceilings, repeats=n))


def main(argv=None):
    args = bench_arguments(__doc__, seconds_per_impl=0.3).parse_args(argv)
    cases = plan()
    if args.dry_run:
        from cuflash.plan import decode_mla

        for c in cases:
            p = SimpleNamespace(batch=c.b, hq=c.hq, hkv=c.hkv, nq=c.nq, nk=c.nk, d=D, dv=DV, group=c.hq // c.hkv)
            pl = decode_mla.launch_plan(p, 132)
            print(f"B={c.b} Hq={c.hq} L={c.nk}: {pl.row_tiles} row tiles, {pl.row_blocks} row blocks, {pl.splits} splits of {pl.chunk} keys")
        return 0
    timer = Timer(3, 30, args.seconds_per_impl)
    ceilings = measure_ceilings(timer)
    runner = MlaDecode(timer, ceilings)
    doc = run_cases(cases, runner.cell, error_row=lambda case, reason: row(case, "error", reason=reason),
                    out=args.out, header={"ceilings": ceilings})
    print(f"copy {ceilings.get('copy_tbps', 0):.2f} TB/s, matmul {ceilings.get('matmul_tflops', 0):.0f} TFLOP/s")
    for r in doc["bench"]:
        print(f"MLA decode B={r['b']:2} Hq={r['hq']:3} L={r['nk']:5} ms={dash(r['ms'], '.4f'):>8} "
              f"TB/s={dash(r['tbps'], '.2f'):>5} of_copy={dash(r['of_copy'], '.3f'):>5} "
              f"TFLOP/s={dash(r['tflops'], '.0f'):>4} {r['status']} {r.get('reason', '')[:150]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
