"""Host-side checks of maskplan_kernels.consumer_k2q's plain integer helpers (no GPU)."""

import pytest

pytest.importorskip("cutlass.cute")

from maskplan_kernels.consumer_k2q import grouped_launch_slot  # noqa: E402


def launch_order(kv_heads, k_rows, group, rows_descending=False):
    slots = range(kv_heads * k_rows)
    return [grouped_launch_slot(i, kv_heads, k_rows, group, rows_descending) for i in slots]


@pytest.mark.parametrize("kv_heads,k_rows", [(1, 7), (5, 3), (16, 128), (6, 1)])
@pytest.mark.parametrize("group", [1, 2, 3, 4, 16, 64])
@pytest.mark.parametrize("rows_descending", [False, True], ids=["ascending", "descending"])
def test_grouped_launch_order_covers_every_cta_once_in_row_order(kv_heads, k_rows, group, rows_descending):
    order = launch_order(kv_heads, k_rows, group, rows_descending)
    assert sorted(order) == [(r, h) for r in range(k_rows) for h in range(kv_heads)]
    rows = list(range(k_rows))[:: -1 if rows_descending else 1]
    for h in range(kv_heads):
        # a head's CTAs launch by ascending K row (descending in the mirrored order): a turnstile only
        # waits on the rows its ranks put first
        assert [r for r, head in order if head == h] == rows
    # the mirrored order is the other one with each row r read as k_rows - 1 - r
    other = launch_order(kv_heads, k_rows, group, not rows_descending)
    assert order == [(k_rows - 1 - r, h) for r, h in other]


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
