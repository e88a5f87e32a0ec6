"""One line per kernel from an ncu run over tools/ncu_peers.py (issue_grid.sh's metrics):
which op launched it, its time, tensor-pipe / exp-pipe / issue / DRAM activity, instructions
executed (millions), the SMs' active share of its cycles and its four
largest stall reasons (warps stalled per issued instruction; "selected" left out).

    python3 tools/ncu_digest.py ncu_raw.txt

ncu prints every result at the end, in launch order; the op of each kernel comes from the order
of ncu_peers.py's "OP <name>" lines and ncu's "==PROF== Profiling" lines while it ran.
"""
import re
import sys

HEADER = re.compile(r"^  (\S.*?) \(\d+, \d+, \d+\)x\(\d+, \d+, \d+\), Context")
METRIC = re.compile(r"^\s+(\S+)\s+(\S+)?\s+([-\d.,]+|n/a|\(!\) n/a)$")


def main(path):
    lines = open(path, errors="replace").read().splitlines()
    launches, op = [], None
    for line in lines:
        if line.startswith("OP "):
            op = line[3:].strip()
        m = re.search(r'==PROF== Profiling "([^"]+)"', line)
        if m:
            launches.append((op, m.group(1)))
    kernels = []
    for line in lines:
        h = HEADER.match(line)
        if h:
            kernels.append({"name": h.group(1), "m": {}})
            continue
        m = METRIC.match(line)
        if kernels and m:
            try:
                value = float(m.group(3).replace(",", ""))
            except ValueError:
                continue
            # ncu picks the time unit per kernel (ns, us, ms): report microseconds
            unit = m.group(2) or ""
            times = {"ns": 1e-3, "nsecond": 1e-3, "ms": 1e3, "msecond": 1e3, "s": 1e6, "second": 1e6}
            if unit in times:
                value *= times[unit]
            elif len(unit) > 1 and unit[0] in "KMG" and unit[1:] in ("inst", "cycle", "byte"):  # Minst, Kcycle, ...
                value *= {"K": 1e3, "M": 1e6, "G": 1e9}[unit[0]]
            kernels[-1]["m"][m.group(1)] = value
    if len(launches) != len(kernels):
        print(f"(warning: {len(launches)} profiled launches, {len(kernels)} results)")
    for i, k in enumerate(kernels):
        op = launches[i][0] if i < len(launches) else "?"
        m = k["m"]
        stalls = {key[len("smsp__average_warps_issue_stalled_"):-len("_per_issue_active.ratio")]: v
                  for key, v in m.items() if key.startswith("smsp__average_warps_issue_stalled_")}
        stalls.pop("selected", None)
        top = ", ".join(f"{s} {v:.2f}" for s, v in sorted(stalls.items(), key=lambda kv: -kv[1])[:4])
        tensor = max((v for key, v in m.items() if key.startswith("sm__pipe_tensor")), default=float("nan"))
        name = re.sub(r"\(.*", "", k["name"])[:70]
        inst = m.get("smsp__inst_executed.sum", float("nan")) / 1e6
        active = 100 * m.get("sm__cycles_active.avg", float("nan")) / m.get("sm__cycles_elapsed.avg", float("nan"))
        print(f"{op} | {name} | {m.get('gpu__time_duration.sum', float('nan')):.1f} us | tensor {tensor:.1f}% | "
              f"xu {m.get('sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active', float('nan')):.1f}% | "
              f"issue {m.get('smsp__issue_active.avg.pct_of_peak_sustained_active', float('nan')):.1f}% | "
              f"dram {m.get('dram__throughput.avg.pct_of_peak_sustained_elapsed', float('nan')):.1f}% | "
              f"inst {inst:.0f}M | SMs active {active:.1f}% | {top}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
