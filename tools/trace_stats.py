"""The analysis shared by tools/bwd_trace.py and tools/fwd_trace.py: a kernel's per-block (or
per-tile) trace rows (start ns, end ns, SM, work items: backward steps, forward key tiles) turned
into where its time went."""
import numpy as np


def summarize(rows: np.ndarray, label: str, unit: str) -> dict:
    """rows: (n, 4) uint64 trace entries, unwritten ones (end 0) dropped. Prints one line and the
    shortest and longest blocks by work; returns the figures: span, a linear fit of a block's time
    against its work (fixed cost + cost per `unit`), SM idle time between blocks and after each
    SM's last block, and when the last 2% of blocks end."""
    t = rows[rows[:, 1] > 0].astype(np.float64)
    if not len(t):
        print(label, "no trace rows: was that kernel the one that ran?", flush=True)
        return {}
    t0 = t[:, 0].min()
    start, end, sm, work = (t[:, 0] - t0) / 1e3, (t[:, 1] - t0) / 1e3, t[:, 2].astype(int), t[:, 3].astype(int)
    dur, span = end - start, end.max()
    out = {"blocks": len(t), "span_us": span}
    (a, b), *_ = np.linalg.lstsq(np.stack([np.ones_like(dur), work], 1), dur, rcond=None)
    out["fit_fixed_us"], out[f"fit_per_{unit}_us"] = a, b
    by = {}
    for w in np.unique(work):
        sel = work == w
        by[int(w)] = {"blocks": int(sel.sum()), "mean_us": float(dur[sel].mean()), f"per_{unit}_us": float(dur[sel].mean() / max(w, 1))}
    out[f"by_{unit}s"] = by
    idle_between, idle_after = 0.0, 0.0
    for s in np.unique(sm):
        order = np.argsort(start[sm == s])
        st, en = start[sm == s][order], end[sm == s][order]
        idle_between += float(np.clip(st[1:] - en[:-1], 0, None).sum()) + float(st[0])
        idle_after += float(span - en.max())
    n_sm = len(np.unique(sm))
    out["sms"] = n_sm
    out["idle_between_blocks_pct"] = 100 * idle_between / (n_sm * span)
    out["idle_after_last_block_pct"] = 100 * idle_after / (n_sm * span)
    last = np.argsort(end)[-max(1, len(end) // 50):]
    out["last_2pct_blocks"] = {"first_end_us": float(end[last].min()), f"{unit}s_mean": float(work[last].mean())}
    print(label, f"span {span:.0f} us, {len(t)} blocks on {n_sm} SMs; fit {a:.2f} us + {b:.3f} us/{unit}; "
          f"idle between blocks {out['idle_between_blocks_pct']:.1f}%, after last {out['idle_after_last_block_pct']:.1f}%",
          flush=True)
    for w in sorted(by)[:3] + sorted(by)[-3:]:
        print(f"   {unit}s", w, by[w], flush=True)
    return out
