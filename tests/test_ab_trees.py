"""tools/ab_trees.py without a GPU: its dry run, its cell sets, and that a second tree of the package
loads under another name beside the first (what its one-process A/B rests on)."""

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import cuflash

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
import ab_trees  # noqa: E402


def test_dry_run_lists_the_cells_without_torch_or_cupy():
    code = ("import sys, runpy; sys.modules['torch'] = None; sys.modules['cupy'] = None; "
            f"sys.argv = ['ab_trees.py', '--dry-run', '--cells', 'all']; "
            f"runpy.run_path({str(ROOT / 'tools' / 'ab_trees.py')!r}, run_name='__main__')")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    all_cells = ab_trees.cells(ab_trees.SETS)
    assert proc.stdout.splitlines()[-1] == f"{len(all_cells)} cells"
    assert all(c.label in proc.stdout for c in all_cells)


def test_cell_sets():
    every = ab_trees.cells(ab_trees.SETS)
    assert len(every) == len(set(every))
    assert all(c.b * c.n == 16384 and c.h == (8 if c.d == 256 else 16) for c in every if c.op != "decode")
    decode = ab_trees.cells(["decode"])
    assert {(c.b, c.h, c.hkv, c.n) for c in decode} == set(ab_trees.DECODE_SHAPES)
    assert {c.dtype for c in decode} == {"bfloat16", "float8_e4m3fn"} and all(c.h % c.hkv == 0 for c in decode)
    assert decode[0].flops == 4.0 * decode[0].n * 128 * decode[0].b * decode[0].h  # one query row each
    mods = ab_trees.cells(["mods"])
    assert {c.option for c in mods} == {"none", "softcap", "alibi", "sinks"}
    # each modified cell has its plain twin, whose time it is compared with
    plain = {(c.n, c.causal) for c in mods if c.option == "none"}
    assert {(c.n, c.causal) for c in mods} == plain
    assert {c.dtype for c in ab_trees.cells(["fp8"])} == {"float8_e4m3fn"}
    causal = ab_trees.Cell("fwd", "fwd", "bfloat16", 128, 1, 16, 16384, True)
    assert causal.flops * 2 == ab_trees.Cell("fwd", "fwd", "bfloat16", 128, 1, 16, 16384, False).flops
    assert ab_trees.Cell("bwd", "bwd", "bfloat16", 128, 1, 16, 16384, False).flops == 2.5 * 4 * 16384 ** 2 * 128 * 16
    with pytest.raises(ValueError, match="--cells"):
        ab_trees.cells(["fwd", "prefill"])


def test_a_second_tree_loads_beside_the_first(tmp_path):
    other = ab_trees.load_tree(ROOT, "cuflash_ab_test")
    try:
        assert other is not cuflash and other.attention is not cuflash.attention
        loaded = [m for name, m in sys.modules.items() if name.startswith("cuflash_ab_test.")]
        assert loaded and all(m.__file__.startswith(str(ROOT / "cuflash")) for m in loaded if m.__file__)
        # its modules are its own (relative imports only): none is one of the first tree's
        first = {id(m) for name, m in sys.modules.items() if name == "cuflash" or name.startswith("cuflash.")}
        assert not first & {id(m) for m in loaded}
        rng = np.random.default_rng(3)
        q, k, v = (rng.standard_normal((1, 2, 40, 16)).astype(np.float16) for _ in range(3))
        assert other.attention(q, k, v, causal=True).tobytes() == cuflash.attention(q, k, v, causal=True).tobytes()
    finally:
        for name in [n for n in sys.modules if n == "cuflash_ab_test" or n.startswith("cuflash_ab_test.")]:
            del sys.modules[name]
    with pytest.raises(FileNotFoundError, match="--base"):
        ab_trees.load_tree(tmp_path, "cuflash_missing")
