"""Fail when the latest recorded commit got slower than the one before it (asv results).

Reads the asv 0.6 result files of one machine (``benchmarks/results/asv/<machine>/*.json``, one
file per commit and environment), takes the two most recent commits (by commit date, then by when
their benchmarks ran), and compares every benchmark and parameter combination they share. All asv
values here are "larger is worse" (times, tracked times, bytes).

* Timed benchmarks with samples on both sides (``asv run --record-samples``): a regression is a
  slowdown that is both significant and large enough to matter: a one-sided Mann-Whitney U test
  (scipy.stats) of new > old below ``--alpha`` and a median ratio new/old of at least
  ``1 + --min-effect``. A rank test, because timing noise is skewed (a preempted sample is slow,
  never fast) and 5-10 samples say little about a normal fit.
* Values without samples (``track_*``, or runs recorded without samples): new/old above
  ``--factor``.
* A benchmark that ran before and fails now is a regression. Skipped results (NaN) and
  benchmarks whose code changed (different version hash) are shown, not judged.

    python tools/asv_regressions.py [--results benchmarks/results/asv] [--machine h100]
        [--alpha 0.01] [--min-effect 0.03] [--factor 1.10]

Exit status: 0 no regression (or fewer than two commits recorded), 1 regression, 2 bad usage.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import statistics
import sys
from pathlib import Path

from scipy.stats import mannwhitneyu

DEFAULT_RESULTS = Path(__file__).resolve().parent.parent / "benchmarks" / "results" / "asv"
RESULTS_API_VERSION = 2  # asv.results.Results.api_version in asv 0.6
NOT_RESULT_FILES = {"machine.json", "benchmarks.json"}


class UsageError(Exception):
    pass


def pick_machine(results: Path, machine: str | None) -> Path:
    if not results.is_dir():
        raise UsageError(f"--results: {results} is not a directory")
    machines = sorted(p.name for p in results.iterdir() if (p / "machine.json").is_file())
    if machine is None:
        if len(machines) != 1:
            raise UsageError(f"--machine: choose one of {machines}" if machines else
                             f"--results: no machine directories (with machine.json) in {results}")
        machine = machines[0]
    path = results / machine
    if not path.is_dir():
        raise UsageError(f"--machine: no results for {machine!r} in {results}; found {machines}")
    return path


def load_runs(machine_dir: Path) -> list[dict]:
    """Every result file of the machine, as asv wrote it (format version 2)."""
    runs = []
    for path in sorted(machine_dir.glob("*.json")):
        if path.name in NOT_RESULT_FILES:
            continue
        with open(path) as f:
            data = json.load(f)
        if data.get("version") != RESULTS_API_VERSION:
            print(f"warning: {path.name}: results format version {data.get('version')}, expected "
                  f"{RESULTS_API_VERSION}; skipped", file=sys.stderr)
            continue
        data["_file"] = path.name
        runs.append(data)
    return runs


def columns(data: dict, name: str) -> dict:
    """One benchmark's row of a result file, keyed by asv's column names."""
    return dict(zip(data["result_columns"], data["results"][name]))


def last_started(data: dict) -> int:
    return max((columns(data, n).get("started_at") or 0 for n in data["results"]), default=0)


def latest_two_commits(runs: list[dict]) -> list[str]:
    """The two most recent commit hashes, oldest first: commit date, then time the run started."""
    order = {}
    for data in runs:
        key = (data.get("date") or 0, last_started(data))
        order[data["commit_hash"]] = max(order.get(data["commit_hash"], key), key)
    return sorted(order, key=order.get)[-2:]


def unroll(name: str, cols: dict):
    """(label, value, version, samples) per parameter combination, in asv's itertools.product
    order; samples is None where asv kept none."""
    params = cols.get("params") or []
    values = cols.get("result")
    combos = list(itertools.product(*params))
    if values is None:  # every combination failed
        values = [None] * len(combos)
    samples = cols.get("samples") or [None] * len(combos)
    for combo, value, sample in zip(combos, values, samples):
        label = f"{name}({', '.join(combo)})" if combo else name
        yield label, value, cols.get("version"), sample


def values_of(runs: list[dict], commit: str) -> dict:
    """{(label, env_name): (value, version, samples)} for one commit across its environments."""
    out = {}
    for data in runs:
        if data["commit_hash"] != commit:
            continue
        for name in data["results"]:
            for label, value, version, sample in unroll(name, columns(data, name)):
                out[(label, data["env_name"])] = (value, version, sample)
    return out


def is_skipped(v) -> bool:
    return isinstance(v, float) and math.isnan(v)


MIN_SAMPLES = 3  # fewer cannot reach p < 0.05 in a one-sided rank test of 3 against 3


def _usable(samples) -> list | None:
    if not samples:
        return None
    finite = [x for x in samples if isinstance(x, (int, float)) and math.isfinite(x)]
    return finite if len(finite) >= MIN_SAMPLES else None


def shift(old_samples, new_samples, alpha: float, min_effect: float) -> tuple[str, float]:
    """(mark, median ratio) of two sample sets: '+' significantly and materially slower, '-'
    significantly and materially faster, ' ' neither."""
    ratio = statistics.median(new_samples) / statistics.median(old_samples)
    if ratio >= 1.0 + min_effect and mannwhitneyu(new_samples, old_samples, alternative="greater").pvalue < alpha:
        return "+", ratio
    if ratio <= 1.0 / (1.0 + min_effect) and mannwhitneyu(new_samples, old_samples, alternative="less").pvalue < alpha:
        return "-", ratio
    return " ", ratio


def compare(old: dict, new: dict, factor: float, alpha: float = 0.01, min_effect: float = 0.03):
    """Rows (mark, old, new, ratio, label, env) and whether anything regressed.

    Marks follow `asv compare`: '+' slower (see the module's rule), '-' faster, '!' newly
    failing, '*' fixed, 'x' not comparable (code changed), ' ' unchanged or skipped."""
    rows, regressed = [], False
    missing = (math.nan, None, None)
    for key in sorted(set(old) | set(new)):
        (v1, ver1, s1), (v2, ver2, s2) = old.get(key, missing), new.get(key, missing)
        ratio = None
        if isinstance(v1, (int, float)) and isinstance(v2, (int, float)) and not (is_skipped(v1) or is_skipped(v2)):
            ratio = v2 / v1 if v1 else math.inf
        s1, s2 = _usable(s1), _usable(s2)
        if ver1 is not None and ver2 is not None and ver1 != ver2:
            mark = "x"
        elif v1 is not None and v2 is None and key in new:
            mark, regressed = "!", True
        elif v1 is None and v2 is not None:
            mark = "*"
        elif ratio is not None and s1 and s2:
            mark, ratio = shift(s1, s2, alpha, min_effect)
            regressed |= mark == "+"
        elif ratio is not None and ratio > factor:
            mark, regressed = "+", True
        elif ratio is not None and ratio < 1.0 / factor:
            mark = "-"
        else:
            mark = " "
        rows.append((mark, v1, v2, ratio, *key))
    return rows, regressed


def _value(v) -> str:
    if v is None:
        return "failed"
    if is_skipped(v):
        return "n/a"
    return f"{v:.4g}"


def render(rows, old_commit, new_commit, units, show_skipped=False) -> str:
    envs = {r[5] for r in rows}
    lines = [f"old {old_commit[:8]} -> new {new_commit[:8]}", f"  {'old':>12} {'new':>12} {'ratio':>7}  benchmark"]
    for mark, v1, v2, ratio, label, env in rows:
        if not show_skipped and is_skipped(v1) and is_skipped(v2):
            continue
        unit = units.get(label.split("(")[0], "")
        name = f"{label} [{env}]" if len(envs) > 1 else label
        r = f"{ratio:.2f}" if ratio is not None else "n/a"
        lines.append(f"{mark} {_value(v1):>12} {_value(v2):>12} {r:>7}  {name} {unit}".rstrip())
    return "\n".join(lines)


def units_of(results: Path) -> dict:
    """Benchmark name -> unit, from asv's benchmarks.json when it is there."""
    path = results / "benchmarks.json"
    if not path.is_file():
        return {}
    with open(path) as f:
        data = json.load(f)
    return {k: v.get("unit", "") for k, v in data.items() if isinstance(v, dict)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--results", type=Path, default=DEFAULT_RESULTS, help="asv results_dir")
    ap.add_argument("--machine", help="machine name (default: the only one recorded)")
    ap.add_argument("--alpha", type=float, default=0.01, help="significance level of the rank test")
    ap.add_argument("--min-effect", type=float, default=0.03,
                    help="smallest slowdown of the median that counts (0.03: 3%%)")
    ap.add_argument("--factor", type=float, default=1.10,
                    help="new/old above this is a regression, for values without samples")
    ap.add_argument("--show-skipped", action="store_true", help="list benchmarks skipped on both sides")
    args = ap.parse_args(argv)
    if not args.factor >= 1.0:
        print("--factor: expected a number >= 1", file=sys.stderr)
        return 2
    if not 0.0 < args.alpha < 1.0:
        print("--alpha: expected a number between 0 and 1", file=sys.stderr)
        return 2
    if not args.min_effect >= 0.0:
        print("--min-effect: expected a number >= 0", file=sys.stderr)
        return 2
    try:
        machine_dir = pick_machine(args.results, args.machine)
    except UsageError as exc:
        print(exc, file=sys.stderr)
        return 2
    runs = load_runs(machine_dir)
    commits = latest_two_commits(runs)
    if len(commits) < 2:
        print(f"{machine_dir.name}: {len(commits)} commit(s) recorded; nothing to compare")
        return 0
    old, new = (values_of(runs, c) for c in commits)
    rows, regressed = compare(old, new, args.factor, args.alpha, args.min_effect)
    print(render(rows, *commits, units_of(args.results), args.show_skipped))
    slower = sum(r[0] in "+!" for r in rows)
    rule = f"p < {args.alpha:g} and >= {args.min_effect:.0%} slower; x{args.factor:.2f} without samples"
    print(f"{slower} regression(s) ({rule})" if regressed else f"no regression ({rule})")
    return 1 if regressed else 0


if __name__ == "__main__":
    sys.exit(main())
