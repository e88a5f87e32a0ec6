"""PyTorch adapter: ``cuflash.torch.attention``, differentiable through torch.autograd.

The forward is cuflash's forward (``return_lse=True``), the backward is
``cuflash.attention_backward`` from the saved q, k, v, o and lse; both see the tensors' memory
without copies (DLPack for CUDA tensors, ``.numpy()`` views for CPU tensors, which run the NumPy
backend) and run on the tensors' device and on torch's current stream there (see cuflash.api.interop).

Imported only on request (``import cuflash.torch``): ``import cuflash`` never imports torch.
"""

from __future__ import annotations

try:
    import torch
except ImportError as exc:  # pragma: no cover - exercised by the optional-import test
    raise ImportError("cuflash.torch needs PyTorch (pip install torch); cuflash itself does not") from exc

from .api import functional as api

__all__ = ["attention"]


class _CuflashAttention(torch.autograd.Function):
    """o = attention(q, k, v); saves (q, k, v, o, lse) for the backward."""

    @staticmethod
    def forward(ctx, q, k, v, causal, scale, layout):
        o, lse = api.attention(q, k, v, causal=causal, scale=scale, layout=layout, return_lse=True)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.options = {"causal": causal, "scale": scale, "layout": layout}
        return o

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        # One kernel pass yields all three gradients; the ones autograd did not ask for are dropped.
        dq, dk, dv = api.attention_backward(do, q, k, v, o, lse, **ctx.options)
        need = ctx.needs_input_grad
        return (dq if need[0] else None, dk if need[1] else None, dv if need[2] else None, None, None, None)


def attention(q, k, v, *, causal=False, scale=None, layout="bhsd"):
    """``cuflash.attention`` for torch tensors, with gradients for whichever of q, k, v require them.

    Same arguments and semantics as :func:`cuflash.attention` (causal False / True / "bottom_right" /
    "top_left"; ``layout`` "bhsd" or "bshd"; GQA when k, v have fewer heads). Returns o as a tensor
    of q's dtype and device. Under ``torch.no_grad()``, or when no input requires grad, nothing is
    saved for a backward. Double backward is not supported.
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__module__}.{type(t).__name__}")
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return _CuflashAttention.apply(q, k, v, causal, scale, layout)
    return api.attention(q, k, v, causal=causal, scale=scale, layout=layout)
