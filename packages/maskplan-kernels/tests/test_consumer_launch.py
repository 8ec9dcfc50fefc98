"""Host-side checks of maskplan_kernels.consumer_launch that need no GPU."""

from types import SimpleNamespace

import pytest

pytest.importorskip("cutlass.cute")

from maskplan_core.errors import UnsupportedConfigError  # noqa: E402
from maskplan_kernels.consumer_launch import INT32_LIMIT, require_int32_offsets  # noqa: E402


def geometry(total_q, total_k, hq=16, hkv=16, dqk=128, dv=128):
    return SimpleNamespace(
        total_q=total_q, total_k=total_k, num_heads_q=hq, num_heads_kv=hkv, head_dim_qk=dqk, head_dim_v=dv
    )


def test_int32_offsets_accept_the_largest_tensors_that_fit():
    tokens = (INT32_LIMIT - 1) // (16 * 128)  # q/out and k/v just below 2**31 elements
    require_int32_offsets(geometry(tokens, tokens))
    require_int32_offsets(geometry(1024, 1024), dq_accum_rows=1024)
    with pytest.raises(UnsupportedConfigError, match="q/out"):  # the larger head dim counts
        require_int32_offsets(geometry(tokens, 1024, dqk=256, dv=128))


@pytest.mark.parametrize(
    "g,rows,name",
    [
        (geometry(2**20, 1024), None, "q/out"),  # 2**20 tokens x 16 heads x 128 = 2**31
        (geometry(1024, 2**21, hkv=8), None, "k/v"),
        (geometry(2**20 - 64, 1024), 2**20, "the dQ accumulator"),  # padding rows push it over
    ],
)
def test_int32_offsets_refuse_tensors_that_would_wrap(g, rows, name):
    with pytest.raises(UnsupportedConfigError, match=f"{name} holds .* 32-bit offsets"):
        require_int32_offsets(g, dq_accum_rows=rows)
