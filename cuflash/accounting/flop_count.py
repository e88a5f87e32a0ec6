"""FLOPs of a pass: the exact count over the visible pairs, next to the peers' dense-equivalent."""

from __future__ import annotations

from dataclasses import dataclass

from ..core import masks
from .arguments import PASSES, check_choice, check_int
from .pairs import pairs_per_head, sequence_lengths


FWD_PRODUCTS = "S = Q K^T and O = P V"
BWD_PRODUCTS = "S = Q K^T (recomputed), dP = dO V^T, dV += P^T dO, dQ += dS K, dK += dS^T Q"
_EXACT_PER_PAIR = {"fwd": 4, "bwd": 10, "fwd+bwd": 14}  # 2 FLOPs per multiply-add per product
_DENSE_FACTOR_X2 = {"fwd": 2, "bwd": 5, "fwd+bwd": 7}  # (4, 10, 14) * pairs / 2: bwd 2.5x, fwd+bwd 3.5x


@dataclass(frozen=True)
class FlopCount:
    """Exact arithmetic of one attention pass, next to the peers' dense-equivalent figure."""

    pass_: str
    pairs: int  # exact visible (query, key) pairs, summed over sequences and query heads
    head_dim: int
    flops: int  # exact: products' multiply-adds over the visible pairs, 2 FLOPs each
    dense_equivalent: int  # peers' convention (see dense_convention)
    convention: str
    dense_convention: str
    # score modifiers' elementwise operations over the visible pairs (not in flops, like the
    # softmax): a softcap's tanh (and in the backward its derivative), ALiBi's bias FMA
    elementwise: int = 0

    def tflops_per_s(self, seconds: float) -> float:
        """Exact FLOPs per second in TFLOP/s (the figure to quote for this kernel)."""
        return self.flops / float(seconds) / 1e12

    def dense_tflops_per_s(self, seconds: float) -> float:
        """Peers' dense-equivalent TFLOP/s, comparable with their published tables."""
        return self.dense_equivalent / float(seconds) / 1e12

    def __str__(self):
        return (f"{self.pass_}: pairs={self.pairs:,} flops={self.flops:,} [{self.convention}]; "
                f"dense-equivalent={self.dense_equivalent:,} [{self.dense_convention}]")


def flops(q_shape, k_shape, *, causal=False, window=None, kv_lens=None, cu_seqlens_q=None,
          cu_seqlens_k=None, layout="bhsd", pass_="fwd", softcap=None, alibi_slopes=None, sinks=None,
          dv=None) -> FlopCount:
    """Exact pair and FLOP counts of attention over q of ``q_shape`` and k, v of ``k_shape``.

    Shapes are (..., H, N, d) (``layout="bhsd"``), (..., N, H, d) (``"bshd"``) or (N, d); with
    ``cu_seqlens_q``/``cu_seqlens_k`` (varlen, B + 1 cumulative offsets each) they are packed
    (total, H, d). ``kv_lens`` gives each sequence's valid key count (a KV cache filled to that
    length): its mask is that of a (Nq, kv_lens[b]) problem, bottom-right causal alignment
    included. ``window=(left, right)``: FlashAttention's sliding window, -1 = unbounded, as
    defined by :func:`cuflash.core.masks.row_bounds` (the backends' definition).

    Exact: forward 4 * pairs * d (S = QK^T and O = PV, 2 FLOPs per multiply-add), backward
    10 * pairs * d (S recomputed, dP, dV, dQ, dK), "fwd+bwd" 14 * pairs * d. Softmax, scaling and
    masking are not counted. dense_equivalent is the peers' 4 * B * H * Nq * Nk * d, halved when
    causal, ignoring windows (backward 2.5x that): use it only to compare with their tables.

    ``dv``: v's (and o's) head dim where it differs from q's and k's d. Products over d: S and, in
    the backward, dQ and dK; over dv: O = P V and, in the backward, dP and dV. Forward
    2 * pairs * (d + dv), backward 2 * pairs * (3 d + 2 dv), "fwd+bwd" 2 * pairs * (4 d + 3 dv).
    The dense equivalent then counts (d + dv) / 2 for d.

    The counts depend on no dtype: float8_e4m3fn q, k, v (the e4m3 forward, pass_="fwd") multiply
    the same products over the same visible pairs, 4 * pairs * d.

    Score modifiers (any value but None turns one on; only whether it is given matters) change no
    product: ``elementwise`` counts their work per visible pair apart - the softcap 1 tanh forward,
    2 backward (the tanh recomputed and the derivative 1 - tanh^2 applied to dS), ALiBi 1 fused
    multiply-add each pass - one operation each. Sinks add one term per row (not counted).
    """
    check_choice("pass_", pass_, PASSES)
    causal = masks.normalize_causal(causal)
    window = masks.normalize_window(window)
    batch, hq, _, d, lengths = sequence_lengths(q_shape, k_shape, layout, kv_lens, cu_seqlens_q, cu_seqlens_k)
    dv = d if dv is None else check_int("dv", dv, minimum=1)
    pairs = hq * sum(n * pairs_per_head(causal, nq, nk, window) for (nq, nk), n in lengths.items())
    dense_pairs = hq * sum(n * nq * nk for (nq, nk), n in lengths.items())
    # exact integers when d + dv is even (always when dv = d): the causal halving and the 2.5x / 3.5x.
    dense = _DENSE_FACTOR_X2[pass_] * dense_pairs * (d + dv) * (1 if causal else 2) // 2
    products = {"fwd": FWD_PRODUCTS, "bwd": BWD_PRODUCTS, "fwd+bwd": f"{FWD_PRODUCTS}; {BWD_PRODUCTS}"}[pass_]
    conv = (f"exact: {_EXACT_PER_PAIR[pass_]}*pairs*d = 2 FLOPs per multiply-add of {products}, over the "
            "visible (query, key) pairs only; softmax, scaling and masking not counted")
    dconv = ("peers' dense-equivalent: 4*H*d*sum_b(Nq_b*Nk_b)"
             + (", halved for causal" if causal else "")
             + {"fwd": "", "bwd": ", x2.5 for the backward", "fwd+bwd": ", x3.5 for fwd+bwd"}[pass_]
             + ("; window ignored by this convention (the exact count applies it)" if window is not None else "")
             + ("; Nk_b = kv_lens[b]" if kv_lens is not None else ""))
    per_pair = {"fwd": 0, "bwd": 0}
    if softcap is not None:
        per_pair["fwd"] += 1
        per_pair["bwd"] += 2
    if alibi_slopes is not None:
        per_pair["fwd"] += 1
        per_pair["bwd"] += 1
    elementwise = pairs * {"fwd": per_pair["fwd"], "bwd": per_pair["bwd"], "fwd+bwd": sum(per_pair.values())}[pass_]
    if elementwise:
        conv += "; score modifiers: elementwise, counted apart"
    if dv != d:
        conv = conv.replace(f"{_EXACT_PER_PAIR[pass_]}*pairs*d", {"fwd": "2*pairs*(d+dv)", "bwd": "2*pairs*(3d+2dv)",
                                                                   "fwd+bwd": "2*pairs*(4d+3dv)"}[pass_])
    exact = 2 * pairs * {"fwd": d + dv, "bwd": 3 * d + 2 * dv, "fwd+bwd": 4 * d + 3 * dv}[pass_]
    return FlopCount(pass_, pairs, d, exact, dense, conv, dconv, elementwise)
