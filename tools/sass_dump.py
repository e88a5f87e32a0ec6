"""The machine code of kernel instantiations, compiled for sm_90a by NVRTC exactly as cuflash compiles
them at run time (the same source, options and CUFLASH_NVRTC_OPTIONS; no GPU needed). cuobjdump
comes from the CUDA toolkit on PATH or, failing that, triton's bundled copy.

    # normalized SASS (addresses and encodings dropped) of the instantiations named
    python tools/sass_dump.py attn_bwd_wgmma.cu 'attn_bwd_kv_wgmma_tma<Bf16, 128, 64, 2, false, true>' ... > a.txt

    # one line per instantiation the registry lists for these sources: SASS hash, instruction
    # count, expression. Run before and after an edit and diff: the instantiations whose code changed.
    python tools/sass_dump.py --hashes attn_bwd.cu,attn_fwd.cu > before.txt

    # one instantiation's cubin, for cuobjdump / nvdisasm options of one's own
    python tools/sass_dump.py --cubin out.cubin attn_decode.cu 'attn_decode<Bf16, 128, 4, 16, 4, 2, false, true, false, 3>'
"""
import argparse
import hashlib
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor

sys.path.insert(0, ".")
from cuda.bindings import nvrtc  # noqa: E402

from cuflash.kernels import build  # noqa: E402
from cuflash.plan import registry  # noqa: E402


def cubin(source, expression):
    src = build.load_source(source).encode()
    _, prog = nvrtc.nvrtcCreateProgram(src, source.encode(), 0, [], [])
    try:
        nvrtc.nvrtcAddNameExpression(prog, expression.encode())
        opts = [o.encode() for o in build.arch_options(90)]
        (err,) = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
        if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            _, n = nvrtc.nvrtcGetProgramLogSize(prog)
            log = b" " * n
            nvrtc.nvrtcGetProgramLog(prog, log)
            raise SystemExit(f"{expression}: NVRTC failed\n{log.decode(errors='replace')}")
        _, n = nvrtc.nvrtcGetCUBINSize(prog)
        buf = b" " * n
        nvrtc.nvrtcGetCUBIN(prog, buf)
        return buf
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


def cuobjdump():
    tool = shutil.which("cuobjdump")
    if tool is None and importlib.util.find_spec("triton") is not None:
        bundled = os.path.join(os.path.dirname(importlib.util.find_spec("triton").origin),
                               "backends", "nvidia", "bin", "cuobjdump")
        tool = bundled if os.path.exists(bundled) else None
    if tool is None:
        raise SystemExit("cuobjdump: not on PATH and no triton copy (install the CUDA toolkit or triton)")
    return tool


def sass(source, expression):
    """The instruction lines of one instantiation, addresses and encodings dropped."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin(source, expression))
        f.flush()
        out = subprocess.run([cuobjdump(), "-sass", f.name], capture_output=True, text=True, check=True).stdout
    return [re.sub(r"\s*/\*[^*]*\*/", "", line).strip() for line in out.splitlines()
            if re.match(r"\s+/\*[0-9a-f]{4,}\*/", line)]


def _hash_line(source_expression):
    ins = sass(*source_expression)
    digest = hashlib.sha1("\n".join(ins).encode()).hexdigest()[:12]
    return f"{digest} {len(ins)} {source_expression[1]}"


def registry_instantiations(sources):
    """(source, expression) of every instantiation plan.registry lists for these sources, once each."""
    seen = {}
    for _, make in sorted(registry.FAMILIES.items()):
        for spec in make():
            if spec.source in sources:
                seen.setdefault((spec.source, spec.expression), None)
    return list(seen)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hashes", metavar="SOURCES", help="comma list of sources: hash every registry instantiation")
    ap.add_argument("--cubin", metavar="FILE", help="write the cubin of the one instantiation named")
    ap.add_argument("--jobs", type=int, default=os.cpu_count(), help="compiles at once (--hashes)")
    ap.add_argument("source", nargs="?")
    ap.add_argument("expressions", nargs="*")
    args = ap.parse_args()
    if args.hashes:
        todo = registry_instantiations(set(args.hashes.split(",")))
        if not todo:
            raise SystemExit(f"--hashes: the registry lists no instantiation of {args.hashes}")
        with ProcessPoolExecutor(args.jobs) as ex:
            for line in ex.map(_hash_line, todo):
                print(line, flush=True)
        return
    if not args.source or not args.expressions:
        ap.error("name a source and at least one instantiation (or --hashes)")
    if args.cubin:
        if len(args.expressions) != 1:
            ap.error("--cubin: name one instantiation")
        with open(args.cubin, "wb") as f:
            f.write(cubin(args.source, args.expressions[0]))
        return
    for e in args.expressions:
        ins = sass(args.source, e)
        print("##", e, len(ins))
        print("\n".join(ins))


if __name__ == "__main__":
    main()
