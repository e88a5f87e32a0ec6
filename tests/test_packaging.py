"""What a wheel holds: every subpackage of cuflash and every kernel source file (pyproject.toml's
packages and package-data, read the way setuptools reads them), so that a non-editable install
compiles the same kernels as a checkout."""

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
