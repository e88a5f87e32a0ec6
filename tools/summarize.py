"""Fold one GPU check's outputs into summary.json: commit, device, date, test counts, benchmark rows.

    python3 tools/summarize.py --junit OUT/junit.xml --bench OUT/bench.json --out OUT/summary.json

A missing or unreadable input is recorded as such (never replaced by made-up numbers), and the
exit status is non-zero only when the summary itself cannot be written.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path


def _run(cmd) -> str | None:
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    out = res.stdout.strip()
    return out if res.returncode == 0 and out else None


def git_commit() -> dict:
    """The GIT_COMMIT variable when the caller passed one (a copied tree may lack .git or carry
    a stale one), else HEAD from git."""
    env = os.environ.get("GIT_COMMIT")
    if env:
        return {"commit": env, "commit_source": "GIT_COMMIT", "dirty": None}
    head = _run(["git", "rev-parse", "HEAD"])
    if head:
        status = _run(["git", "status", "--porcelain", "--untracked-files=no"])
        return {"commit": head, "commit_source": "git", "dirty": bool(status)}
    return {"commit": None, "commit_source": "unavailable", "dirty": None}


def device_name(bench: dict | None) -> str | None:
    if isinstance(bench, dict) and bench.get("device"):
        return bench["device"]
    smi = _run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"])
    if smi:
        return "; ".join(line.strip() for line in smi.splitlines())
    return None


def junit_counts(path: Path) -> dict:
    """passed/failed/skipped from a JUnit XML file (errors count as failed)."""
    if not path.is_file():
        return {"passed": None, "failed": None, "skipped": None, "error": f"{path} not found"}
    try:
        root = ET.parse(path).getroot()
    except ET.ParseError as exc:
        return {"passed": None, "failed": None, "skipped": None, "error": f"{path}: {exc}"}
    suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
    total = failed = skipped = 0
    for s in suites:
        total += int(s.get("tests", 0))
        failed += int(s.get("failures", 0)) + int(s.get("errors", 0))
        skipped += int(s.get("skipped", 0))
    return {"passed": total - failed - skipped, "failed": failed, "skipped": skipped}


def load_bench(path: Path):
    """(bench dict or None, note). Accepts {"ceilings":..., "bench"|"results": [...]} or a list."""
    if not path.is_file():
        return None, f"{path} not found (no benchmark ran)"
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        return None, f"{path}: {exc}"
    if isinstance(data, list):
        data = {"bench": data}
    if not isinstance(data, dict):
        return None, f"{path}: expected an object or a list, got {type(data).__name__}"
    return data, None


def summarize(junit: Path, bench_path: Path) -> dict:
    bench, note = load_bench(bench_path)
    rows = []
    ceilings = {}
    if bench is not None:
        rows = bench.get("bench", bench.get("results", []))
        ceilings = bench.get("ceilings", {})
    summary = {
        **git_commit(),
        "device": device_name(bench),
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "tests": junit_counts(junit),
        "ceilings": ceilings,
        "bench": rows,
    }
    if note:
        summary["bench_note"] = note
    elif bench.get("complete") is False:
        left = bench.get("not_run", [])
        summary["bench_note"] = f"benchmark incomplete ({len(left)} cases not run)"
    return summary


# benchmarks/peers.py's row fields worth a glance; other files' rows show all their scalar fields.
TABLE_COLUMNS = ("op", "impl", "dtype", "d", "b", "hq", "hkv", "nq", "nk", "causal", "ms", "tflops", "tbps", "status")


def _fmt(x) -> str:
    if isinstance(x, float):
        return f"{x:.4g}"
    return str(x)


def table(summary: dict, max_rows: int = 40) -> str:
    """A short plain-text view: the header facts, the ceilings, then the benchmark rows."""
    t = summary["tests"]
    lines = [
        f"commit   {summary['commit']} ({summary['commit_source']}{', dirty' if summary.get('dirty') else ''})",
        f"device   {summary['device']}",
        f"date     {summary['date']}",
        f"tests    passed {t['passed']}  failed {t['failed']}  skipped {t['skipped']}"
        + (f"  ({t['error']})" if t.get("error") else ""),
    ]
    for name, value in summary["ceilings"].items():
        lines.append(f"ceiling  {name}: {_fmt(value)}")
    if summary.get("bench_note"):
        lines.append(f"bench    {summary['bench_note']}")
    rows = [r for r in summary["bench"] if isinstance(r, dict)]
    if rows:
        cols = list(dict.fromkeys(k for r in rows for k, v in r.items() if not isinstance(v, (dict, list))))
        short = [c for c in TABLE_COLUMNS if c in cols]
        cols = short if len(short) >= 3 else cols
        cells = [[_fmt(r.get(c, "")) for c in cols] for r in rows[:max_rows]]
        widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
        lines.append("  ".join(c.ljust(w) for c, w in zip(cols, widths)))
        lines.extend("  ".join(v.ljust(w) for v, w in zip(row, widths)) for row in cells)
        if len(rows) > max_rows:
            lines.append(f"... {len(rows) - max_rows} more rows in summary.json")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--junit", type=Path, required=True, help="pytest --junitxml output")
    ap.add_argument("--bench", type=Path, required=True, help="benchmark JSON (may be missing)")
    ap.add_argument("--out", type=Path, required=True, help="where to write summary.json")
    args = ap.parse_args(argv)
    summary = summarize(args.junit, args.bench)
    args.out.write_text(json.dumps(summary, indent=2) + "\n")
    print(table(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
