"""The backward's split of each kv head's q heads over several items (SM90's and SM100's kernels)."""

import pytest

from maskplan_kernels.kv_head_split import kv_head_split


@pytest.mark.parametrize(
    "items,q_per_kv,spread,split",
    [
        (128, 32, 1.0, 8),  # MQA 32/1, B=2 S=8192: 128 (K row, kv head) items for 132 SMs -> 1024
        (128, 32, 2.0, 16),  # ... K rows of uneven length (causal): 12 items per SM -> 2048
        (128, 64, 2.0, 16),  # MQA 64/1
        (256, 16, 1.0, 4),  # GQA 32/2
        (1024, 4, 1.0, 1),  # GQA 32/8: enough items already
        (1024, 4, 2.6, 2),  # ... unless K rows differ in length (documents)
        (10, 6, 2.0, 2),  # the parts must divide the q heads: 6 -> 2 x 3, not 4
        (10, 1, 2.0, 1),  # MHA: nothing to split
    ],
)
def test_kv_head_split(items, q_per_kv, spread, split):
    """How many items the backward splits each kv head's q heads into (132 SMs, an H100's)."""
    assert kv_head_split(items, q_per_kv, 132, spread) == split
