"""What a wheel holds: every subpackage of cuflash and every kernel source file (pyproject.toml's
packages and package-data, read the way setuptools reads them), so that a non-editable install
compiles the same kernels as a checkout."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")

ROOT = Path(__file__).resolve().parents[1]


def _setuptools():
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def test_every_subpackage_is_listed():
    listed = set(_setuptools()["packages"])
    found = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "cuflash").rglob("__init__.py")}
    assert found - listed == set(), f"not in pyproject.toml's packages: {sorted(found - listed)}"


def test_every_kernel_source_is_package_data():
    st = _setuptools()
    src = ROOT / st["package-dir"]["cuflash.cuda_src"]
    # setuptools matches each pattern against paths relative to the package directory (glob rules:
    # "*.cuh" does not reach a subdirectory)
    shipped = {p for pattern in st["package-data"]["cuflash.cuda_src"] for p in src.glob(pattern)}
    files = {p for p in src.rglob("*") if p.is_file()}
    assert len(files) > 20
    missing = sorted(str(p.relative_to(src)) for p in files - shipped)
    assert missing == [], f"kernel sources a wheel would leave out: {missing}"


def test_the_wheel_installs_and_compiles_a_hopper_kernel(tmp_path):
    """The wheel as a user installs it, outside this checkout: it imports from its own copy and
    compiles a Hopper kernel (whose headers live in cuda_src/hopper/) with NVRTC, no GPU needed."""
    pytest.importorskip("setuptools", minversion="68")  # the build backend pyproject.toml names
    # built from a copy of what a source distribution holds: a build/ left in the checkout would
    # put its files into the wheel whatever package-data says
    src, wheels, target = tmp_path / "src", tmp_path / "wheels", tmp_path / "site"
    for name in ("cuflash", "cuda_src"):
        shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, src / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(wheels),
                    str(src)], check=True, capture_output=True, cwd=tmp_path)
    (wheel,) = wheels.glob("cuflash-*.whl")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), str(wheel)],
                   check=True, capture_output=True, cwd=tmp_path)
    probe = ("import cuflash, sys\n"
             "assert cuflash.__file__.startswith(sys.argv[1]), cuflash.__file__\n"
             "from cuflash.plan import hopper\n"
             "from cuflash.kernels import build\n"
             "try:\n"
             "    from cuda.bindings import nvrtc  # noqa: F401\n"
             "except ImportError:\n"
             "    sys.exit(3)\n"
             "spec = hopper.all_hopper_forward_specs()[0]\n"
             "print(spec.short_name, build.compile_offline(spec).registers)\n")
    env = dict(os.environ, PYTHONPATH=str(target))
    r = subprocess.run([sys.executable, "-c", probe, str(target)], capture_output=True, text=True, cwd=tmp_path, env=env)
    if r.returncode == 3:
        if os.environ.get("CUFLASH_REQUIRE_NVRTC") == "1":
            pytest.fail("NVRTC is required (CUFLASH_REQUIRE_NVRTC=1) but cuda.bindings is not installed")
        pytest.skip("cuda.bindings NVRTC not installed: the import was checked, the compile was not")
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.startswith("attn_fwd_wgmma"), r.stdout
