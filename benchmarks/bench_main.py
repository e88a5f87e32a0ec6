"""The main loop that options.py, head_dim_v.py, fp8_decode.py and fp8_band.py share: their command line's
common flags, one case after another with a failing case kept as an "error" row, a ratio column
against a baseline row, and the JSON rewritten after every case.

peers.py keeps its own loop: a time budget, progress lines and a check verdict per implementation.
Like peers.py, nothing here imports torch or CuPy at module level, so ``--dry-run`` runs anywhere.
"""

from __future__ import annotations

import argparse
import datetime

from peers import write_json


def bench_arguments(doc: str, seconds_per_impl: float) -> argparse.ArgumentParser:
    """The flags every such script takes; the script adds its own before parsing."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--out", help="JSON file to write (rewritten after every case)")
    ap.add_argument("--seconds-per-impl", type=float, default=seconds_per_impl,
                    help="fewer repeats (at least 3) for implementations slower than this in total")
    ap.add_argument("--dry-run", action="store_true", help="print the plan; no GPU")
    return ap


def failure_reason(exc: BaseException) -> str:
    """An exception as a row's "reason"."""
    return f"{type(exc).__name__}: {exc}"[:300]


def dash(value, spec: str) -> str:
    """value formatted for the printed table; "-" where it is missing (None) or zero."""
    return format(value, spec) if value else "-"


def ratio_column(rows, name, cell, is_baseline, applies=None):
    """rows[i][name] = the baseline's ms / this row's ms, over rows of the same cell (cell(row) is
    its key); None where the cell has no timed baseline, the row is untimed, or applies(row) is
    false. Recomputed over every row so a baseline that comes later fills the earlier rows."""
    base = {cell(r): r["ms"] for r in rows if is_baseline(r) and r["ms"]}
    for r in rows:
        b = base.get(cell(r))
        r[name] = b / r["ms"] if b and r["ms"] and (applies is None or applies(r)) else None


def free_device_memory():
    """Hand the pools' cached blocks back, so one case's buffers do not crowd the next."""
    import cupy
    import torch

    cupy.get_default_memory_pool().free_all_blocks()
    torch.cuda.empty_cache()


def run_cases(cases, run_case, error_row, out=None, header=None, derive=None, free=None):
    """Run every case and return the JSON document {"date" (the start), **header, "bench", "complete"}.

    run_case(case, rows) appends the case's rows. When it raises, error_row(case, reason) is
    appended instead of ending the run: the rows it appended before that stay. After each case:
    free() (default free_device_memory), derive(rows) (the derived columns, e.g. ratio_column),
    and the document is written to `out` with "complete" false until the last case."""
    doc = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           **(header or {}), "bench": [], "complete": False}
    rows = doc["bench"]
    for i, case in enumerate(cases):
        try:
            run_case(case, rows)
        except Exception as exc:  # noqa: BLE001 - one failing case must not end the run
            rows.append(error_row(case, failure_reason(exc)))
        (free or free_device_memory)()
        if derive is not None:
            derive(rows)
        doc["complete"] = i + 1 == len(cases)
        if out:
            write_json(out, doc)
    return doc
