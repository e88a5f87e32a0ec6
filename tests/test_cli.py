"""The command line: `python -m cuflash demo` on the CPU, argument errors, delegated commands."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import cuflash
from cuflash.cli import main as cli
from cuflash.core import masks

from conftest import gpu_unavailable_reason  # tests/ is on sys.path (rootdir-relative import mode)

ROOT = Path(__file__).resolve().parents[1]


def run_cli(*args, timeout=240):
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-m", "cuflash", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT, env=env)


def brute_force_pairs(causal, nq, nk):
    """Visible pairs counted one by one from the mask rule (independent of pair_count's closed form)."""
    off = masks.causal_offset(causal, nq, nk)
    return sum(1 for i in range(nq) for j in range(nk) if off is None or j <= i + off)


def test_demo_on_cpu_prints_backend_and_flops():
    b, h, n, d = 1, 2, 64, 32
    res = run_cli("demo", "--backend", "cpu", "--b", str(b), "--h", str(h), "--n", str(n), "--d", str(d))
    assert res.returncode == 0, res.stdout + res.stderr
    assert "backend  cpu" in res.stdout
    assert f"FLOPs    {4 * n * n * d * b * h} " in res.stdout
    assert "PASSED" in res.stdout


@pytest.mark.parametrize(
    ("dtype", "causal", "h", "hkv", "n", "nk"),
    [("float16", "bottom_right", 4, 2, 64, 100), ("bfloat16", "top_left", 2, 1, 96, 64),
     ("float32", None, 3, 3, 40, 72)],
)
def test_demo_json_accounting(dtype, causal, h, hkv, n, nk):
    b, d = 2, 64
    args = ["demo", "--backend", "cpu", "--json", "--dtype", dtype, "--b", str(b), "--h", str(h),
            "--hkv", str(hkv), "--n", str(n), "--nk", str(nk), "--d", str(d), "--repeats", "1", "--warmup", "0"]
    if causal:
        args += ["--causal", causal]
    res = run_cli(*args)
    assert res.returncode == 0, res.stdout + res.stderr
    out = json.loads(res.stdout)
    assert out["backend"] == "cpu"
    assert out["causal"] == causal
    assert out["check"]["passed"] is True
    pairs = brute_force_pairs(causal, n, nk)
    assert out["pairs_per_head"] == pairs
    assert out["flops"] == 4 * pairs * d * b * h
    itemsize = {"float16": 2, "bfloat16": 2, "float32": 4}[dtype]
    assert out["bytes"]["inputs"] == (b * h * n * d + 2 * b * hkv * nk * d) * itemsize
    assert out["bytes"]["outputs"] == b * h * n * d * itemsize
    assert out["bytes"]["lse"] == b * h * n * 4
    assert out["seconds"] > 0


def test_bare_causal_flag_means_bottom_right():
    res = run_cli("demo", "--backend", "cpu", "--json", "--causal", "--n", "32", "--nk", "48", "--h", "1",
                  "--repeats", "1", "--warmup", "0")
    assert res.returncode == 0, res.stdout + res.stderr
    out = json.loads(res.stdout)
    assert out["causal"] == "bottom_right"
    assert out["pairs_per_head"] == brute_force_pairs("bottom_right", 32, 48)


def test_demo_auto_picks_the_available_backend():
    res = run_cli("demo", "--json", "--b", "1", "--h", "2", "--n", "64", "--d", "64", "--repeats", "1")
    assert res.returncode == 0, res.stdout + res.stderr
    expected = "cpu" if gpu_unavailable_reason() else "gpu"
    assert json.loads(res.stdout)["backend"] == expected


@pytest.mark.parametrize(
    "args",
    [
        [],
        ["nonsense"],
        ["demo", "--dtype", "float64"],
        ["demo", "--n", "0"],
        ["demo", "--n", "abc"],
        ["demo", "--d", "-4"],
        ["demo", "--backend", "tpu"],
        ["demo", "--causal", "diagonal"],
        ["demo", "--h", "4", "--hkv", "3", "--n", "16"],
    ],
    ids=lambda a: " ".join(a) or "no-args",
)
def test_bad_arguments_exit_nonzero(args):
    res = run_cli(*args)
    assert res.returncode != 0
    assert res.stderr.strip(), "a bad argument must say what is wrong"


def test_gpu_backend_without_a_gpu_exits_nonzero():
    if gpu_unavailable_reason() is None:
        pytest.skip("a GPU is available here")
    res = run_cli("demo", "--backend", "gpu", "--n", "16")
    assert res.returncode != 0
    assert "--backend gpu" in res.stderr


def test_demo_fails_when_the_result_is_wrong(monkeypatch, capsys):
    """The check is real: a corrupted output makes the demo exit non-zero."""
    real = cuflash.attention

    def off_by_a_bit(*args, **kwargs):
        o, lse = real(*args, **kwargs)
        o = o.copy()
        o[..., 0, 0] += np.asarray(0.25, dtype=o.dtype)
        return o, lse

    monkeypatch.setattr(cli, "attention", off_by_a_bit)
    rc = cli.main(["demo", "--backend", "cpu", "--n", "32", "--h", "1", "--repeats", "1", "--warmup", "0"])
    assert rc == 1
    assert "FAILED" in capsys.readouterr().out


def test_report_is_delegated():
    res = run_cli("report", "--help")
    assert res.returncode == 0, res.stdout + res.stderr
    assert "usage" in res.stdout.lower()


def test_console_script_is_installed():
    script = Path(sys.executable).parent / "cuflash"
    if not script.exists():
        pytest.skip("cuflash is not pip-installed in this environment (no console script)")
    res = subprocess.run([str(script), "demo", "--backend", "cpu", "--n", "16", "--h", "1", "--repeats", "1"],
                         capture_output=True, text=True, timeout=240)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "backend  cpu" in res.stdout


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("causal", [None, "bottom_right"])
def test_demo_on_gpu(dtype, causal):
    args = ["demo", "--backend", "gpu", "--json", "--dtype", dtype, "--b", "2", "--h", "4", "--hkv", "2",
            "--n", "300", "--nk", "520", "--d", "64", "--repeats", "3"]
    if causal:
        args += ["--causal", causal]
    res = run_cli(*args)
    assert res.returncode == 0, res.stdout + res.stderr
    out = json.loads(res.stdout)
    assert out["backend"] == "gpu"
    assert out["check"]["passed"] is True
    assert out["flops"] == 4 * brute_force_pairs(causal, 300, 520) * 64 * 2 * 4
