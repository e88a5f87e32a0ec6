"""PyTorch adapter: cuflash as torch custom operators, differentiable and traceable by torch.compile.

Three operators are registered with ``torch.library.custom_op`` under the ``cuflash`` namespace:

* ``cuflash::attention`` - the forward (every option of :func:`cuflash.attention`), returning
  (o, lse); its fake (meta) implementation gives o's and the float32 lse's exact shapes, and
  ``register_autograd`` routes its gradient to
* ``cuflash::attention_backward`` - :func:`cuflash.attention_backward`, returning (dq, dk, dv);
* ``cuflash::attention_out`` - the forward writing o into a caller's tensor (``out=``), returning lse.

Because they are operators, ``torch.compile(fullgraph=True)`` traces a model calling them without
a graph break, and a decode step (``kv_lens`` or ``block_table`` with ``validate=False``, which
reads nothing on the host) can run under ``mode="reduce-overhead"`` (CUDA graphs).

The kernels see the tensors' memory without copies (DLPack / pointers for CUDA tensors, ``.numpy()``
views for CPU tensors, which run the NumPy backend) and run on the tensors' device and on torch's
current stream there (cuflash.api.interop).

Entry points: :func:`attention` (cuflash's arguments), :func:`scaled_dot_product_attention`
(torch's), and :func:`register_transformers` (an attention function for Hugging Face models).

Imported only on request (``import cuflash.torch``): ``import cuflash`` never imports torch.
"""

try:
    import torch
except ImportError as exc:  # pragma: no cover - exercised by the optional-import test
    raise ImportError("cuflash.torch needs PyTorch (pip install torch); cuflash itself does not") from exc

if not hasattr(torch, "library") or not hasattr(torch.library, "custom_op"):  # pragma: no cover
    raise ImportError(f"cuflash.torch needs torch.library.custom_op (torch >= 2.4); this torch is {torch.__version__}")

import numpy as np

from .api import functional as api
from .core import masks, problem

__all__ = ["attention", "scaled_dot_product_attention", "register_transformers", "transformers_attention"]

# Options travel through the operators' schemas as plain values: causal as a string
# ("none" / "bottom_right" / "top_left"), window as an int list or None; the score modifiers
# (softcap a float, ALiBi slopes and sinks float32 tensors) follow them.
_OPTIONS = "str causal, float? scale, str layout, int[]? window, float? softcap, Tensor? alibi_slopes, Tensor? sinks"
# The forward's deterministic is not used by it: it is recorded for the backward of its call.
_FORWARD_ARGS = ("Tensor q, Tensor k, Tensor v, Tensor? kv_lens, Tensor? cu_seqlens_q, Tensor? cu_seqlens_k, "
                 f"int? max_seqlen_q, int? max_seqlen_k, Tensor? block_table, {_OPTIONS}, bool validate")


def _options(causal, scale, layout, window, softcap, alibi_slopes, sinks):
    return dict(causal=None if causal == "none" else causal, scale=scale, layout=layout,
                window=None if window is None else tuple(window), softcap=softcap, alibi_slopes=alibi_slopes,
                sinks=sinks)


def _forward_impl(q, k, v, kv_lens, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, block_table, causal, scale,
                  layout, window, softcap, alibi_slopes, sinks, validate, out=None):
    return api.attention(q, k, v, **_options(causal, scale, layout, window, softcap, alibi_slopes, sinks),
                         return_lse=True, out=out, kv_lens=kv_lens, validate=validate, cu_seqlens_q=cu_seqlens_q,
                         cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
                         block_table=block_table)


def _lse_shape(q, varlen, layout):
    """The float32 lse's shape, as cuflash returns it: (Hq, total_q) packed, (Nq,) for one 2-D
    head, else q's batch shape + (Hq, Nq)."""
    if q.dim() < 2:
        raise ValueError(f"q: expected at least 2 dimensions (N, d) or (..., H, N, d), got shape {tuple(q.shape)}")
    if varlen:
        return (q.shape[1], q.shape[0])
    if q.dim() == 2:
        return (q.shape[0],)
    if layout == "bshd":
        return (*q.shape[:-3], q.shape[-2], q.shape[-3])
    return tuple(q.shape[:-1])


def _lse_like(q, varlen, layout):
    return q.new_empty(_lse_shape(q, varlen, layout), dtype=torch.float32)


# ----------------------------------------------------------------------------- forward


def _attention_op(q, k, v, kv_lens, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, block_table, causal, scale,
                  layout, window, softcap, alibi_slopes, sinks, validate, deterministic):
    return _forward_impl(q, k, v, kv_lens, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, block_table, causal,
                         scale, layout, window, softcap, alibi_slopes, sinks, validate)


_attention = torch.library.custom_op("cuflash::attention", _attention_op, mutates_args=(),
                                     schema=f"({_FORWARD_ARGS}, bool deterministic) -> (Tensor, Tensor)")


@_attention.register_fake
def _attention_fake(q, k, v, kv_lens, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, block_table, causal,
                    scale, layout, window, softcap, alibi_slopes, sinks, validate, deterministic):
    # o: q's shape with v's head dim (which may differ from q's)
    return q.new_empty((*q.shape[:-1], v.shape[-1])), _lse_like(q, cu_seqlens_q is not None, layout)


def _attention_out_op(q, k, v, kv_lens, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, block_table, causal,
                      scale, layout, window, softcap, alibi_slopes, sinks, validate, out):
    return _forward_impl(q, k, v, kv_lens, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, block_table, causal,
                         scale, layout, window, softcap, alibi_slopes, sinks, validate, out=out)[1]


_attention_out = torch.library.custom_op("cuflash::attention_out", _attention_out_op, mutates_args=("out",),
                                         schema=f"({_FORWARD_ARGS}, Tensor(a!) out) -> Tensor")


@_attention_out.register_fake
def _attention_out_fake(q, k, v, kv_lens, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, block_table, causal,
                        scale, layout, window, softcap, alibi_slopes, sinks, validate, out):
    return _lse_like(q, cu_seqlens_q is not None, layout)


# ----------------------------------------------------------------------------- backward


def _no_dsinks(q):
    # The operator's schema has one output list: without sinks, dsinks is an empty float32 tensor.
    return q.new_empty((0,), dtype=torch.float32)


def _backward_op(do, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale, layout,
                 window, softcap, alibi_slopes, sinks, validate, deterministic):
    grads = api.attention_backward(do, q, k, v, o, lse,
                                   **_options(causal, scale, layout, window, softcap, alibi_slopes, sinks),
                                   deterministic=deterministic, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                                   max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, validate=validate)
    return tuple(grads) if sinks is not None else (*grads, _no_dsinks(q))


_backward = torch.library.custom_op(
    "cuflash::attention_backward", _backward_op, mutates_args=(),
    schema=("(Tensor do, Tensor q, Tensor k, Tensor v, Tensor o, Tensor lse, Tensor? cu_seqlens_q, "
            f"Tensor? cu_seqlens_k, int? max_seqlen_q, int? max_seqlen_k, {_OPTIONS}, bool validate, "
            "bool deterministic) -> (Tensor, Tensor, Tensor, Tensor)"))


@_backward.register_fake
def _backward_fake(do, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale, layout,
                   window, softcap, alibi_slopes, sinks, validate, deterministic):
    dsinks = _no_dsinks(q) if sinks is None else sinks.new_empty(sinks.shape, dtype=torch.float32)
    return q.new_empty(q.shape), q.new_empty(k.shape), q.new_empty(v.shape), dsinks


def _setup_context(ctx, inputs, output):
    (q, k, v, kv_lens, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, block_table, causal, scale, layout, window,
     softcap, alibi_slopes, sinks, validate, deterministic) = inputs
    o, lse = output
    ctx.mark_non_differentiable(lse)
    ctx.save_for_backward(q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, alibi_slopes, sinks)
    ctx.max_seqlens = (max_seqlen_q, max_seqlen_k)
    ctx.options = (causal, scale, layout, window, softcap)
    ctx.validate = validate
    ctx.cache_inputs = "kv_lens" if kv_lens is not None else ("block_table" if block_table is not None else None)
    ctx.deterministic = deterministic


def _attention_backward(ctx, do, _dlse):
    if ctx.cache_inputs is not None:  # checked up front by attention(); this guards direct op calls
        raise NotImplementedError(f"{ctx.cache_inputs}: cuflash has no backward for KV-cache calls")
    q, k, v, o, lse, cu_q, cu_k, alibi_slopes, sinks = ctx.saved_tensors
    # The op takes do in q's dtype; one kernel pass yields all the gradients (ALiBi's slopes
    # have none, as in FlashAttention: they are not trained).
    dq, dk, dv, dsinks = _backward(do.to(q.dtype), q, k, v, o, lse, cu_q, cu_k, *ctx.max_seqlens, *ctx.options,
                                   alibi_slopes, sinks, ctx.validate, ctx.deterministic)
    dsinks = None if sinks is None else dsinks.to(sinks.dtype)
    # (one entry per input of the operator: q, k, v, then None for kv_lens ... alibi_slopes, dsinks
    # for sinks, None for validate and deterministic)
    return dq, dk, dv, None, None, None, None, None, None, None, None, None, None, None, None, dsinks, None, None


_attention.register_autograd(_attention_backward, setup_context=_setup_context)


# ----------------------------------------------------------------------------- public functions


def _causal_word(causal):
    return masks.normalize_causal(causal) or "none"


def _window_list(window):
    window = masks.normalize_window(window)
    return None if window is None else list(window)


def _check_tensors(named):
    for name, t in named:
        if t is not None and not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__module__}.{type(t).__name__}")


def attention(q, k, v, *, causal=False, scale=None, layout="bhsd", return_lse=False, out=None, kv_lens=None,
              validate=True, window=None, cu_seqlens_q=None, cu_seqlens_k=None, block_table=None,
              deterministic=False, softcap=None, alibi_slopes=None, sinks=None, max_seqlen_q=None, max_seqlen_k=None):
    """:func:`cuflash.attention` for torch tensors, differentiable and traceable by torch.compile.

    Same arguments and semantics as :func:`cuflash.attention` (causal False / True /
    "bottom_right" / "top_left"; layout "bhsd" / "bshd"; GQA; ``kv_lens``; ``block_table`` paged
    caches; ``cu_seqlens_q`` / ``cu_seqlens_k`` packed sequences with ``max_seqlen_q`` /
    ``max_seqlen_k`` (ints; with validate=False no offset is read on the host, so a CUDA graph can
    capture the call: torch.cuda.graph is tested on the forward); ``window``; ``out=``;
    ``validate``; ``return_lse``; the score modifiers ``softcap``, ``alibi_slopes`` and
    ``sinks``). Returns o (and the float32 lse) as tensors on q's device.

    Gradients flow to whichever of q, k, v require them, with or without ``window`` and
    ``cu_seqlens_*`` (``deterministic`` is then passed to :func:`cuflash.attention_backward`).
    ``kv_lens`` and ``block_table`` calls (KV caches, inference) have no backward: asking for
    one raises ValueError. ``sinks`` (a float32 tensor) gets its gradient when it requires one;
    ``alibi_slopes`` gets none (not trained, as in FlashAttention). lse is returned without a
    gradient. ``out=`` is refused while a
    gradient is needed, as torch's own ``out=`` functions do. Double backward is not supported.
    """
    _check_tensors((("q", q), ("k", k), ("v", v), ("out", out), ("kv_lens", kv_lens), ("cu_seqlens_q", cu_seqlens_q),
                    ("cu_seqlens_k", cu_seqlens_k), ("block_table", block_table), ("alibi_slopes", alibi_slopes),
                    ("sinks", sinks)))
    problem.check_flag("return_lse", return_lse)
    problem.check_flag("validate", validate)
    problem.check_flag("deterministic", deterministic)
    scale = _real_or_none("scale", scale, "a real number")
    softcap = _real_or_none("softcap", softcap, "a real number > 0")
    max_seqlens = problem.check_max_seqlens(max_seqlen_q, max_seqlen_k,
                                            packed=cu_seqlens_q is not None or cu_seqlens_k is not None)
    args = (q, k, v, kv_lens, cu_seqlens_q, cu_seqlens_k, *max_seqlens, block_table, _causal_word(causal), scale,
            layout, _window_list(window), softcap, alibi_slopes, sinks, validate)
    grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad
                                        or (sinks is not None and sinks.requires_grad))
    if grad and (kv_lens is not None or block_table is not None):
        name = "kv_lens" if kv_lens is not None else "block_table"
        raise ValueError(f"{name}: KV-cache calls have no backward; call under torch.no_grad() or detach q, k, v")
    if out is not None:
        if grad:
            raise ValueError("out: a call that needs gradients cannot write into out=; leave it None")
        lse = _attention_out(*args, out)
        return (out, lse) if return_lse else out
    o, lse = _attention(*args, deterministic)
    return (o, lse) if return_lse else o


def _real_or_none(name, value, what):
    """A scalar option as the operators' float (a bool, a string or an array is refused, as cuflash
    refuses them); cuflash checks its value in the call."""
    if value is None:
        return None
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise TypeError(f"{name}: expected {what} or None, got {type(value).__name__}")
    return float(value)


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                                 enable_gqa=False):
    """``torch.nn.functional.scaled_dot_product_attention`` computed by cuflash.

    Same arguments and semantics: (..., H, L, E) tensors, ``is_causal`` aligned top-left (query i
    sees keys j <= i), ``scale`` default 1/sqrt(E), and with ``enable_gqa`` key/value may have
    fewer heads than query (a divisor). Differentiable and traceable like :func:`attention`.
    Not supported, raising ValueError: ``attn_mask`` (cuflash has no dense masks - use
    :func:`attention` with ``kv_lens``, ``window`` or ``cu_seqlens_*``), ``dropout_p > 0``,
    value's head dim differing from query's, and ``is_causal`` together with ``attn_mask``.
    """
    if attn_mask is not None:
        raise ValueError("attn_mask: cuflash has no dense attention masks; use is_causal, or cuflash.torch.attention "
                         "with kv_lens / window / cu_seqlens_q, cu_seqlens_k")
    if isinstance(dropout_p, torch.Tensor) or dropout_p != 0.0:
        raise ValueError(f"dropout_p: cuflash computes attention without dropout; got dropout_p={dropout_p!r}")
    problem.check_flag("is_causal", is_causal)
    problem.check_flag("enable_gqa", enable_gqa)
    _check_tensors((("query", query), ("key", key), ("value", value)))
    if query.dim() >= 3 and key.dim() >= 3 and not enable_gqa and query.shape[-3] != key.shape[-3]:
        raise ValueError(f"key: {key.shape[-3]} heads differ from query's {query.shape[-3]}; pass enable_gqa=True "
                         "for grouped-query attention")
    return attention(query, key, value, causal="top_left" if is_causal else False, scale=scale, layout="bhsd")


# ----------------------------------------------------------------------------- Hugging Face transformers


def _check_causal_mask(mask, nq, nk, window):
    """A dense 4-D mask (older transformers build one for any attention function) is accepted only
    if it is exactly the bottom-right causal pattern (with the window, if any) for every sequence:
    that check reads the mask, one host synchronization per call."""
    if mask.dtype == torch.bool:
        visible = mask
    else:
        visible = mask == 0
    i = torch.arange(nq, device=mask.device)[:, None]
    j = torch.arange(nk, device=mask.device)[None, :]
    want = j <= i + (nk - nq)
    if window is not None:
        want = want & (j >= i + (nk - nq) - window[0])
    visible = visible[..., -nq:, -nk:]
    if visible.shape[-2:] != want.shape or not bool(torch.equal(visible, want.expand_as(visible))):
        raise ValueError("attention_mask: only causal attention without padding is supported by cuflash's attention "
                         "function (padded batches: call cuflash.torch.attention with kv_lens or cu_seqlens_*)")


def transformers_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """An attention function in transformers' ``AttentionInterface`` signature.

    query (B, Hq, S, D), key / value (B, Hkv, T, D) (GQA is left to cuflash); returns
    (attn_output (B, S, Hq, D), None) - no attention weights. Causal modules (``module.is_causal``,
    or the ``is_causal`` keyword) run causal="bottom_right", which is the KV-cache alignment: the S
    new queries are the last S of the T positions. ``sliding_window`` W maps to window=(W - 1, 0);
    ``softcap`` (Gemma-2) and ``s_aux`` (gpt-oss's sinks) map to cuflash's softcap and sinks.
    Padding masks are not supported (ValueError): a 2-D padding mask, or a dense mask that is
    not exactly the causal pattern.
    """
    if dropout:
        raise ValueError(f"dropout: cuflash computes attention without dropout; got {dropout!r} (use model.eval() or "
                         "attention_dropout=0)")
    nq, nk = query.shape[-2], key.shape[-2]
    causal = kwargs.get("is_causal")
    if causal is None:
        causal = getattr(module, "is_causal", True)
    sliding = kwargs.get("sliding_window")
    window = (int(sliding) - 1, -1) if sliding else None
    if window is not None and not causal:
        window = (int(sliding) - 1, int(sliding) - 1)
    if attention_mask is not None:
        if attention_mask.dim() == 2:
            raise ValueError("attention_mask: padded batches are not supported by cuflash's attention function "
                             "(call cuflash.torch.attention with kv_lens or cu_seqlens_*)")
        if not causal:
            raise ValueError("attention_mask: a dense mask on a non-causal module is not supported by cuflash")
        _check_causal_mask(attention_mask, nq, nk, window if causal else None)
    # Gemma-2-style models pass their logit softcap as softcap=, gpt-oss its per-head sinks as
    # s_aux= (cuflash takes sinks in float32; the gradient flows back through the cast).
    sinks = kwargs.get("s_aux")
    o = attention(query, key, value, causal="bottom_right" if causal else False, scale=scaling, layout="bhsd",
                  window=window, softcap=kwargs.get("softcap"), sinks=None if sinks is None else sinks.float())
    return o.transpose(1, 2).contiguous(), None


def register_transformers(name="cuFlash"):
    """Make ``attn_implementation=name`` run cuflash in Hugging Face transformers models.

    Registers :func:`transformers_attention` in ``transformers.AttentionInterface`` and, where
    transformers has ``AttentionMaskInterface``, FlashAttention's mask function for it (None for
    unpadded batches, a 2-D padding mask otherwise, which the attention function refuses). Then
    ``AutoModelForCausalLM.from_config(config, attn_implementation=name)`` (or
    ``model.set_attn_implementation(name)``) uses it. Returns ``name``.

    The name must not contain "flash": transformers treats such names as FlashAttention kernels
    to load (ValueError here instead).
    """
    if not isinstance(name, str) or not name or "flash" in name:
        raise ValueError(f"name: expected a non-empty string without 'flash' (transformers reserves it), got {name!r}")
    try:
        from transformers import AttentionInterface
    except ImportError as exc:
        raise ImportError("register_transformers needs transformers >= 4.48 (AttentionInterface)") from exc
    AttentionInterface.register(name, transformers_attention)
    try:
        from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask
    except ImportError:  # older transformers build dense masks, checked by transformers_attention
        return name
    AttentionMaskInterface.register(name, flash_attention_mask)
    return name
