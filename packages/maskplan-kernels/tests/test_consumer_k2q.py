"""Host-side checks of maskplan_kernels.consumer_k2q's plain integer helpers (no GPU)."""

import pytest

pytest.importorskip("cutlass.cute")

from maskplan_kernels.consumer_k2q import grouped_launch_slot  # noqa: E402


def launch_order(kv_heads, k_rows, group):
    return [grouped_launch_slot(i, kv_heads, k_rows, group) for i in range(kv_heads * k_rows)]


@pytest.mark.parametrize("kv_heads,k_rows", [(1, 7), (5, 3), (16, 128), (6, 1)])
@pytest.mark.parametrize("group", [1, 2, 3, 4, 16, 64])
def test_grouped_launch_order_covers_every_cta_once_lower_rows_first(kv_heads, k_rows, group):
    order = launch_order(kv_heads, k_rows, group)
    assert sorted(order) == [(r, h) for r in range(k_rows) for h in range(kv_heads)]
    for h in range(kv_heads):
        # a head's CTAs launch by ascending K row: a deterministic turnstile only waits on lower rows
        assert [r for r, head in order if head == h] == list(range(k_rows))


def test_grouped_launch_order_spans_heads_major_to_rows_major():
    kv_heads, k_rows = 5, 4
    heads_major = [(i // kv_heads, i % kv_heads) for i in range(kv_heads * k_rows)]
    rows_major = [(i % k_rows, i // k_rows) for i in range(kv_heads * k_rows)]
    assert launch_order(kv_heads, k_rows, kv_heads) == heads_major
    assert launch_order(kv_heads, k_rows, 8) == heads_major
    assert launch_order(kv_heads, k_rows, 1) == rows_major
    # two heads at a time, the last group holds the fifth head alone
    assert launch_order(kv_heads, k_rows, 2)[:4] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert launch_order(kv_heads, k_rows, 2)[16:] == [(0, 4), (1, 4), (2, 4), (3, 4)]
