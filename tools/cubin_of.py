"""The cubin of one kernel instantiation, compiled by NVRTC exactly as cuflash compiles it for sm_90a
(the same source, options and CUFLASH_NVRTC_OPTIONS), so that its SASS can be read where
cuobjdump / nvdisasm exist (a machine with the CUDA toolkit):

    python3 tools/cubin_of.py attn_decode.cu "attn_decode<Bf16, 128, 4, 16, 4, 2, false, true, false, 3>" out.cubin
    cuobjdump -sass out.cubin > out.sass
"""
import sys

sys.path.insert(0, ".")
from cuda.bindings import nvrtc  # noqa: E402

from cuflash.kernels import build


def main(source, expression, out):
    src = build.load_source(source).encode()
    _, prog = nvrtc.nvrtcCreateProgram(src, source.encode(), 0, [], [])
    nvrtc.nvrtcAddNameExpression(prog, expression.encode())
    opts = [o.encode() for o in build.arch_options(90)]
    (err,) = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        _, n = nvrtc.nvrtcGetProgramLogSize(prog)
        log = b" " * n
        nvrtc.nvrtcGetProgramLog(prog, log)
        sys.exit(log.decode(errors="replace"))
    _, lowered = nvrtc.nvrtcGetLoweredName(prog, expression.encode())
    _, n = nvrtc.nvrtcGetCUBINSize(prog)
    buf = b" " * n
    nvrtc.nvrtcGetCUBIN(prog, buf)
    open(out, "wb").write(buf)
    print(lowered.decode())


if __name__ == "__main__":
    main(*sys.argv[1:4])
