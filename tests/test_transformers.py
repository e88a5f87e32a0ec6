"""A real model on cuflash: a small Llama built from a transformers config (random weights, no
download), run with cuflash as its attention function (``cuflash.torch.register_transformers``)
and with torch SDPA.

The rule (the project's, at model level): the float64 reference is the same model with the same
weights in float64 with SDPA; the yardstick is the model in the working dtype with torch's own SDPA.
cuflash's logits and gradients must be within 2 x the yardstick's error + one rounding of the
largest reference value (cuflash.testing.assert_within_rule). Both runs share every other layer,
so the bound measures what swapping the attention does to the model's accuracy."""

from __future__ import annotations

import copy
import inspect

import numpy as np
import pytest

from cuflash.testing import assert_within_rule

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.models.llama")
import cuflash.torch as cft  # noqa: E402

NAME = cft.register_transformers()


def _config(**kw):
    from transformers import LlamaConfig

    base = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=64, attention_dropout=0.0)
    base.update(kw)
    return LlamaConfig(**base)


def _models(device, dtype, seed, **kw):
    """(cuflash model, SDPA model, float64 SDPA model): the same random weights."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    # a config each: from_config records the implementation in the config it is given
    sdpa = AutoModelForCausalLM.from_config(_config(**kw), attn_implementation="sdpa")
    ours = AutoModelForCausalLM.from_config(_config(**kw), attn_implementation=NAME)
    ours.load_state_dict(sdpa.state_dict())
    ref = copy.deepcopy(sdpa).to(device, torch.float64)
    models = [m.to(device, dtype).eval() for m in (ours, sdpa)] + [ref.eval()]
    assert models[0].config._attn_implementation == NAME and models[1].config._attn_implementation == "sdpa"
    return models


def _np(t):
    return t.detach().double().cpu().numpy()


def _forward_backward(model, ids):
    model.zero_grad()
    out = model(ids, labels=ids)
    out.loss.backward()
    return _np(out.logits), np.concatenate([_np(p.grad).ravel() for p in model.parameters()])


def _check_forward_backward(device, dtype, np_dtype, seq=13, **kw):
    ours, sdpa, ref = _models(device, dtype, seed=0, **kw)
    ids = torch.randint(0, 96, (2, seq), device=device)
    got, yard, want = (_forward_backward(m, ids) for m in (ours, sdpa, ref))
    assert_within_rule("logits", got[0], want[0], yard[0], np_dtype)
    assert_within_rule("gradients", got[1], want[1], yard[1], np_dtype)
    # per parameter too, each against its own yardstick error
    sizes = [p.numel() for p in ours.parameters()]
    for (name, _), g, y, w in zip(ours.named_parameters(), *(np.split(x[1], np.cumsum(sizes)[:-1])
                                                             for x in (got, yard, want))):
        assert_within_rule(f"grad {name}", g, w, y, np_dtype)


def _cache_kw(model, cache):
    """transformers 5 renamed past_key_values to cache; older versions have only the first."""
    params = inspect.signature(model.forward).parameters
    return {"cache": cache} if "cache" in params else {"past_key_values": cache}


def _decode(model, ids, prefill):
    """Logits of a prefill of ``prefill`` tokens, then of one token at a time through a KV cache."""
    with torch.no_grad():
        out = model(ids[:, :prefill], use_cache=True)
        logits = [_np(out.logits)]
        cache = out.past_key_values
        for i in range(prefill, ids.shape[1]):
            out = model(ids[:, i:i + 1], use_cache=True, **_cache_kw(model, cache))
            cache = out.past_key_values
            logits.append(_np(out.logits))
    return logits


def _check_decode(device, dtype, np_dtype, length=12, prefill=7, **kw):
    ours, sdpa, ref = _models(device, dtype, seed=1, **kw)
    ids = torch.randint(0, 96, (2, length), device=device)
    got, yard, want = (_decode(m, ids, prefill) for m in (ours, sdpa, ref))
    for step, (g, y, w) in enumerate(zip(got, yard, want)):
        assert_within_rule(f"logits of step {step}", g, w, y, np_dtype)


def test_llama_forward_backward_matches_sdpa():
    _check_forward_backward("cpu", torch.float32, np.float32)


def test_llama_decode_with_kv_cache_matches_sdpa():
    _check_decode("cpu", torch.float32, np.float32)


def test_llama_compiles_fullgraph_with_cuflash():
    """torch.compile(fullgraph=True) of the whole model: no graph break, cuflash's operators in
    its graphs, eager's logits and gradients bit for bit."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    graphs = []

    def keep(gm, example_inputs):
        graphs.append(gm)
        return make_boxed_func(gm.forward)

    ours = _models("cpu", torch.float32, seed=4)[0]
    ids = torch.randint(0, 96, (2, 9))
    eager = _forward_backward(ours, ids)
    torch._dynamo.reset()
    compiled = torch.compile(ours, fullgraph=True, backend=aot_autograd(fw_compiler=keep, bw_compiler=keep))
    got = _forward_backward(compiled, ids)
    targets = {str(n.target) for g in graphs for n in g.graph.nodes if n.op == "call_function"}
    assert {"cuflash.attention.default", "cuflash.attention_backward.default"} <= targets
    assert np.array_equal(got[0], eager[0]) and np.array_equal(got[1], eager[1])


def test_padded_batch_is_refused():
    ours = _models("cpu", torch.float32, seed=2)[0]
    ids = torch.randint(0, 96, (2, 6))
    mask = torch.ones(2, 6, dtype=torch.long)
    mask[1, :2] = 0  # left padding
    with torch.no_grad(), pytest.raises(ValueError, match=r"^attention_mask: "):
        ours(ids, attention_mask=mask)


class _Module:
    is_causal = True


def test_attention_function_reads_dense_causal_masks():
    """A dense (B, 1, S, T) mask, as older transformers pass one, is accepted when it is exactly
    the causal pattern (boolean or additive), and refused otherwise."""
    torch.manual_seed(3)
    q, k, v = torch.randn(2, 4, 3, 8), torch.randn(2, 2, 5, 8), torch.randn(2, 2, 5, 8)
    want, _ = cft.transformers_attention(_Module(), q, k, v, None)
    visible = torch.ones(3, 5, dtype=torch.bool).tril(2)  # bottom-right: query i is position i + 2
    for mask in (visible, torch.zeros(3, 5).masked_fill(~visible, float("-inf"))):
        got, weights = cft.transformers_attention(_Module(), q, k, v, mask.expand(2, 1, 3, 5))
        assert weights is None and got.shape == (2, 3, 4, 8) and torch.equal(got, want)
    padded = visible.clone().expand(2, 1, 3, 5).clone()
    padded[1, :, :, 0] = False
    with pytest.raises(ValueError, match=r"^attention_mask: only causal attention without padding"):
        cft.transformers_attention(_Module(), q, k, v, padded)
    with pytest.raises(ValueError, match=r"^dropout:"):
        cft.transformers_attention(_Module(), q, k, v, None, dropout=0.1)
    with pytest.raises(ValueError, match=r"^name: "):
        cft.register_transformers("my_flash")
    # the result is the cuflash call it stands for, in (B, S, H, D)
    assert torch.equal(want, cft.attention(q, k, v, causal=True).transpose(1, 2))


GPU_SIZES = dict(hidden_size=256, intermediate_size=512, max_position_embeddings=512)  # head dim 64


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["f32", "f16", "bf16"])
def test_gpu_llama_forward_backward_matches_sdpa(dtype):
    from cuflash.core.arrays import BFLOAT16

    np_dtype = {torch.float32: np.float32, torch.float16: np.float16, torch.bfloat16: BFLOAT16}[dtype]
    _check_forward_backward("cuda", dtype, np_dtype, seq=100, **GPU_SIZES)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["f16", "bf16"])
def test_gpu_llama_decode_with_kv_cache_matches_sdpa(dtype):
    from cuflash.core.arrays import BFLOAT16

    np_dtype = {torch.float16: np.float16, torch.bfloat16: BFLOAT16}[dtype]
    # a prefill of 300 tokens, then single tokens against >= 300 cached keys: the split-KV decode kernel
    _check_decode("cuda", dtype, np_dtype, length=310, prefill=300, **GPU_SIZES)
