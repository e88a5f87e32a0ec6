"""Shared check for kv_lens results: each sequence is its own problem over its first kv_lens[b] keys."""

import numpy as np

from cuflash.testing import assert_lse_within_bound, assert_within_rule, faithful_attention, lse_bound, reference64, to_numpy

from _brute_mask import brute_visible


def check_per_sequence(o, lse, q, k, v, lens, causal, dtype, window=None):
    """window: sequence b's visibility is the brute-force mask over its own kv_lens[b] keys."""
    o, lse = to_numpy(o), to_numpy(lse)
    q, k, v = (to_numpy(a) for a in (q, k, v))
    for b, n in enumerate(lens):
        n = int(n)
        qb, kb, vb = q[b : b + 1], k[b : b + 1, :, :n], v[b : b + 1, :, :n]
        masking = (dict(causal=causal) if window is None
                   else dict(mask=brute_visible(causal, window, q.shape[2], n)))
        ref_o, ref_l = reference64(qb, kb, vb, **masking)
        yard_o, _ = faithful_attention(qb, kb, vb, **masking)
        assert_within_rule(f"o[seq {b}, len {n}]", o[b : b + 1], ref_o, yard_o, dtype)
        assert_lse_within_bound(f"lse[seq {b}, len {n}]", lse[b : b + 1], ref_l, lse_bound(qb, kb, vb, **masking))
