"""Kernel sources -> compiled modules.

Run time: ``cupy.RawModule`` (NVRTC) compiles one template instantiation per module, named through
``name_expressions``, cached per device. Headers are inlined into the source text here, so the text
CuPy hashes for its disk cache contains every header: editing a ``.cuh`` can never serve a stale
kernel.

No GPU: :func:`compile_offline` runs NVRTC through ``cuda.bindings`` for an explicit architecture
with the very same text, options and name expression, and parses ptxas's resource report.
"""

from __future__ import annotations

import re
import threading
from dataclasses import dataclass

from ..core import config
from ..plan.spec import KernelSpec
from ..core.sources import load_source, source_hash  # noqa: F401 - re-exported: tools compile one source by hand

BASE_OPTIONS = ("-std=c++17",)


def arch_options(cc: int) -> tuple[str, ...]:
    # sm_90a unlocks wgmma/setmaxnreg on Hopper; plain sm_XX elsewhere. The debug options
    # (config.nvrtc_options) follow, and are part of every compiled module's cache key.
    arch = "sm_90a" if cc == 90 else f"sm_{cc}"
    return BASE_OPTIONS + (f"-arch={arch}",) + config.nvrtc_options()


_modules: dict = {}
_raw_modules: dict = {}  # the same keys: the RawModule of each kernel (get_module)
_smem_optin: dict = {}  # the same keys: the dynamic shared memory the function is opted in to
_lock = threading.Lock()


def _module_key(device_id: int, spec: KernelSpec) -> tuple:
    # The text's hash (headers inlined) and the options: an edited header or a debug option never
    # serves a module compiled without it.
    return (device_id, spec.source, source_hash(spec.source), spec.expression, config.nvrtc_options())


def get_function(spec: KernelSpec):
    """The compiled cupy RawKernel for spec on the current device (compiled once per device)."""
    import cupy

    dev = cupy.cuda.Device()
    key = _module_key(dev.id, spec)
    fn = _modules.get(key)
    # Two specs may share an expression with different shared memory (a decode tile capped at two
    # blocks per SM asks for more): the opt-in follows the largest asked for so far.
    if fn is not None and (spec.smem_bytes <= 48 * 1024 or spec.smem_bytes <= _smem_optin.get(key, 0)):
        return fn
    with _lock:
        fn = _modules.get(key)
        if fn is None:
            cc = int(dev.compute_capability)
            mod = cupy.RawModule(
                code=load_source(spec.source),
                options=arch_options(cc),
                name_expressions=(spec.expression,),
            )
            fn = mod.get_function(spec.expression)
            _raw_modules[key] = mod
            _modules[key] = fn
        if spec.smem_bytes > max(48 * 1024, _smem_optin.get(key, 0)):
            fn.max_dynamic_shared_size_bytes = spec.smem_bytes
            _smem_optin[key] = spec.smem_bytes
    return fn


def get_module(spec: KernelSpec):
    """The cupy RawModule that holds spec's kernel on the current device (compiled on first use):
    for a diagnostic's __device__ globals (RawModule.get_global)."""
    import cupy

    get_function(spec)
    return _raw_modules[_module_key(cupy.cuda.Device().id, spec)]


@dataclass(frozen=True)
class CompileReport:
    spec: KernelSpec
    arch: str
    registers: int
    stack_bytes: int
    spill_stores: int
    spill_loads: int
    log: str

    @property
    def clean(self) -> bool:
        return self.stack_bytes == 0 and self.spill_stores == 0 and self.spill_loads == 0


class CompileError(RuntimeError):
    pass


def _compile_with_log(prog, arch):
    """Compile an NVRTC program for `arch` with ptxas's resource report; (result, log text)."""
    from cuda.bindings import nvrtc

    opts = [o.encode() for o in BASE_OPTIONS + (f"-arch={arch}", "-Xptxas=-v")]
    (err,) = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
    _, n = nvrtc.nvrtcGetProgramLogSize(prog)
    buf = b" " * n
    nvrtc.nvrtcGetProgramLog(prog, buf)
    return err, buf.decode(errors="replace").rstrip("\x00 \n")


def compile_offline(spec: KernelSpec, arch: str = "sm_90a") -> CompileReport:
    """Compile spec for `arch` with NVRTC (no GPU needed) and read ptxas's resource report."""
    from cuda.bindings import nvrtc

    def check(res, what):
        err = res[0] if isinstance(res, tuple) else res
        if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            raise CompileError(f"{what} failed: {err}")
        return res

    src = load_source(spec.source).encode()
    _, prog = check(nvrtc.nvrtcCreateProgram(src, spec.source.encode(), 0, [], []), "nvrtcCreateProgram")
    try:
        check(nvrtc.nvrtcAddNameExpression(prog, spec.expression.encode()), "nvrtcAddNameExpression")
        err, log = _compile_with_log(prog, arch)
        if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            raise CompileError(f"{spec.short_name}: NVRTC failed:\n{log}")
        _, lowered = check(nvrtc.nvrtcGetLoweredName(prog, spec.expression.encode()), "nvrtcGetLoweredName")
    finally:
        nvrtc.nvrtcDestroyProgram(prog)
    return parse_ptxas_log(spec, arch, log, lowered.decode())


def _compile_group(args):
    """One NVRTC program for several expressions of one source (worker of compile_offline_many)."""
    specs, arch = args
    from cuda.bindings import nvrtc

    src = load_source(specs[0].source).encode()
    err, prog = nvrtc.nvrtcCreateProgram(src, specs[0].source.encode(), 0, [], [])
    try:
        for spec in specs:
            nvrtc.nvrtcAddNameExpression(prog, spec.expression.encode())
        err, log = _compile_with_log(prog, arch)
        if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            return None  # the caller recompiles one by one to attribute the error
        out = {}
        for spec in specs:
            _, lowered = nvrtc.nvrtcGetLoweredName(prog, spec.expression.encode())
            out[spec.short_name] = parse_ptxas_log(spec, arch, log, lowered.decode())
        return out
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


def compile_offline_many(specs, arch: str = "sm_90a", processes: int | None = None, group_size: int = 12):
    """{short_name: CompileReport or CompileError} for many specs, batched and in parallel.

    Specs of one source share NVRTC programs of up to `group_size` name expressions (the same
    text, options and expressions as run time; each instantiation is still its own entry
    function with its own ptxas report), spread over worker processes. A group that fails to
    compile is retried one spec at a time so that each error is attributed to its instantiation.
    """
    import os
    from concurrent.futures import ProcessPoolExecutor

    by_source: dict[str, list] = {}
    for spec in specs:
        by_source.setdefault(spec.source, []).append(spec)
    groups = [(lst[i : i + group_size], arch) for lst in by_source.values() for i in range(0, len(lst), group_size)]
    processes = processes or max(1, min(len(groups), os.cpu_count() or 1))
    results: dict = {}
    if processes > 1:
        import multiprocessing

        with ProcessPoolExecutor(processes, mp_context=multiprocessing.get_context("spawn")) as pool:
            outs = list(pool.map(_compile_group, groups))
    else:
        outs = [_compile_group(g) for g in groups]
    for (group, _), out in zip(groups, outs):
        if out is not None:
            results.update(out)
            continue
        for spec in group:
            try:
                results[spec.short_name] = compile_offline(spec, arch)
            except CompileError as exc:
                results[spec.short_name] = exc
    return results


def parse_ptxas_log(spec, arch, log, mangled) -> CompileReport:
    """Pick the resource lines of one entry function out of a ptxas -v log."""
    lines = log.splitlines()
    start = next((i for i, ln in enumerate(lines) if f"Function properties for {mangled}" in ln), None)
    if start is None:
        raise CompileError(f"{spec.short_name}: no ptxas report for {mangled} in log:\n{log}")
    block = "\n".join(lines[start : start + 4])
    stack = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", block)
    regs = re.search(r"Used (\d+) registers", block)
    if not (stack and regs):
        raise CompileError(f"{spec.short_name}: unreadable ptxas report:\n{block}")
    return CompileReport(spec, arch, int(regs.group(1)), int(stack.group(1)), int(stack.group(2)), int(stack.group(3)), log)
