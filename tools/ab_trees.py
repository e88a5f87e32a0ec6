"""Two package trees in one process on one GPU: each cell's call through this checkout's cuflash and
through a baseline tree's, alternating over rounds (the order flipped every round), timed by
benchmarks/peers.py's Timer (CUDA events, L2 flushed, the launch hidden behind a GPU spin). A kernel
change's A/B: between separate processes or starts of the machine, times move by more than many
changes do (docs/performance.md#history); tools/compare_trees.sh is the grid-wide, two-process check.

    git archive <base> cuflash cuda_src | tar -x -C .abbase                         # build machine
    PYTHONPATH=. python3 tools/ab_trees.py --base .abbase --cells fwd,mods --out ab.json   # on a GPU
    PYTHONPATH=. python3 tools/ab_trees.py --base .abbase --cells mods --warm 14 --out ab.json  # compiles first, 14 processes
    python3 tools/ab_trees.py --dry-run --cells all                                  # anywhere

Cell sets (--cells, a comma list): fwd (bf16, d = 64/128/256, N = 4k/16k, causal and not), bwd (bf16,
d = 64/128, the same), mods (softcap, ALiBi and sinks beside the plain forward, bf16, d = 128,
N = 1k-16k, causal and not), fp8 (e4m3 forward, d = 128/256, N = 8k/16k, causal and not), decode (one
query token per sequence over a bf16 cache and an e4m3 one, d = 128: B x Hq/Hkv x L of 8 x 32/8 x 16k
and 64k, 1 x 32/8 x 128k, MQA 1 x 64/1 x 32k). Every prefill shape keeps B·N = 16k tokens and 16
heads (8 at d = 256). "ratio" is the baseline's median time
over this checkout's (> 1: this checkout is faster); a cell whose kernels are the same in both
trees is the run's control. "max_abs_diff" is the largest difference of the two trees' outputs
(the first output: o, or dq). Importable without a GPU: torch and CuPy load in the device path.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SETS = ("fwd", "bwd", "mods", "fp8", "decode")
DECODE_SHAPES = ((8, 32, 8, 16384), (8, 32, 8, 65536), (1, 32, 8, 131072), (1, 64, 1, 32768))  # B, Hq, Hkv, L
SOFTCAP = 30.0  # Gemma-2's attention cap, as benchmarks/options.py


@dataclasses.dataclass(frozen=True)
class Cell:
    set: str
    op: str  # fwd | bwd
    dtype: str  # bfloat16 | float8_e4m3fn
    d: int
    b: int
    h: int
    n: int
    causal: bool
    option: str = "none"  # none | softcap | alibi | sinks
    hkv: int = 0  # decode: K/V heads (h: query heads)

    @property
    def label(self) -> str:
        mask = "causal" if self.causal else "full"
        if self.op == "decode":
            cache = "e4m3" if self.dtype == "float8_e4m3fn" else "bf16"
            return f"decode {cache} cache d={self.d} {self.b}x{self.h}/{self.hkv}x{self.n}"
        return f"{self.set:4s} {self.op} {self.option:7s} {self.dtype[:5]} d={self.d} {self.b}x{self.h}x{self.n} {mask}"

    @property
    def flops(self) -> float:
        """The peers' convention: 4 N^2 d per head, halved when causal, the backward 2.5x."""
        nq = 1 if self.op == "decode" else self.n
        f = 4.0 * nq * self.n * self.d * self.b * self.h / (2 if self.causal else 1)
        return f * (2.5 if self.op == "bwd" else 1.0)


def _shape(d: int, n: int) -> tuple[int, int]:
    return 16384 // n, 8 if d == 256 else 16


def cells(sets) -> list[Cell]:
    out = []
    for s in sets:
        if s in ("fwd", "bwd"):
            for d in ((64, 128, 256) if s == "fwd" else (64, 128)):
                for n in (4096, 16384):
                    out += [Cell(s, s, "bfloat16", d, *_shape(d, n), n, c) for c in (False, True)]
        elif s == "mods":
            for n in (1024, 2048, 4096, 16384):
                out += [Cell(s, "fwd", "bfloat16", 128, *_shape(128, n), n, c, o)
                        for c in (False, True) for o in ("none", "softcap", "alibi", "sinks")]
        elif s == "fp8":
            out += [Cell(s, "fwd", "float8_e4m3fn", d, *_shape(d, n), n, c)
                    for d in (128, 256) for n in (8192, 16384) for c in (False, True)]
        elif s == "decode":
            out += [Cell(s, "decode", dt, 128, b, hq, n, False, hkv=hkv)
                    for b, hq, hkv, n in DECODE_SHAPES for dt in ("bfloat16", "float8_e4m3fn")]
        else:
            raise ValueError(f"--cells: {s!r} is none of {', '.join(SETS)}")
    return out


def load_tree(root: Path, name: str):
    """The cuflash package under `root` imported as module `name` (cuflash imports itself by relative
    imports only, and finds cuda_src/ beside its own directory), so two trees share a process."""
    init = Path(root) / "cuflash" / "__init__.py"
    if not init.is_file():
        raise FileNotFoundError(f"--base: {init} does not exist")
    spec = importlib.util.spec_from_file_location(name, init, submodule_search_locations=[str(init.parent)])
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


class Runner:
    """The device path: one call per (cell, tree) on fresh inputs shared by both trees."""

    def __init__(self, rounds: int, repeats: int):
        sys.path.insert(0, str(ROOT / "benchmarks"))
        import torch
        from peers import Timer

        self.torch = torch
        self.rounds = rounds
        self.timer = Timer(2, repeats, 0.5)

    def calls(self, cell: Cell, trees):
        """One argument-free call per tree on the same inputs."""
        torch = self.torch
        torch.manual_seed(0)
        shape = (cell.b, cell.h, cell.n, cell.d)
        if cell.op == "decode":  # a bf16 q over a bf16 cache, or an e4m3 one with unit descales
            q = torch.randn((cell.b, cell.h, 1, cell.d), device="cuda", dtype=torch.bfloat16)
            k, v = (torch.randn((cell.b, cell.hkv, cell.n, cell.d), device="cuda", dtype=torch.bfloat16)
                    for _ in "kv")
            if cell.dtype == "float8_e4m3fn":
                k, v = (x.to(torch.float8_e4m3fn) for x in (k, v))
                one = torch.ones((), device="cuda", dtype=torch.float32)
                return [lambda m=m: m.attention(q, k, v, k_descale=one, v_descale=one) for m in trees]
            return [lambda m=m: m.attention(q, k, v) for m in trees]
        if cell.dtype == "float8_e4m3fn":
            q, k, v = (torch.randn(shape, device="cuda").mul(0.5).to(torch.float8_e4m3fn) for _ in "qkv")
            one = torch.ones((cell.b, cell.h), device="cuda", dtype=torch.float32)
            return [lambda m=m: m.attention(q, k, v, causal=cell.causal, q_descale=one, k_descale=one, v_descale=one)
                    for m in trees]
        q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in "qkv")
        mods = {}
        if cell.option == "softcap":
            mods = dict(softcap=SOFTCAP)
        elif cell.option == "alibi":
            mods = dict(alibi_slopes=torch.tensor([2.0 ** (-8.0 * (i + 1) / cell.h) for i in range(cell.h)],
                                                  device="cuda", dtype=torch.float32))
        elif cell.option == "sinks":
            mods = dict(sinks=torch.randn(cell.h, device="cuda", dtype=torch.float32))
        if cell.op == "fwd":
            return [lambda m=m: m.attention(q, k, v, causal=cell.causal, **mods) for m in trees]
        o, lse = trees[0].attention(q, k, v, causal=cell.causal, return_lse=True, **mods)
        do = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
        return [lambda m=m: m.attention_backward(do, q, k, v, o, lse, causal=cell.causal, **mods) for m in trees]

    def run(self, cell: Cell, trees) -> dict:
        new_fn, base_fn = self.calls(cell, trees)
        outs = [fn() for fn in (new_fn, base_fn)]
        first = [o[0] if isinstance(o, tuple) else o for o in outs]
        diff = (first[0].float() - first[1].float()).abs().max().item()
        new_ms, base_ms = [], []
        for r in range(self.rounds):
            order = ((new_fn, new_ms), (base_fn, base_ms))
            for fn, acc in (order if r % 2 == 0 else order[::-1]):
                acc.append(self.timer(fn)[0])
        nm, bm = statistics.median(new_ms), statistics.median(base_ms)
        del outs, first, new_fn, base_fn
        self.torch.cuda.empty_cache()
        return dict(dataclasses.asdict(cell), label=cell.label, new_ms=new_ms, base_ms=base_ms, ratio=bm / nm,
                    new_tflops=cell.flops / nm / 1e9, base_tflops=cell.flops / bm / 1e9, max_abs_diff=diff)


def summary(rows) -> str:
    lines = [f"{'cell':58s} {'base ms':>9s} {'new ms':>9s} {'ratio':>7s} {'new TF':>7s} {'diff':>9s}"]
    for r in rows:
        lines.append(f"{r['label']:58s} {statistics.median(r['base_ms']):9.3f} {statistics.median(r['new_ms']):9.3f} "
                     f"{r['ratio']:7.3f} {r['new_tflops']:7.1f} {r['max_abs_diff']:9.2e}")
    for s in dict.fromkeys(r["set"] for r in rows):
        ratios = [r["ratio"] for r in rows if r["set"] == s]
        lines.append(f"{s}: {len(ratios)} cells, ratio min {min(ratios):.3f} median {statistics.median(ratios):.3f} "
                     f"max {max(ratios):.3f}")
    return "\n".join(lines)


def _warm_cell(base: str, sets, index: int) -> str:
    """(a worker process of --warm) one cell's call through both trees, untimed: NVRTC fills
    CuPy's kernel cache, so the timed run that follows compiles nothing."""
    import cuflash

    cell = cells(sets)[index]
    trees = (cuflash, load_tree(Path(base), "cuflash_base"))
    runner = Runner(2, 1)
    for fn in runner.calls(cell, trees):
        fn()
    runner.torch.cuda.synchronize()
    return cell.label


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", help="the baseline tree: a directory holding cuflash/ and cuda_src/")
    ap.add_argument("--cells", default="fwd", help=f"comma list of {', '.join(SETS)}, or all")
    ap.add_argument("--rounds", type=int, default=5, help="rounds per cell (each tree timed once a round)")
    ap.add_argument("--repeats", type=int, default=12, help="most timed repeats per round (peers.Timer)")
    ap.add_argument("--out", help="JSON file of every cell's times (rewritten after each cell)")
    ap.add_argument("--dry-run", action="store_true", help="list the cells; no GPU")
    ap.add_argument("--warm", type=int, default=0, metavar="JOBS",
                    help="first run every cell once through both trees in JOBS processes (compiles in parallel)")
    args = ap.parse_args(argv)
    sets = SETS if args.cells == "all" else tuple(s for s in args.cells.split(",") if s)
    todo = cells(sets)
    if args.dry_run:
        for c in todo:
            print(c.label)
        print(f"{len(todo)} cells")
        return 0
    if not args.base or not args.out:
        ap.error("--base and --out are required (or --dry-run)")
    if args.rounds < 2:
        ap.error("--rounds: at least 2, so that each tree is timed both first and second")
    if args.warm:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        t0 = time.monotonic()
        with ProcessPoolExecutor(args.warm, mp_context=multiprocessing.get_context("spawn")) as pool:
            list(pool.map(_warm_cell, [args.base] * len(todo), [sets] * len(todo), range(len(todo))))
        print(f"warm: {len(todo)} cells in {time.monotonic() - t0:.0f} s", flush=True)
    import cuflash

    trees = (cuflash, load_tree(Path(args.base), "cuflash_base"))
    runner = Runner(args.rounds, args.repeats)
    rows, start = [], time.monotonic()
    for cell in todo:
        rows.append(runner.run(cell, trees))
        r = rows[-1]
        print(f"{r['label']:58s} x{r['ratio']:6.3f}  {r['new_tflops']:7.1f} TF  diff {r['max_abs_diff']:.2e}", flush=True)
        Path(args.out).write_text(json.dumps(dict(base=str(args.base), cells=rows,
                                                  seconds=time.monotonic() - start), indent=1))
    print(summary(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
