"""The benchmark harness without a GPU: peers.py's plan and verdicts, the benchmark scripts' shared main
loop (benchmarks/bench_main.py), the asv suites' skip, and tools/asv_regressions.py on asv 0.6
result files written here."""

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
PEERS = ROOT / "benchmarks" / "peers.py"
REGRESSIONS = ROOT / "tools" / "asv_regressions.py"


def load(path, name):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # dataclasses look their module up while the class is made
    spec.loader.exec_module(mod)
    return mod


peers = load(PEERS, "peers_under_test")
asv_regressions = load(REGRESSIONS, "asv_regressions_under_test")


# ---------------------------------------------------------------------------------------------
# peers.py


def dry_run(tmp_path, *flags):
    """Run peers.py --dry-run in a fresh interpreter where importing torch or CuPy fails."""
    out = tmp_path / "plan.json"
    code = (
        "import sys, runpy; sys.modules['torch'] = None; sys.modules['cupy'] = None; "
        f"sys.argv = ['peers.py', '--dry-run', '--out', {str(out)!r}] + {list(flags)!r}; "
        f"runpy.run_path({str(PEERS)!r}, run_name='__main__')"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return json.loads(out.read_text())["plan"], proc.stdout


def test_peers_dry_run_builds_the_forward_grid_without_torch_or_cupy(tmp_path):
    plan, stdout = dry_run(tmp_path)
    assert "48 cases" in stdout
    assert len(plan) == 48
    seen = set()
    for c in plan:
        assert c["op"] == "fwd"
        assert c["b"] * c["nq"] == 16384 and c["hq"] * c["d"] == 2048  # 16k tokens, width 2048
        assert c["hq"] == c["hkv"] and c["nq"] == c["nk"]
        n, d, bh = c["nq"], c["d"], c["b"] * c["hq"]
        dense = 4 * bh * n * n * d
        assert c["flops"] == (dense / 2 if c["causal"] else dense)
        # top-left causal with Nq == Nk keeps row i's i+1 keys: n(n+1)/2 pairs per head
        assert c["flops_exact"] == (4 * bh * d * n * (n + 1) // 2 if c["causal"] else dense)
        assert c["logical_bytes"] == 2 * 4 * bh * n * d  # q, k, v read and o written, 2 bytes each
        seen.add((c["dtype"], d, n, c["causal"]))
    bf16 = {("bfloat16", d, n, c) for d in (64, 128, 256) for n in (512, 1024, 2048, 4096, 8192, 16384)
            for c in (False, True)}
    fp16 = {("float16", 128, n, c) for n in (512, 1024, 2048, 4096, 8192, 16384) for c in (False, True)}
    assert seen == bf16 | fp16


def test_peers_dry_run_quick_plan_with_backward_and_decode(tmp_path):
    plan, _ = dry_run(tmp_path, "--quick", "--ops", "fwd,bwd,decode")
    fwd = [c for c in plan if c["op"] == "fwd"]
    bwd = [c for c in plan if c["op"] == "bwd"]
    decode = [c for c in plan if c["op"] == "decode"]
    assert {(c["d"], c["nq"], c["causal"]) for c in fwd} == {
        (d, n, causal) for d in (64, 128) for n in (1024, 4096) for causal in (False, True)}
    assert all(c["dtype"] == "bfloat16" for c in plan)
    assert len(bwd) == len(fwd)
    for f, b in zip(fwd, bwd):
        assert b["flops"] == 2.5 * f["flops"] and b["flops_exact"] == 2.5 * f["flops_exact"]
    assert decode and any(c["hq"] != c["hkv"] for c in decode)
    for c in decode:
        assert c["nq"] == 1 and not c["causal"]
        assert c["flops"] == 4 * c["b"] * c["hq"] * c["nk"] * c["d"]
        # K and V caches once, plus q and o
        assert c["logical_bytes"] == 2 * (2 * c["b"] * c["hkv"] * c["nk"] * c["d"] + 2 * c["b"] * c["hq"] * c["d"])


def test_peers_dry_run_decode_shapes_replace_the_grid(tmp_path):
    plan, _ = dry_run(tmp_path, "--ops", "decode", "--decode-shapes", "8x64x1x32768,16x48x1x8192x64")
    assert [(c["b"], c["hq"], c["hkv"], c["nk"], c["d"]) for c in plan] == [(8, 64, 1, 32768, 128), (16, 48, 1, 8192, 64)]
    assert all(c["op"] == "decode" and c["nq"] == 1 and c["dtype"] == "bfloat16" for c in plan)
    for bad in ("8x64x1", "8x64x5x1024", "8x64x1x0", "8xhx1x1024"):
        proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "peers.py"), "--dry-run", "--ops", "decode",
                               "--decode-shapes", bad], capture_output=True, text=True, timeout=60)
        assert proc.returncode == 2 and "--decode-shapes" in proc.stderr and bad in proc.stderr, (bad, proc.stderr)


def test_peers_dry_run_dtypes_grid_covers_every_head_dim_in_each_dtype(tmp_path):
    # the Hopper issue's grid: bf16 and fp16 at every head dim, forward and backward
    plan, _ = dry_run(tmp_path, "--ops", "fwd,bwd", "--dtypes", "bfloat16,float16", "--n", "1024,8192")
    seen = {(c["op"], c["dtype"], c["d"], c["nq"], c["causal"]) for c in plan}
    assert seen == {(op, t, d, n, c) for op in ("fwd", "bwd") for t in ("bfloat16", "float16")
                    for d in (64, 128, 256) for n in (1024, 8192) for c in (False, True)}
    assert len(plan) == len(seen)


def test_peers_fp8_cases_follow_their_bf16_twins(tmp_path):
    # --fp8: the e4m3 forward beside the bf16 one at d = 128 / 256, N = 8k / 16k, both masks; q, k,
    # v one byte each and o two.
    plan, stdout = dry_run(tmp_path, "--fp8", "--d", "64,128,256", "--n", "4096,8192,16384")
    fp8 = [c for c in plan if c["dtype"] == "float8_e4m3fn"]
    assert {(c["op"], c["d"], c["nq"], c["causal"]) for c in fp8} == {
        ("fwd", d, n, c) for d in (128, 256) for n in (8192, 16384) for c in (False, True)}
    for i, c in enumerate(plan):
        if c["dtype"] == "float8_e4m3fn":
            twin = plan[i - 1]
            assert twin["dtype"] == "bfloat16" and {k: v for k, v in twin.items() if k not in (
                "dtype", "logical_bytes")} == {k: v for k, v in c.items() if k not in ("dtype", "logical_bytes")}
            q, kv = c["b"] * c["hq"] * c["nq"] * c["d"], c["b"] * c["hkv"] * c["nk"] * c["d"]
            assert c["logical_bytes"] == q + 2 * kv + 2 * q
    assert len(plan) == 24 + len(fp8) and f"{len(plan)} cases" in stdout  # (the default grid: + fp16 at d=128)


def load_benchmark(name, module_name=None):
    """A benchmarks/ file as a module, its `from peers import` / `from bench_main import` resolved
    as when it runs as a script."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        return load(ROOT / "benchmarks" / f"{name}.py", module_name or f"{name}_under_test")
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))


def test_head_dim_v_bench_counts_each_gemm_at_its_own_width():
    # Q K^T at d and P V at dv: 2 N^2 (d + dv) per head, which is peers' 4 N^2 d where dv = d.
    hdv = load_benchmark("head_dim_v")
    cases = hdv.plan()
    assert {(c.d, dv) for c, dv in cases} == set(hdv.HEAD_DIMS)
    assert {c.op for c, _ in cases} == {"fwd", "bwd"} and {c.causal for c, _ in cases} == {False, True}
    for case, dv in cases:
        same = peers.Case(case.op, case.dtype, case.d, case.b, case.hq, case.hkv, case.nq, case.nk, case.causal)
        assert hdv.flops(case, case.d) == same.flops()
        assert hdv.flops(case, dv) == same.flops() * (case.d + dv) / (2 * case.d)
        assert hdv.logical_bytes(case, case.d) == same.logical_bytes()


def test_peers_rejects_an_unknown_dtype(tmp_path):
    out = tmp_path / "plan.json"
    proc = subprocess.run([sys.executable, str(PEERS), "--dry-run", "--out", str(out), "--dtypes", "float32"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--dtypes" in proc.stderr and not out.exists()


def test_peers_reference_is_planned_only_where_s_and_p_fit():
    big = peers.Case("fwd", "bfloat16", 64, 1, 32, 32, 16384, 16384, False)
    small = peers.Case("fwd", "bfloat16", 128, 16, 16, 16, 1024, 1024, False)
    assert big.reference_bytes() > peers.REFERENCE_MAX_BYTES > small.reference_bytes()


def _attention(q, k, v, dtype, round_to=ml_dtypes.bfloat16):
    """Attention computed in `dtype` arithmetic (scores, softmax, PV), then rounded to `round_to`."""
    s = (q.astype(dtype) @ k.astype(dtype).T) / dtype(math.sqrt(q.shape[-1]))
    p = np.exp(s - s.max(-1, keepdims=True))
    o = (p @ v.astype(dtype)) / p.sum(-1, keepdims=True)
    return o.astype(round_to).astype(np.float64)


def test_peers_judge_accepts_a_correct_result_and_flags_a_wrong_one():
    rng = np.random.default_rng(11)
    q, k, v = (rng.standard_normal((256, 64)).astype(ml_dtypes.bfloat16).astype(np.float64) for _ in range(3))
    exact = _attention(q, k, v, np.float64, round_to=np.float64)
    peer = _attention(q, k, v, np.float32)
    good = _attention(q[:, ::-1].copy(), k[:, ::-1].copy(), v, np.float32)  # other summation order
    u, scale = peers.UNIT_ROUNDOFF["bfloat16"], np.abs(exact).max()
    checked = [0, 1, 63, 64, 127, 128, 254, 255]  # rows compared with float64, like sample_rows

    def verdict(cand):
        return peers.judge(np.abs(cand[checked] - exact[checked]).max(), np.abs(peer[checked] - exact[checked]).max(),
                           np.abs(exact[checked]).max(), np.abs(cand - peer).max(), np.abs(peer).max(), u,
                           bool(np.isfinite(cand).all()))

    assert verdict(good) == "ok"
    wrong_row = good.copy()
    wrong_row[200] = good[199]  # a row computed from the wrong query, outside the checked rows
    assert verdict(wrong_row) == "mismatch"
    # Each bound on its own: error against float64 beyond 2x the peer's plus one rounding ...
    e = np.abs(peer[checked] - exact[checked]).max()
    assert peers.judge(2 * e + 2 * u * scale, e, scale, e, scale, u) == "mismatch"
    assert peers.judge(2 * e, e, scale, e, scale, u) == "ok"
    # ... and a whole-tensor difference from the peer beyond what both errors allow,
    assert peers.judge(e, e, scale, 3 * e + 2 * u * scale, scale, u) == "mismatch"
    assert peers.judge(e, e, scale, 3 * e, scale, u) == "ok"
    # where errors elsewhere may grow with the values: twice the magnitude, twice the allowance.
    assert peers.judge(e, e, scale, 5 * e, 2 * scale, u) == "ok"
    assert peers.judge(e, e, scale, 6 * e + 3 * u * scale, 2 * scale, u) == "mismatch"
    unscaled = _attention(q * 8.0, k, v, np.float32)  # forgot the 1/sqrt(d)
    assert verdict(unscaled) == "mismatch"
    poisoned = good.copy()
    poisoned[3, 5] = np.nan  # an element the kernel never wrote
    assert verdict(poisoned) == "mismatch"


# ---------------------------------------------------------------------------------------------
# benchmarks/bench_main.py: the main loop of options.py, head_dim_v.py, fp8_decode.py and fp8_band.py

# The scripts import it as "bench_main": loading it under that name lets the tests below replace
# its device-memory release in the module the scripts use.
bench_main = load_benchmark("bench_main", "bench_main")


def test_run_cases_keeps_going_past_a_failing_case_and_rewrites_the_json(tmp_path):
    out = tmp_path / "bench.json"
    seen, freed = [], []

    def run_case(case, rows):
        if seen:  # the previous case's document is on disk before this case starts
            partial = json.loads(out.read_text())
            assert partial["complete"] is False and partial["bench"] == rows and partial["ceilings"] == {"copy": 3.0}
        seen.append(case)
        rows.append({"impl": "base" if case == "a" else "cand", "cell": 1, "ms": {"a": 2.0, "b": 1.0}.get(case)})
        if case == "c":
            raise RuntimeError("x" * 400)

    doc = bench_main.run_cases(["a", "b", "c"], run_case,
                               error_row=lambda case, reason: {"impl": "cand", "cell": case, "ms": None,
                                                               "reason": reason},
                               out=str(out), header={"ceilings": {"copy": 3.0}}, free=lambda: freed.append(1),
                               derive=lambda rows: bench_main.ratio_column(
                                   rows, "vs_base", lambda r: r["cell"], lambda r: r["impl"] == "base"))
    assert seen == ["a", "b", "c"] and len(freed) == 3
    assert [r["impl"] for r in doc["bench"]] == ["base", "cand", "cand", "cand"]  # c's own row stays
    assert doc["bench"][-1]["reason"] == ("RuntimeError: " + "x" * 400)[:300]
    assert [r["vs_base"] for r in doc["bench"]] == [1.0, 2.0, None, None]
    assert doc["complete"] is True and list(doc) == ["date", "ceilings", "bench", "complete"]
    assert json.loads(out.read_text()) == doc


def test_ratio_column_pairs_rows_of_one_cell_with_its_baseline():
    rows = [{"cell": 1, "impl": "cf", "ms": 4.0}, {"cell": 1, "impl": "peer", "ms": 2.0},
            {"cell": 2, "impl": "cf", "ms": 1.0}, {"cell": 2, "impl": "peer", "ms": None},
            {"cell": 3, "impl": "cf", "ms": None}, {"cell": 3, "impl": "peer", "ms": 1.0}]
    bench_main.ratio_column(rows, "vs_peer", lambda r: r["cell"], lambda r: r["impl"] == "peer")
    assert [r["vs_peer"] for r in rows] == [0.5, 1.0, None, None, None, 1.0]  # a baseline later in the list counts
    bench_main.ratio_column(rows, "vs_peer", lambda r: r["cell"], lambda r: r["impl"] == "peer",
                            applies=lambda r: r["impl"] == "cf")
    assert [r["vs_peer"] for r in rows] == [0.5, None, None, None, None, None]
    assert bench_main.dash(None, ".3f") == "-" and bench_main.dash(0.0, ".3f") == "-"
    assert bench_main.dash(1.23456, ".3f") == "1.235"


@pytest.mark.parametrize("script, runner, own_fields, ratio", [
    ("head_dim_v", "HeadDimV", ("dv",), "vs_cudnn"),
    ("options", "Options", ("option",), "vs_plain"),
    ("fp8_decode", "Fp8Decode", (), "vs_bf16"),
    ("fp8_band", "Fp8Band", (), "vs_dense"),
])
def test_benchmark_scripts_run_their_cases_through_bench_main(tmp_path, monkeypatch, capsys, script, runner,
                                                              own_fields, ratio):
    """Each script's main with a stand-in runner (no torch, no GPU): every case runs, the second
    one's failure is a cuflash "error" row with the script's own fields, and the JSON and the
    table hold every row."""
    mod = load_benchmark(script)
    cells = []

    class StandIn:
        def __init__(self, timer, flex=True):
            pass

        def cell(self, case, *args):
            rows = next(a for a in args if isinstance(a, list))
            cells.append((case, *args[:len(own_fields)]))
            if len(cells) == 2:
                raise RuntimeError("no kernel")
            rows.append(mod.record(case, "cuflash", "ok", 1.0, **dict(zip(own_fields, args))))

    monkeypatch.setattr(mod, "Timer", lambda *args, **kwargs: None)
    monkeypatch.setattr(mod, runner, StandIn)
    monkeypatch.setattr(mod, "measure_ceilings", lambda timer: {"copy_tbps": 3.0, "read_tbps": 4.0}, raising=False)
    monkeypatch.setattr(bench_main, "free_device_memory", lambda: None)
    out = tmp_path / f"{script}.json"
    assert mod.main(["--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    rows = doc["bench"]
    assert doc["complete"] is True and len(rows) == len(cells) > 2
    failed = rows[1]
    assert (failed["impl"], failed["status"], failed["reason"], failed["ms"]) == (
        "cuflash", "error", "RuntimeError: no kernel", None)
    assert tuple(failed[f] for f in own_fields) == cells[1][1:]
    assert all(ratio in r for r in rows)
    table = capsys.readouterr().out.splitlines()
    assert len(table) == len(rows) + (script == "fp8_decode")  # (+ the copy and read rates)
    assert "error RuntimeError: no kernel" in table[-len(rows) + 1]


def test_mla_decode_counts_the_cache_once_against_the_copy_rate(tmp_path, monkeypatch, capsys):
    """benchmarks/mla_decode.py with a stand-in runner: a row's TB/s counts each 576-wide cache row
    once (V is read from K's rows) plus q and o, its TFLOP/s Q K^T over 576 and P V over 512, and
    of_copy divides by the copy rate of the same run; a failing cell is an error row."""
    mod = load_benchmark("mla_decode")
    seen = []

    class StandIn:
        def __init__(self, timer, ceilings):
            self.ceilings = ceilings

        def cell(self, case, rows):
            seen.append(case)
            if len(seen) == 2:
                raise RuntimeError("no kernel")
            rows.append(mod.row(case, "ok", 2.0, self.ceilings))

    monkeypatch.setattr(mod, "Timer", lambda *args, **kwargs: None)
    monkeypatch.setattr(mod, "MlaDecode", StandIn)
    monkeypatch.setattr(mod, "measure_ceilings", lambda timer: {"copy_tbps": 4.0, "matmul_tflops": 900.0})
    monkeypatch.setattr(bench_main, "free_device_memory", lambda: None)
    out = tmp_path / "mla.json"
    assert mod.main(["--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    rows = doc["bench"]
    assert doc["complete"] is True and len(rows) == len(seen) == len(mod.plan()) > 2
    assert (rows[1]["status"], rows[1]["reason"], rows[1]["ms"]) == ("error", "RuntimeError: no kernel", None)
    first = rows[0]
    b, h, n = first["b"], first["hq"], first["nk"]
    assert (first["d"], first["dv"], first["hkv"], first["nq"]) == (576, 512, 1, 1)
    assert first["tbps"] == pytest.approx(2 * (b * n * 576 + b * h * (576 + 512)) / 2e-3 / 1e12)
    assert first["tflops"] == pytest.approx(2 * b * h * n * (576 + 512) / 2e-3 / 1e12)
    assert first["of_copy"] == pytest.approx(first["tbps"] / 4.0)
    assert "error RuntimeError: no kernel" in capsys.readouterr().out


# ---------------------------------------------------------------------------------------------
# asv suites


def test_asv_suites_skip_without_a_gpu():
    bench = load(ROOT / "benchmarks" / "benchmarks" / "bench_attention.py", "bench_attention_under_test")
    try:
        import cupy

        has_gpu = cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        has_gpu = False
    if has_gpu:
        pytest.skip("a GPU is present: the suites would run rather than skip")
    for suite, params in ((bench.CuflashForward, (1024, 64, False, "bfloat16")),
                          (bench.CuflashBackward, (1024, 64, True, "float16")),
                          (bench.CuflashDecode, (4096, "8x32x8")),
                          (bench.CuflashPagedDecode, (4096, "8x32x8", 64)),
                          (bench.CuflashWindowForward, (4096, 128, "bfloat16")),
                          (bench.CuflashForwardFloat32, (1024, 128, True, "float32")),
                          (bench.CuflashBackwardFloat32, (1024, 64, False, "float32")),
                          (bench.CuflashDecodeGraph, (4096, "8x32x8"))):
        with pytest.raises(NotImplementedError):
            suite().setup(*params)
    # The reference skips where S and P would not fit, before it looks for a GPU.
    with pytest.raises(NotImplementedError, match="GB"):
        bench.ReferenceForward().setup(16384, 64, False, "bfloat16")
    assert bench.stable_seed(1024, 64, True, "bfloat16") == bench.stable_seed(1024, 64, True, "bfloat16")


def test_asv_config_is_what_asv_reads():
    config = pytest.importorskip("asv.config")
    here = ROOT / "benchmarks"  # asv is run from here; its paths are relative to it
    conf = config.Config.load(str(here / "asv.conf.json"))
    assert conf.environment_type == "existing"
    assert (here / conf.repo).resolve() == ROOT
    assert (here / conf.benchmark_dir).resolve() == (here / "benchmarks").resolve()
    assert (here / conf.results_dir).resolve() == (here / "results" / "asv").resolve()
    assert (here / conf.results_dir).resolve() == asv_regressions.DEFAULT_RESULTS


# ---------------------------------------------------------------------------------------------
# tools/asv_regressions.py on asv 0.6 result files

COLUMNS = ["result", "params", "version", "started_at", "duration", "stats_ci_99_a", "stats_ci_99_b",
           "stats_q_25", "stats_q_75", "stats_number", "stats_repeat", "samples", "profile"]
PARAMS = [["1024", "4096"], ["'bfloat16'"]]
TIME = "bench_attention.CuflashForward.time_forward"
PEAK = "bench_attention.CuflashForward.track_peak_bytes"


def write_machine(root, machine="h200"):
    d = root / machine
    d.mkdir(parents=True)
    (d / "machine.json").write_text(json.dumps({"machine": machine, "version": 1}))
    return d


def write_result(machine_dir, commit, date, started, times, peaks, version="v1", samples=None):
    """One result file as asv 0.6's Results.save writes it (columns trimmed of trailing Nones);
    samples: per parameter combination, the timed samples (asv run --record-samples)."""
    def row(values, unit_stats):
        r = [values, PARAMS, version, started, 1.5]
        if unit_stats and values is not None:
            r += [[v * 0.9 if v == v else None for v in values], [v * 1.1 if v == v else None for v in values],
                  values, values, [1] * len(values), [10] * len(values)]
            if samples is not None:
                r.append(samples)
        return r

    env = "existing-py_usr_bin_python3"
    data = {"commit_hash": commit, "env_name": env, "date": date,
            "params": {"machine": machine_dir.name, "python": "3.12"}, "python": "3.12",
            "requirements": {}, "env_vars": {}, "result_columns": COLUMNS,
            "results": {TIME: row(times, True), PEAK: row(peaks, False)},
            "durations": {"<build>": 0.0}, "version": 2}
    path = machine_dir / f"{commit[:8]}-{env}.json"
    path.write_text(json.dumps(data))  # NaN for skipped results, as asv's json writer does
    return path


OLD, NEW, OLDEST = "a" * 40, "1" * 40, "f" * 40  # file names sort opposite to commit dates


def check(results, *args):
    proc = subprocess.run([sys.executable, str(REGRESSIONS), "--results", str(results), *args],
                          capture_output=True, text=True, timeout=60)
    return proc.returncode, proc.stdout + proc.stderr


def test_regressions_exit_1_when_the_latest_commit_is_slower(tmp_path):
    d = write_machine(tmp_path)
    write_result(d, OLDEST, 1000, 1100, [9.0e-3, 9.0e-3], [100, 100])  # ignored: not one of the last two
    write_result(d, OLD, 2000, 2100, [1.0e-3, 4.0e-3], [100, 200])
    write_result(d, NEW, 3000, 3100, [1.2e-3, 4.0e-3], [100, 200])
    rc, out = check(tmp_path)
    assert rc == 1, out
    assert f"old {OLD[:8]} -> new {NEW[:8]}" in out
    slow = [line for line in out.splitlines() if line.startswith("+")]
    assert len(slow) == 1 and "time_forward(1024, 'bfloat16')" in slow[0] and "1.20" in slow[0]
    assert check(tmp_path, "--factor", "1.25")[0] == 0  # a 20% slowdown is within x1.25


def test_regressions_exit_0_without_slowdown(tmp_path):
    d = write_machine(tmp_path)
    write_result(d, OLD, 2000, 2100, [1.0e-3, 4.0e-3], [100, 200])
    write_result(d, NEW, 3000, 3100, [1.05e-3, 3.0e-3], [100, float("nan")])  # +5%, faster, skipped
    rc, out = check(tmp_path, "--machine", "h200")
    assert rc == 0, out
    assert "no regression" in out
    assert any(line.startswith("-") and "time_forward(4096" in line for line in out.splitlines())


def test_regressions_memory_growth_and_new_failures_count(tmp_path):
    d = write_machine(tmp_path)
    write_result(d, OLD, 2000, 2100, [1.0e-3, 4.0e-3], [100, 200])
    write_result(d, NEW, 3000, 3100, [1.0e-3, 4.0e-3], [100, 300])  # peak bytes x1.5
    assert check(tmp_path)[0] == 1
    d2 = write_machine(tmp_path / "b")
    write_result(d2, OLD, 2000, 2100, [1.0e-3, 4.0e-3], [100, 200])
    write_result(d2, NEW, 3000, 3100, None, [100, 200])  # the timed suite fails now
    rc, out = check(tmp_path / "b")
    assert rc == 1 and "failed" in out


def test_regressions_order_ties_by_run_time_and_ignore_changed_code(tmp_path):
    d = write_machine(tmp_path)
    # Same commit date (asv records the commit's date): the run that started later is newer.
    write_result(d, NEW, 2000, 2500, [1.0e-3, 4.0e-3], [100, 200])
    write_result(d, OLD, 2000, 2100, [2.0e-3, 4.0e-3], [100, 200])
    assert asv_regressions.latest_two_commits(asv_regressions.load_runs(d)) == [OLD, NEW]
    assert check(tmp_path)[0] == 0  # new is faster
    # A benchmark whose code changed (new version hash) is shown, not judged.
    write_result(d, NEW, 2000, 2500, [9.0e-3, 4.0e-3], [100, 200], version="v2")
    rc, out = check(tmp_path)
    assert rc == 0 and any(line.startswith("x") for line in out.splitlines())


def timing_samples(rng, median, n=20, noise=0.02):
    """n timings around a median: multiplicative normal noise plus, now and then, a preempted
    (slow) sample, as real timings look."""
    out = median * (1.0 + noise * rng.standard_normal(n))
    slow = rng.random(n) < 0.1
    out[slow] *= 1.0 + rng.random(slow.sum())
    return [float(x) for x in out]


def history(tmp_path, rng, old_median, new_median):
    d = write_machine(tmp_path)
    old = [timing_samples(rng, m) for m in old_median]
    new = [timing_samples(rng, m) for m in new_median]
    med = lambda s: [float(np.median(x)) for x in s]  # noqa: E731
    write_result(d, OLD, 2000, 2100, med(old), [100, 200], samples=old)
    write_result(d, NEW, 3000, 3100, med(new), [100, 200], samples=new)
    return d


def check_here(capsys, results):
    """check() in this process (the synthetic-history loops would start a process per history)."""
    rc = asv_regressions.main(["--results", str(results)])
    return rc, capsys.readouterr().out


def test_regressions_rank_test_flags_a_real_5_percent_slowdown(tmp_path, capsys):
    """With asv's samples (20 a side, as the suites take), a 5% slowdown of one benchmark under 2%
    noise with occasional preempted samples is flagged, and only that benchmark, in at least 19 of
    20 synthetic histories (the test's power there is about 97%; the seed is fixed)."""
    rng = np.random.default_rng(0)
    flagged = 0
    for trial in range(20):
        history(tmp_path / str(trial), rng, [1.0e-3, 4.0e-3], [1.05e-3, 4.0e-3])
        rc, out = check_here(capsys, tmp_path / str(trial))
        slow = [line for line in out.splitlines() if line.startswith("+")]
        assert all("time_forward(1024," in line for line in slow), out
        flagged += rc == 1 and len(slow) == 1
    assert flagged >= 19, flagged


def test_regressions_rank_test_leaves_noise_alone(tmp_path, capsys):
    """Samples of one distribution (2% noise, occasional preempted samples) are not a regression
    in any of 40 synthetic histories."""
    rng = np.random.default_rng(1)
    for trial in range(40):
        history(tmp_path / str(trial), rng, [1.0e-3, 4.0e-3], [1.0e-3, 4.0e-3])
        rc, out = check_here(capsys, tmp_path / str(trial))
        assert rc == 0, out


def test_regressions_rank_test_needs_significance_not_just_a_large_median(tmp_path):
    """A median 10% higher from three samples that overlap the old ones is not significant."""
    d = write_machine(tmp_path)
    old = [[1.0e-3, 1.2e-3, 0.9e-3], [4e-3, 4e-3, 4e-3]]
    new = [[1.1e-3, 0.95e-3, 1.25e-3], [4e-3, 4e-3, 4e-3]]
    write_result(d, OLD, 2000, 2100, [1.0e-3, 4.0e-3], [100, 200], samples=old)
    write_result(d, NEW, 3000, 3100, [1.1e-3, 4.0e-3], [100, 200], samples=new)
    rc, out = check(tmp_path)
    assert rc == 0, out
    mark, ratio = asv_regressions.shift(old[0], new[0], 0.01, 0.03)
    assert mark == " " and ratio == pytest.approx(1.1)


def test_regressions_usage_errors(tmp_path):
    assert check(tmp_path / "missing")[0] == 2
    write_machine(tmp_path, "h200")
    write_machine(tmp_path, "other")
    assert check(tmp_path)[0] == 2  # two machines and no --machine
    assert check(tmp_path, "--machine", "h200", "--alpha", "1.5")[0] == 2
    assert check(tmp_path, "--machine", "h200", "--min-effect", "-0.1")[0] == 2
    rc, out = check(tmp_path, "--machine", "h200")
    assert rc == 0 and "nothing to compare" in out


def test_synthetic_results_are_read_by_asv_itself(tmp_path):
    results = pytest.importorskip("asv.results")
    d = write_machine(tmp_path)
    path = write_result(d, NEW, 3000, 3100, [1.0e-3, float("nan")], [100, 200])
    loaded = results.Results.load(str(path), machine_name="h200")
    assert loaded.commit_hash == NEW
    assert loaded.get_result_value(TIME, PARAMS)[0] == 1.0e-3
    assert math.isnan(loaded.get_result_value(TIME, PARAMS)[1])
    assert loaded.get_result_value(PEAK, PARAMS) == [100, 200]
    assert loaded.benchmark_version[TIME] == "v1"


def test_asv_check_passes_without_a_gpu():
    """`asv check` (the benchmark suites import and are well formed), as CI runs it."""
    pytest.importorskip("asv")
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "asv", "check", "-E", f"existing:{sys.executable}"],
                          cwd=ROOT / "benchmarks", capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def test_committed_h200_history_is_readable():
    """The committed asv results hold at least three commits on the h200 machine."""
    runs = asv_regressions.load_runs(asv_regressions.DEFAULT_RESULTS / "h200")
    commits = {r["commit_hash"] for r in runs}
    assert len(commits) >= 3, commits
    for r in runs:  # every commit recorded real timings of cuflash's forward, not only skips
        # (the suite's forward was track_gpu_ms before asv's own timer, time_forward, replaced it)
        name = next(f"bench_attention.CuflashForward.{n}" for n in ("time_forward", "track_gpu_ms")
                    if f"bench_attention.CuflashForward.{n}" in r["results"])
        times = columns(r, name)["result"]
        assert times and all(t is not None and t > 0 for t in times), (r["commit_hash"], times)


def test_committed_history_spans_the_project_and_tracks_the_shipped_kernels():
    """The h100 history holds at least 12 commits, all but the first (whose forward fails on this
    grid) with cuflash forward times, and the newest commit recorded on either card (a run takes
    the H100 or the H200 that is free) has the kernels and the dispatch that ship: every change to
    cuda_src/ or cuflash/plan/ lands with its asv run (hunks of whole comment lines aside: they
    change no kernel and no dispatch)."""
    runs = asv_regressions.load_runs(asv_regressions.DEFAULT_RESULTS / "h100")
    timed = [r for r in runs if any(v is not None and v == v for v in
                                    columns(r, "bench_attention.CuflashForward.time_forward").get("result") or [])]
    assert len({r["commit_hash"] for r in runs}) >= 12, len(runs)
    assert len({r["commit_hash"] for r in timed}) >= 11, len(timed)
    every_card = runs + asv_regressions.load_runs(asv_regressions.DEFAULT_RESULTS / "h200")
    newest = asv_regressions.latest_two_commits(every_card)[-1]
    if not (ROOT / ".git").exists():
        pytest.skip("no .git: cannot compare the newest recorded commit with HEAD")
    known = subprocess.run(["git", "cat-file", "-e", f"{newest}^{{commit}}"], cwd=ROOT, capture_output=True)
    if known.returncode != 0:
        pytest.skip(f"{newest[:8]} is not in this clone (shallow?)")
    # comment lines: // in the CUDA sources (where a line starting with # is a directive: #define,
    # #pragma unroll, #include change the kernels), # in the Python dispatch
    diff = "".join(subprocess.run(["git", "diff", "--stat", f"--ignore-matching-lines={comment}", newest, "HEAD", "--",
                                   path], cwd=ROOT, capture_output=True, text=True, check=True).stdout
                   for path, comment in (("cuda_src", r"^\s*//"), ("cuflash/plan", r"^\s*#")))
    assert diff == "", f"kernels or dispatch changed since the newest asv run ({newest[:8]}):\n{diff}"


def columns(data, name):
    return asv_regressions.columns(data, name)


# ---------------------------------------------------------------------------------------------
# peak_live_bytes (the asv suites' and peers.py's peak memory of a call), on the device


@pytest.mark.gpu
def test_peak_live_bytes_counts_what_the_call_holds():
    cupy = pytest.importorskip("cupy")
    bench = load(ROOT / "benchmarks" / "benchmarks" / "bench_attention.py", "bench_attention_under_test")
    keep = cupy.empty(8 << 20, dtype=cupy.uint8)  # a live array: the pool keeps its chunk
    del keep
    held = cupy.empty(3 << 20, dtype=cupy.uint8)  # lands in the freed chunk, which stays mapped

    def call():
        a = cupy.empty(1 << 20, dtype=cupy.uint8)
        b = cupy.empty(3 << 20, dtype=cupy.uint8)  # a + b live: 4 MiB
        del a
        c = cupy.empty(512 << 10, dtype=cupy.uint8)
        del b
        return c  # the result stays live

    result, peak = bench.peak_live_bytes(cupy, call)
    assert peak == (1 << 20) + (3 << 20)
    assert result.nbytes == 512 << 10
    _, peak_after = bench.peak_live_bytes(cupy, lambda: cupy.empty(100, dtype=cupy.float32))
    assert peak_after == 400  # requested bytes, not the pool's 512-byte rounding
    del held


@pytest.mark.gpu
def test_event_ms_times_the_device_not_the_host():
    """event_ms hides the host's time before the launch behind its GPU spin: a call that spends
    0.5 ms on the host before a copy of a few microseconds reads far below 0.5 ms, while a call
    whose device work is long reads that work."""
    import time

    cupy = pytest.importorskip("cupy")
    bench = load(ROOT / "benchmarks" / "benchmarks" / "bench_attention.py", "bench_attention_under_test")
    small = cupy.ones(1 << 16, dtype=cupy.float32)
    spin = cupy.RawKernel(bench._SPIN, "spin")

    def host_then_copy():
        time.sleep(0.0005)
        small.copy()

    assert bench.event_ms(cupy, host_then_copy, repeats=7) < 0.2
    long_device = bench.event_ms(cupy, lambda: spin((1,), (1,), (np.int64(bench.EVENT_SPIN_CYCLES),)), repeats=5)
    assert 0.3 < long_device < 10.0  # 2M cycles: about 1 ms at 2 GHz (6 ms at a 345 MHz idle clock), measured, not hidden


# ---------------------------------------------------------------------------------------------
# tools/grid_table.py: per-cell ratios over passes and the bar verdicts


def _bench_row(op, impl, ms, d=64, n=1024, causal=False, b=16, hq=32, hkv=32, dtype="bfloat16", status="ok"):
    return {"op": op, "impl": impl, "ms": ms, "d": d, "nq": 1 if op == "decode" else n, "nk": n,
            "causal": causal, "b": b, "hq": hq, "hkv": hkv, "dtype": dtype, "status": status}


def test_grid_table_verdicts_over_passes(tmp_path):
    def pass_file(name, fwd_cf, bwd_cf, dec_a, dec_b):
        rows = [_bench_row("fwd", "torch-cudnn", 1.0), _bench_row("fwd", "cuflash", fwd_cf),
                _bench_row("bwd", "torch-cudnn", 1.0, d=128), _bench_row("bwd", "cuflash", bwd_cf, d=128),
                _bench_row("bwd", "torch-cudnn", 1.0, d=256), _bench_row("bwd", "cuflash", 2.0, d=256),
                # two decode cells that differ only in batch and K/V heads stay two cells
                _bench_row("decode", "torch-cudnn", 1.0, d=128, b=8, hkv=8), _bench_row("decode", "cuflash", dec_a, d=128, b=8, hkv=8),
                _bench_row("decode", "torch-cudnn", 1.0, d=128, b=64, hkv=8),
                _bench_row("decode", "cuflash", dec_b, d=128, b=64, hkv=8),
                # MQA (outside the decode grid): listed with its ratio, no verdict, not counted
                _bench_row("decode", "torch-cudnn", 1.0, d=128, b=8, hq=64, hkv=1),
                _bench_row("decode", "cuflash", 2.0, d=128, b=8, hq=64, hkv=1),
                _bench_row("fwd", "cuflash", 0.5, n=2048, status="mismatch"),  # never counted
                _bench_row("fwd", "torch-cudnn", 1.0, n=2048)]
        path = tmp_path / name
        path.write_text(json.dumps({"bench": rows}))
        return str(path)

    a = pass_file("a.json", 1 / 1.06, 1 / 1.04, 1 / 1.01, 1 / 0.99)
    b = pass_file("b.json", 1 / 1.07, 1 / 1.06, 1 / 1.02, 1 / 0.98)
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "grid_table.py"), a, b],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    lines = {tuple(line.split()[:5]): line for line in proc.stdout.splitlines() if line[:3] in ("fwd", "bwd", "dec")}
    assert lines[("fwd", "bfloat16", "64", "1024", "full")].split()[-2] == "met"      # 1.06, 1.07
    assert lines[("bwd", "bfloat16", "128", "1024", "full")].split()[-2] == "split"   # 1.04, 1.06
    assert lines[("bwd", "bfloat16", "256", "1024", "full")].split()[-2] == "-"       # outside the bar
    decode = [line for line in proc.stdout.splitlines() if line.startswith("decode")]
    assert len(decode) == 3  # keyed by batch and heads too
    assert any("B8 H64/1" in line and line.split()[-2] == "-" for line in decode)  # outside the grid
    assert any("B8 H32/8" in line and " met " in line for line in decode)            # 1.01, 1.02 >= 1.0
    assert any("B64 H32/8" in line and " short " in line for line in decode)         # 0.99, 0.98
    assert ("fwd", "bfloat16", "64", "2048", "full") not in lines  # a mismatching result is no ratio
    assert "4 cells under the bar" in proc.stdout and "met in every pass by 2" in proc.stdout


# ---------------------------------------------------------------------------------------------
# tools/decode_cells.ProbeCase.alternate: the decode probes' rounds (no GPU: a stand-in case)


def test_probe_rounds_alternate_the_order_and_report_x_the_faster_peer(capsys):
    cells = load(ROOT / "tools" / "decode_cells.py", "decode_cells_under_test")
    order = []

    class Case(cells.ProbeCase):
        def __init__(self):  # (no tensors: the peers' times are fixed)
            pass

        def peer_us(self, timer, peer):
            order.append(peer)
            return {"cudnn": 20.0, "flash": 10.0}[peer]

    def variant(name, us):
        return lambda: order.append(name) or us

    rounds = Case().alternate(None, {"a": variant("a", 5.0), "b": variant("b", "wrong 0.5")}, 3, "B1",
                              plans={"a": "4x1024"})
    assert order == ["cudnn", "flash", "a", "b", "cudnn", "flash", "b", "a", "cudnn", "flash", "a", "b"]
    assert rounds == [{"cudnn": 20.0, "flash": 10.0, "a": 5.0, "b": "wrong 0.5"}] * 3
    lines = capsys.readouterr().out.splitlines()
    assert lines[1] == "B1 pass 1: cudnn 20.0 flash 10.0 us | a [4x1024] 2.000, b wrong 0.5"


def test_fp8_band_compares_rates_of_the_same_head_dim_and_mask():
    band = load_benchmark("fp8_band")
    rows = [{"d": 128, "causal": False, "shape": "dense", "tflops_exact": 800.0},
            {"d": 128, "causal": False, "shape": "window (1024, 0)", "tflops_exact": 600.0},
            {"d": 128, "causal": True, "shape": "packed 8 x 2048", "tflops_exact": 500.0},
            {"d": 128, "causal": True, "shape": "dense", "tflops_exact": 1000.0},
            {"d": 256, "causal": False, "shape": "packed 8 x 2048", "tflops_exact": 900.0},
            {"d": 128, "causal": False, "shape": "packed 32 x 512", "tflops_exact": None}]
    band.add_ratios(rows)
    assert [r["vs_dense"] for r in rows] == [1.0, 0.75, 0.5, 1.0, None, None]
    # every case's exact count: 4 * visible pairs * d, the packing's and the window's own
    cases = {c.what + (" causal" if c.causal else ""): c for c in band.plan(ds=(64,))}
    n, h = band.TOKENS, band.HEADS
    assert band.exact_flops(cases["dense"]) == 4 * h * n * n * 64
    assert band.exact_flops(cases["dense causal"]) == 4 * h * (n * (n + 1) // 2) * 64
    s = 8
    cu = list(range(0, n + 1, n // s))
    assert band.exact_flops(cases["packed 8 x 2048"], cu) == 4 * h * s * (n // s) ** 2 * 64
    w = 1024
    pairs = sum(min(i, w) + 1 for i in range(n))
    assert band.exact_flops(cases["window (1024, 0)"]) == 4 * h * pairs * 64
