"""Compile (and so fill CuPy's kernel cache with) the kernels one tree's asv history cells use.

    PYTHONPATH=<tree> python3 tools/asv_warm.py

tools/asv_history.sh runs one of these per older tree, side by side, before asv times them
one after another: NVRTC compiles then overlap on the CPU cores instead of adding up inside
the timed runs' setup. Runs each cuflash prefill cell of the history once (HEAD's suites,
the tree's package) and prints how many cells ran, failed or skipped.
"""

import itertools
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks" / "benchmarks"))
import bench_attention as suites  # noqa: E402

ran = failed = skipped = 0
for cls in (suites.CuflashForward, suites.CuflashBackward):
    for params in itertools.product(*cls.params):
        name = f"bench_attention.{cls.__name__}.time_cell({', '.join(map(repr, params))})"
        if not any(re.search(r, name) for r in suites.HISTORY):
            continue
        suite = cls()
        try:
            suite.setup(*params)
            ran += 1
        except NotImplementedError:
            skipped += 1
        except Exception as exc:  # noqa: BLE001 - an old tree may lack a path; asv records it
            failed += 1
            print(f"{name}: {type(exc).__name__}: {str(exc)[:200]}", file=sys.stderr)
        finally:
            suite.__dict__.clear()
            if suites._cupy_module is not None:
                suites._cupy_module.get_default_memory_pool().free_all_blocks()
import cuflash  # noqa: E402

print(f"warm {cuflash.__file__}: {ran} cells ran, {failed} failed, {skipped} skipped")
