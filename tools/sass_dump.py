"""Normalized SASS of kernel instantiations, compiled for sm_90a by NVRTC exactly as at run time
(no GPU needed; cuobjdump from the CUDA toolkit or triton's copy on PATH). Run it before and
after an edit and diff the outputs to show which instantiations' code changed:

    python tools/sass_dump.py attn_bwd_wgmma.cu 'attn_bwd_kv_wgmma_tma<Bf16, 128, 64, 2, false, true>' ... > a.txt
"""
import re
import shutil
import subprocess
import sys
import tempfile

sys.path.insert(0, ".")
from cuda.bindings import nvrtc  # noqa: E402

from cuflash.kernels import build


def cubin(source, expression):
    src = build.load_source(source).encode()
    _, prog = nvrtc.nvrtcCreateProgram(src, source.encode(), 0, [], [])
    try:
        nvrtc.nvrtcAddNameExpression(prog, expression.encode())
        opts = [o.encode() for o in build.BASE_OPTIONS + ("-arch=sm_90a",)]
        (err,) = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
        if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            raise SystemExit(f"{expression}: NVRTC failed")
        _, n = nvrtc.nvrtcGetCUBINSize(prog)
        buf = b" " * n
        nvrtc.nvrtcGetCUBIN(prog, buf)
        return buf
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


def main():
    tool = shutil.which("cuobjdump")
    if tool is None:
        raise SystemExit("cuobjdump not on PATH (CUDA toolkit, or triton/backends/nvidia/bin)")
    source, exprs = sys.argv[1], sys.argv[2:]
    for e in exprs:
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(cubin(source, e))
            f.flush()
            out = subprocess.run([tool, "-sass", f.name], capture_output=True, text=True, check=True).stdout
        # instruction lines only, addresses and encodings dropped
        ins = [re.sub(r"/\*[0-9a-f]+\*/", "", line).strip() for line in out.splitlines()
               if re.match(r"\s+/\*[0-9a-f]{4,}\*/", line)]
        print("##", e, len(ins))
        print("\n".join(ins))


if __name__ == "__main__":
    main()
