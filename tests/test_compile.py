"""Compile every kernel instantiation the package can launch for sm_90a with NVRTC (no GPU needed).

Each instantiation must compile, and must not spill: spills and a stack frame turn register
traffic into local-memory traffic in the inner loop. The specs come from cuflash.plan.registry,
the one list of kernel families the dispatch can launch, so a new family is checked as soon as the
registry lists it.
"""

from __future__ import annotations

import os
import re
import shutil

import pytest

from cuflash.core import sources
from cuflash.kernels import build as _build
from cuflash.plan import registry

ARCH = "sm_90a"


def _spec_lists():
    """(family, function) for each kernel family of the registry."""
    return sorted(registry.FAMILIES.items())


def _spec_params():
    """One pytest.param per instantiation; a list that fails to build becomes a failing test."""
    params, seen = [], set()
    lists = _spec_lists()
    if "forward" not in dict(lists):  # else this file checks nothing
        params.append(pytest.param(None, LookupError("the registry lists no forward family"), id="forward-missing"))
    for list_name, make in lists:
        if isinstance(make, Exception):
            params.append(pytest.param(None, make, id=list_name))
            continue
        try:
            specs = list(make())
        except Exception as exc:  # noqa: BLE001 - reported by the test below, not hidden
            params.append(pytest.param(None, exc, id=f"{list_name}-failed"))
            continue
        if not specs:
            params.append(pytest.param(None, ValueError(f"{list_name}() returned no specs"), id=f"{list_name}-empty"))
        for spec in specs:
            if spec.short_name in seen:
                continue
            seen.add(spec.short_name)
            params.append(pytest.param(spec, None, id=spec.short_name))
    return params


def _nvrtc_or_skip():
    """Skip when cuda.bindings' NVRTC is missing, unless CI said it must be there."""
    try:
        from cuda.bindings import nvrtc

        err, _, _ = nvrtc.nvrtcVersion()
        if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            raise RuntimeError(f"nvrtcVersion: {err}")
    except Exception as exc:  # ImportError, or libnvrtc not found at first call
        if os.environ.get("CUFLASH_REQUIRE_NVRTC") == "1":
            pytest.fail(f"NVRTC is required (CUFLASH_REQUIRE_NVRTC=1) but unusable: {exc!r}")
        pytest.skip(f"cuda.bindings NVRTC not usable: {exc!r} (pip install -e '.[test]')")


_PARAMS = _spec_params()
_REPORTS: dict = {}


def _report(spec):
    """All instantiations are compiled once, batched per source and spread over the cores
    (_build.compile_offline_many); each test then reads its own instantiation's report."""
    if not _REPORTS:
        specs = [p.values[0] for p in _PARAMS if p.values[0] is not None]
        _REPORTS.update(_build.compile_offline_many(specs, ARCH))
    result = _REPORTS[spec.short_name]
    if isinstance(result, Exception):
        raise result  # CompileError carries NVRTC's log
    return result


@pytest.mark.parametrize(("spec", "enumeration_error"), _PARAMS)
def test_instantiation_compiles_without_spills(spec, enumeration_error):
    if enumeration_error is not None:
        raise enumeration_error
    _nvrtc_or_skip()
    report = _report(spec)
    assert report.registers > 0, f"{spec.short_name}: ptxas reported no registers:\n{report.log}"
    assert (report.stack_bytes, report.spill_stores, report.spill_loads) == (0, 0, 0), (
        f"{spec.short_name} on {ARCH}: {report.registers} registers, {report.stack_bytes} bytes stack frame, "
        f"{report.spill_stores} bytes spill stores, {report.spill_loads} bytes spill loads"
    )


# every code ptxas gives a serialization (C7511 registers, C7520 a divergent path to a wgmma, ...)
# and any other message that says so (not C7517 / C7519: a wait or arrive it injected, no serialization)
_WGMMA_SERIALIZED = re.compile(r"C75(?:08|11|12|14|15|18|20)\b[^\n]*|wgmma\.mma_async instructions are serialized[^\n]*")


@pytest.mark.parametrize(("spec", "enumeration_error"),
                         [p for p in _PARAMS if p.values[0] is not None
                          and p.values[0].source in ("attn_fwd_wgmma.cu", "attn_bwd_wgmma.cu")])
def test_wgmma_kernels_are_not_serialized(spec, enumeration_error):
    # ptxas warns (C7514/C7515, C7508) when a branch around a wgmma or its wait, or a group in
    # flight across a back edge, makes it serialize every wgmma of the kernel (C7518: a wait it
    # injected itself landed in a divergent path), and (C7511, C7512) when
    # the registers run short for the accumulators in flight:
    # the code still runs, only slower, so the spill check above would not notice. Specs of one
    # source share an NVRTC program (and its log): a warning anywhere in it fails them all.
    _nvrtc_or_skip()
    found = _WGMMA_SERIALIZED.findall(_report(spec).log)
    assert not found, f"{spec.short_name}: ptxas serialized wgmma:\n" + "\n".join(
        m.group(0) for m in _WGMMA_SERIALIZED.finditer(_report(spec).log))


# ---- header inlining: the text CuPy hashes for its cache must change with every header ----

_LOCAL_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)


def _kernel_files():
    return sorted(p.name for p in sources.source_dir().glob("*.cu"))


def _headers_reached(root, name, seen=None):
    seen = set() if seen is None else seen
    for inc in _LOCAL_INCLUDE.findall((root / name).read_text()):
        if inc not in seen:
            seen.add(inc)
            _headers_reached(root, inc, seen)
    return seen


@pytest.fixture
def source_copy(tmp_path, monkeypatch):
    """A private copy of cuda_src that _build reads instead of the real one."""
    copy = tmp_path / "cuda_src"
    shutil.copytree(sources.source_dir(), copy)
    sources.load_source.cache_clear()
    monkeypatch.setattr(sources, "source_dir", lambda: copy)
    yield copy
    sources.load_source.cache_clear()  # the next test must read the real sources again


def _header_cases():
    root = sources.source_dir()
    return [(kernel, header) for kernel in _kernel_files() for header in sorted(_headers_reached(root, kernel))]


@pytest.mark.parametrize(("kernel", "header"), _header_cases())
def test_editing_a_header_changes_the_source_hash(source_copy, kernel, header):
    before = sources.source_hash(kernel)
    inlined = sources.load_source(kernel)
    assert not _LOCAL_INCLUDE.search(inlined), f"{kernel}: a local #include survived inlining"

    marker = f"__cuflash_test_marker_{header.replace('.', '_')}"
    with open(source_copy / header, "a") as f:
        f.write(f"\n#define {marker} 1\n")
    sources.load_source.cache_clear()

    after_text = sources.load_source(kernel)
    assert marker in after_text, f"{kernel}: the edit of {header} is not in the inlined source"
    assert after_text.count(marker) == 1, f"{kernel}: {header} was inlined more than once"
    assert sources.source_hash(kernel) != before, f"{kernel}: editing {header} left the source hash unchanged"


def test_header_cases_exist():
    # Guards the parametrization above: an empty list would silently test nothing.
    assert _header_cases(), "no kernel includes a local header: the inlining test checks nothing"
