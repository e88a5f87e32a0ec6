"""Plain-text tables of the reports."""

from __future__ import annotations


def mib(n):
    return f"{n / 2**20:,.2f}"


def format_table(header, rows) -> str:
    """A plain-text table: left-aligned text, right-aligned numbers."""
    rows = [tuple(str(c) for c in r) for r in rows]
    widths = [max(len(str(h)), *(len(r[i]) for r in rows)) if rows else len(str(h)) for i, h in enumerate(header)]

    def numeric(c):
        return c.replace(",", "").replace(".", "", 1).lstrip("-").isdigit()

    def line(cells):
        return "  ".join(c.rjust(w) if numeric(c) else c.ljust(w) for c, w in zip(cells, widths)).rstrip()

    sep = "  ".join("-" * w for w in widths)
    return "\n".join([line([str(h) for h in header]), sep] + [line(r) for r in rows])
