"""cuflash: exact, dense, tiled attention for CuPy (CUDA kernels via NVRTC) and NumPy."""

from .accounting import flops, io_model, memory_report
from .api.functional import attention, attention_backward, attention_vjp, prepare_attention
from .api.merge import merge_attention_states
from .autotune import tune
from .core.version import __version__

__all__ = ["attention", "attention_backward", "attention_vjp", "merge_attention_states", "prepare_attention", "flops", "memory_report", "io_model", "tune", "__version__"]
