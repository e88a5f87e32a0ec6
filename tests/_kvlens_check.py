"""Shared check for kv_lens results: each sequence is its own problem over its first kv_lens[b] keys."""


from cuflash.testing import assert_forward_accurate, to_numpy

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
        assert o.dtype == dtype
        try:
            assert_forward_accurate(o[b : b + 1], lse[b : b + 1], qb, kb, vb, **masking)
        except AssertionError as exc:
            raise AssertionError(f"sequence {b} (kv_lens {n}): {exc}") from exc
