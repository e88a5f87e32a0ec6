"""v's head dim unlike q's and k's on the GPU: the kernels take one head dim, so the narrower side
is zero-padded to the wider (cuflash.backends.cuda._one_width); forward and backward of every
family (16-bit Hopper and mma.sync, windows and score modifiers on the band kernels, packed
sequences, float32), outputs poisoned, against the float64 reference by the accuracy rule."""

import pytest
from _head_dim_v_cases import check_forward_backward, matrix

from cuflash.core.arrays import BFLOAT16

cupy = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu


@matrix
def test_forward_and_backward(rng, dtype, causal, layout, d, dv):
    check_forward_backward(rng, cupy, dtype, layout, causal, d, dv)


@pytest.mark.parametrize("d,dv", [(192, 128), (128, 64)])
def test_long_rows_and_window(rng, d, dv):
    # enough rows for the Hopper kernels' tiles, and the band kernel with a window
    check_forward_backward(rng, cupy, BFLOAT16, "bhsd", True, d, dv, nq=600, nk=700)
    check_forward_backward(rng, cupy, BFLOAT16, "bshd", True, d, dv, window=(100, -1), nq=300, nk=300)
