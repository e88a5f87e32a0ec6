"""tools/e4m3_search.py without a GPU: its dry run, and that its candidates are the kernels the
planner can launch, the table's own among them."""

import subprocess
import sys
from pathlib import Path

from cuflash.core.arrays import BFLOAT16
from cuflash.plan import decode as plan_decode
from cuflash.plan import hopper as plan_hopper
from cuflash.plan import schedule

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
import e4m3_search  # noqa: E402


def test_dry_run_lists_the_candidates_without_torch_or_cupy():
    code = ("import sys, runpy; sys.modules['torch'] = None; sys.modules['cupy'] = None; "
            f"sys.argv = ['e4m3_search.py', '--dry-run']; runpy.run_path({str(ROOT / 'tools' / 'e4m3_search.py')!r}, "
            "run_name='__main__')")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    fwd_table = e4m3_search.label(schedule.HOPPER_FP8_FORWARD_TILES[128])
    decode_table = e4m3_search.label(schedule.DECODE_TILES_KV8[128])
    causal = schedule.fp8_forward_tile(128, True)
    also = "" if e4m3_search.same_tile(causal, schedule.HOPPER_FP8_FORWARD_TILES[128]) else f" (causal: {e4m3_search.label(causal)})"
    assert f"fwd d=128: table {fwd_table}{also};" in proc.stdout and f"decode d=128: table {decode_table};" in proc.stdout
    assert f"{len(e4m3_search.candidate_specs())} instantiations" in proc.stdout


def test_candidates_hold_the_tables_tiles_and_fit():
    for hd, table in schedule.HOPPER_FP8_FORWARD_TILES.items():
        cands = e4m3_search.fwd_candidates(hd)
        assert any(e4m3_search.same_tile(t, table) for t in cands)
        assert all(t.smem_bytes(hd, 1) <= e4m3_search.SMEM_LIMIT for t in cands)
    decode = e4m3_search.decode_candidates()
    assert any(e4m3_search.same_tile(t, schedule.DECODE_TILES_KV8[128]) for t in decode)
    assert all(t.kv_bytes == 1 and t.ring <= 2 for t in decode)
    names = [s.expression for s in e4m3_search.candidate_specs()]
    assert len(names) == len(set(names))
    assert all(n.startswith(("attn_decode_kv8<", "attn_decode_cluster_kv8<", "attn_fwd_wgmma_tma_fp8<",
                             "attn_fwd_wgmma_tma_fp8_persistent<")) for n in names)
    # every explicit split count runs where the planner would launch it (cluster sizes are instantiated)
    for splits in e4m3_search.SPLITS.values():
        assert all(not cluster or n in plan_decode.CLUSTER_SIZES for n, cluster in splits)


def test_persistent_candidates_and_their_specs():
    # --persistent: own-pace persistent tiles, with and without the per-warpgroup epilogue, each
    # fitting (O is stored from the accumulators: the table's 224 x 3 too); the specs hold the
    # dispatch's tile per mask (the baseline), the per-tile table's tile and the persistent
    # kernel's instantiations, once each.
    cands = e4m3_search.fwd_candidates(128, persistent=True)
    assert cands and all(t.persistent and not t.pingpong and t.tma for t in cands)
    assert {t.wg_epilogue for t in cands} == {False, True}
    assert all(t.smem_bytes(128, 1) <= e4m3_search.SMEM_LIMIT for t in cands)
    assert any(t.block_n == 224 and t.stages == 3 for t in cands)
    names = [s.expression for s in e4m3_search.candidate_specs(("fwd",), persistent=True, dims=(128,))]
    per_tile = schedule.HOPPER_FP8_FORWARD_TILES[128]
    for causal in (False, True):
        assert plan_hopper.fp8_forward_spec(BFLOAT16, 128, causal)[0].expression in names
        # the per-tile table's tile is timed beside the persistent ones, whichever the dispatch runs
        assert plan_hopper.fp8_forward_spec(BFLOAT16, 128, causal, per_tile)[0].expression in names
    assert len(names) == len(set(names)) == 2 * (len(cands) + 1)
    assert sum(n.startswith("attn_fwd_wgmma_tma_fp8_persistent<") for n in names) == 2 * len(cands)
    assert e4m3_search.label(cands[-1]).endswith(" persistent wg-epilogue")
