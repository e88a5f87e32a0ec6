"""Where a decode block's warp-stall samples and instructions fall, from ncu's SASS source page
(`tools/wide_source_probe.py` writes it as CSV): instructions after the last HMMA (the block's end)
or before it, split by how often each warp ran them - once (the start or the end), up to 16 times
(the end's store loop, a short split's steps) or more (the key loop).

    python3 tools/ncu_source_phases.py src.csv[.gz] WARPS [more.csv WARPS ...]
WARPS: the launch's warps (blocks x warps per block), to turn executed counts into counts per warp.
"""
import csv
import gzip
import sys


def phases(path, warps):
    opener = gzip.open if path.endswith(".gz") else open
    rows = list(csv.reader(opener(path, "rt")))
    k = next(i for i, r in enumerate(rows) if r and r[0] == "Address")  # (ncu's own lines come first)
    hdr = rows[k]
    data = [r for r in rows[k + 1:] if len(r) == len(hdr)]
    isrc, iall = hdr.index("Source"), hdr.index("Warp Stall Sampling (All Samples)")
    iexe = hdr.index("Instructions Executed")
    num = lambda x: float(x.replace(",", "")) if x.strip() else 0.0  # noqa: E731
    last = max(i for i, r in enumerate(data) if "HMMA" in r[isrc])
    cls = {}
    for i, r in enumerate(data):
        e = num(r[iexe])
        if e == 0:
            continue
        per = e / warps
        key = ("after last HMMA" if i > last else "before",
               "once/warp" if per <= 1.01 else ("<=16/warp" if per <= 16.01 else "loop"))
        s = cls.setdefault(key, [0.0, 0.0])
        s[0] += num(r[iall])
        s[1] += e
    tot = sum(v[0] for v in cls.values())
    print(path)
    for key, (smp, e) in sorted(cls.items()):
        print(f"   {key[0]:16s} {key[1]:10s} samples {100 * smp / tot:5.1f}%  instructions per warp {e / warps:8.0f}")


if __name__ == "__main__":
    args = sys.argv[1:]
    for path, warps in zip(args[::2], args[1::2]):
        phases(path, int(warps))
