"""cuflash: exact, dense, tiled attention for CuPy (CUDA kernels via NVRTC) and NumPy."""

from .api.functional import attention, attention_backward, attention_vjp
from .api.prepared import prepare_attention
from .accounting import flops, io_model, memory_report
from .tune import tune

__version__ = "0.1.0"
__all__ = ["attention", "attention_backward", "attention_vjp", "prepare_attention", "flops", "memory_report", "io_model", "tune", "__version__"]
