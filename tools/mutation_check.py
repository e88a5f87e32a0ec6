"""Mutation check: plant known bugs in a copy of cuflash and require the CPU tests to catch each.

For every mutant: copy cuflash/, cuda_src/, tests/ and pyproject.toml to a temporary directory,
apply one text substitution (it must match exactly once, else this tool fails loudly: the code
moved and the mutant must be updated), run a fast subset of the CPU tests there (``-x``, PYTHONPATH
and the rootdir both the copy) and count the mutant caught when pytest reports failed tests
(exit code 1). Any other exit code (collection error, usage error) is an error of this tool, not a
catch. The unmutated copy is run first on the same subsets and must pass.

Usage (from the repository root): python tools/mutation_check.py [--list] [--only NAME ...]
The last line printed is ``mutants: N, caught: M``; the exit code is 0 only when M == N.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
COPIED = ("cuflash", "cuda_src", "tests", "pyproject.toml")

# Test subsets (pytest arguments after the files are resolved in the copy).
# The mask mutants are judged by accuracy tests only (not by the mask unit tests, test_masks.py and the
# window tests' brute-force comparisons of cuflash.core.masks): that shows the oracle does not share
# the masks with the code it checks.
FORWARD = ["tests/test_cpu_forward.py"]
BACKWARD = ["tests/test_cpu_backward.py"]
MASKS = ["tests/test_cpu_forward.py", "tests/test_cpu_backward.py"]
MODS = ["tests/test_score_mods.py", "-k", "small_tiles and f16 and 37"]
WINDOW = ["tests/test_window_varlen.py", "-k", "window_forward or window_backward or window_public or varlen_forward"]


@dataclass(frozen=True)
class Mutant:
    name: str
    path: str  # file in the copy
    old: str  # must occur exactly once
    new: str
    tests: tuple  # pytest arguments
    what: str


MUTANTS = [
    Mutant("causal-bottom-right-off-by-one", "cuflash/core/masks.py",
           'return nk - nq if causal == "bottom_right" else 0',
           'return nk - nq + 1 if causal == "bottom_right" else 0', tuple(MASKS),
           "bottom-right causal diagonal one key too far"),
    Mutant("causal-top-left-off-by-one", "cuflash/core/masks.py",
           'return nk - nq if causal == "bottom_right" else 0',
           'return nk - nq if causal == "bottom_right" else -1', tuple(MASKS),
           "top-left causal diagonal one key short"),
    Mutant("window-left-bound", "cuflash/core/masks.py",
           "            lo = diag - left",
           "            lo = diag - left + 1", tuple(WINDOW),
           "sliding window sees one key too few on the left"),
    Mutant("window-right-bound", "cuflash/core/masks.py",
           "hi = diag + right if hi is None else min(hi, diag + right)",
           "hi = diag + right + 1 if hi is None else min(hi, diag + right + 1)", tuple(WINDOW),
           "sliding window sees one key too many on the right"),
    Mutant("default-scale", "cuflash/core/problem.py",
           "return 1.0 / math.sqrt(d) if d > 0 else 1.0",
           "return 1.0 / math.sqrt(d + 1) if d > 0 else 1.0", tuple(FORWARD),
           "default softmax scale 1/sqrt(d + 1) instead of 1/sqrt(d)"),
    Mutant("tile-edge-ragged-keys", "cuflash/backends/numpy.py",
           "    cols = min(block_n, nk - n0)\n    t[:, :, :cols]",
           "    cols = min(block_n, nk - n0 - 1) if nk - n0 < block_n else block_n\n    t[:, :, :cols]",
           tuple(FORWARD), "a ragged last K/V tile loses its last key (left zero, not masked)"),
    Mutant("tile-skip-first-tile", "cuflash/backends/numpy.py",
           "return range(c0 - c0 % bn, c1, bn) if c1 > c0 else range(0)",
           "return range(c0 - c0 % bn + (bn if c0 % bn else 0), c1, bn) if c1 > c0 else range(0)",
           tuple(WINDOW), "a window's first, partly visible K/V tile is skipped"),
    Mutant("no-rescale-of-l", "cuflash/backends/numpy.py",
           "l = l * alpha + probs.sum(axis=-1)",
           "l = l + probs.sum(axis=-1)", tuple(FORWARD),
           "online softmax: the running sum is not rescaled when the max grows"),
    Mutant("no-rescale-of-acc", "cuflash/backends/numpy.py",
           "acc *= alpha.reshape(p.batch, p.hkv, p.group * r, 1)",
           "acc *= alpha.reshape(p.batch, p.hkv, p.group * r, 1) ** 0", tuple(FORWARD),
           "online softmax: the accumulator is not rescaled when the max grows"),
    Mutant("lse-log2", "cuflash/backends/numpy.py",
           "log_l = np.log(l, out=np.zeros_like(l), where=seen)",
           "log_l = np.log2(l, out=np.zeros_like(l), where=seen)", tuple(FORWARD),
           "lse = m + log2(l): base mixed up"),
    Mutant("lse-ulp-shift", "cuflash/backends/numpy.py",
           "lse3[:, :, m0:m1] = lse.reshape(p.batch, p.hq, r).astype(_F32)",
           "lse3[:, :, m0:m1] = (lse.reshape(p.batch, p.hq, r) + 1e-3).astype(_F32)", tuple(FORWARD),
           "lse off by 1e-3 (far below the former bf16 bound)"),
    Mutant("scores-rounded-to-input-dtype", "cuflash/backends/numpy.py",
           "    s *= s.dtype.type(p.scale)\n",
           "    s *= s.dtype.type(p.scale)\n    s = _round_to_input(s, p.dtype)\n", tuple(FORWARD),
           "the scores rounded to the input dtype before the softmax (the issue's kernel)"),
    Mutant("pv-accumulated-in-input-dtype", "cuflash/backends/numpy.py",
           "acc += np.matmul(pv_in, _key_tile(v4, n0, bn))",
           "acc[...] = _round_to_input(acc + np.matmul(pv_in, _key_tile(v4, n0, bn)), p.dtype)", tuple(FORWARD),
           "P V accumulated in the input dtype instead of float32"),
    Mutant("backward-no-D-term", "cuflash/backends/numpy.py",
           "ds = probs * (dprobs - row_dot[t][..., None])",
           "ds = probs * dprobs", tuple(BACKWARD),
           "backward: dS = P dP, the D = rowsum(dO * O) term forgotten"),
    Mutant("backward-D-one-percent-off", "cuflash/backends/numpy.py",
           "d = (do4[:, :, m0:m1].astype(acc_t) * o4[:, :, m0:m1].astype(acc_t)).sum(axis=-1)",
           "d = (do4[:, :, m0:m1].astype(acc_t) * o4[:, :, m0:m1].astype(p.dtype).astype(acc_t) * 1.01).sum(axis=-1)",
           tuple(BACKWARD), "backward: D 1% off"),
    Mutant("backward-dk-unscaled", "cuflash/backends/numpy.py",
           "dk_acc += np.matmul(ds_mma.swapaxes(-1, -2), qt) * sc",
           "dk_acc += np.matmul(ds_mma.swapaxes(-1, -2), qt)", tuple(BACKWARD),
           "backward: dK misses the softmax scale"),
    Mutant("gqa-interleaved-heads", "cuflash/backends/numpy.py",
           "t = a4[:, :, m0:m1].astype(accumulator_dtype(p.dtype))",
           "t = a4[:, (np.arange(p.hq) % p.group) * p.hkv + np.arange(p.hq) // p.group, m0:m1]"
           ".astype(accumulator_dtype(p.dtype))", tuple(FORWARD),
           "GQA: query head h reads K/V head h % Hkv instead of h // group"),
    Mutant("softcap-no-derivative", "cuflash/backends/numpy.py",
           "                ds *= factor\n", "                pass\n", tuple(MODS),
           "backward: the softcap's 1 - tanh^2 left out of dS"),
    Mutant("softcap-twice-the-cap", "cuflash/backends/numpy.py",
           "        s = c * t\n", "        s = 2 * c * t\n", tuple(MODS),
           "softcap: scores capped at 2c instead of c"),
    Mutant("alibi-sign", "cuflash/backends/numpy.py",
           "s = s - slopes * dist.astype(s.dtype)", "s = s + slopes * dist.astype(s.dtype)", tuple(MODS),
           "ALiBi: bias added with the wrong sign"),
    Mutant("sink-missing-from-denominator", "cuflash/backends/numpy.py",
           "            l[...] = 1\n", "            l[...] = 0\n", tuple(MODS),
           "sinks: the running max starts at the sink but its exp(0) is not counted"),
    Mutant("dsinks-sign", "cuflash/backends/numpy.py",
           "total += -(p_sink * row_dot[t]).sum(axis=(0, 3)).reshape(p.hq)",
           "total += (p_sink * row_dot[t]).sum(axis=(0, 3)).reshape(p.hq)", tuple(MODS),
           "backward: dsinks with the wrong sign"),
]


def make_copy(dest: Path):
    for name in COPIED:
        src = ROOT / name
        if src.is_dir():
            shutil.copytree(src, dest / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy2(src, dest / name)


def apply(dest: Path, m: Mutant):
    path = dest / m.path
    text = path.read_text()
    n = text.count(m.old)
    if n != 1:
        raise SystemExit(f"mutation_check: mutant {m.name}: the text to replace occurs {n} times in {m.path} "
                         f"(must be exactly once): {m.old!r}")
    path.write_text(text.replace(m.old, m.new))


def run_tests(dest: Path, tests, timeout):
    env = dict(os.environ, PYTHONPATH=str(dest), PYTHONDONTWRITEBYTECODE="1")
    env.pop("CUFLASH_SEED", None)
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "--rootdir", str(dest),
           "-m", "not gpu and not slow", *tests]
    t0 = time.time()
    proc = subprocess.run(cmd, cwd=dest, env=env, capture_output=True, text=True, timeout=timeout)
    return proc.returncode, time.time() - t0, proc.stdout + proc.stderr


def first_failure(out: str) -> str:
    for line in out.splitlines():
        if line.startswith("FAILED "):
            return line[len("FAILED "):][:150]
    return "?"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--list", action="store_true", help="list the mutants and exit")
    ap.add_argument("--only", nargs="*", help="run only these mutants")
    ap.add_argument("--timeout", type=float, default=600, help="seconds per pytest run")
    args = ap.parse_args(argv)
    mutants = [m for m in MUTANTS if not args.only or m.name in args.only]
    if args.list:
        for m in mutants:
            print(f"{m.name:34s} {m.path:28s} {m.what}")
        return 0
    if args.only and len(mutants) != len(args.only):
        raise SystemExit(f"mutation_check: unknown mutant in {args.only}")
    start = time.time()
    with tempfile.TemporaryDirectory(prefix="cuflash-mutants-") as tmp:
        tmp = Path(tmp)
        # Every mutant must apply to the current code before anything runs.
        for m in mutants:
            probe = (ROOT / m.path).read_text().count(m.old)
            if probe != 1:
                raise SystemExit(f"mutation_check: mutant {m.name}: the text to replace occurs {probe} times in "
                                 f"{m.path} (must be exactly once): {m.old!r}")
        clean = tmp / "clean"
        make_copy(clean)
        files = sorted({f for m in mutants for f in m.tests if f.startswith("tests/")})
        rc, secs, out = run_tests(clean, files, args.timeout)
        if rc != 0:
            print(out[-3000:])
            raise SystemExit(f"mutation_check: the unmutated copy fails its tests (pytest exit {rc}); fix that first")
        print(f"unmutated copy passes {' '.join(files)} ({secs:.0f} s)", flush=True)
        caught = 0
        for m in mutants:
            dest = tmp / m.name
            make_copy(dest)
            apply(dest, m)
            rc, secs, out = run_tests(dest, list(m.tests), args.timeout)
            if rc == 1:
                caught += 1
                print(f"caught    {m.name:34s} {secs:5.0f} s  by {first_failure(out)}", flush=True)
            elif rc == 0:
                print(f"SURVIVED  {m.name:34s} {secs:5.0f} s  ({m.what}; tests: {' '.join(m.tests)})", flush=True)
            else:
                print(out[-3000:])
                raise SystemExit(f"mutation_check: mutant {m.name}: pytest exit {rc} (not a test failure)")
            shutil.rmtree(dest)
    print(f"mutation check: {time.time() - start:.0f} s in all")
    print(f"mutants: {len(mutants)}, caught: {caught}")
    return 0 if caught == len(mutants) else 1


if __name__ == "__main__":
    sys.exit(main())
