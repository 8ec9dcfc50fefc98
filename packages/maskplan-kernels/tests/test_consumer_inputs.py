"""Host-side checks of maskplan_kernels.consumer_inputs (the caller's tensors) that need no GPU."""

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("cutlass.cute")

from maskplan_core.errors import InputValueError, UnsupportedConfigError  # noqa: E402
from maskplan_kernels.consumer_inputs import (  # noqa: E402
    FP32_MAX,
    INT32_LIMIT,
    positive_softmax_scale,
    qkv_operands,
    qkv_strides,
    require_int32_offsets,
)


def geometry(total_q, total_k, hq=16, hkv=16, dqk=128, dv=128):
    return SimpleNamespace(
        total_q=total_q, total_k=total_k, num_heads_q=hq, num_heads_kv=hkv, head_dim_qk=dqk, head_dim_v=dv
    )


def view_of(batch, seqlen_q, seqlen_k=None, varlen=False):
    seqlen_k = seqlen_q if seqlen_k is None else seqlen_k
    g = SimpleNamespace(batch=batch, max_seqlen_q=seqlen_q, max_seqlen_k=seqlen_k, varlen=varlen)
    return SimpleNamespace(geometry=g)


def operand(t, granule=None, view=None):
    """``t`` as q, k and v of one call: the one tensor the kernels get, and whether per sample."""
    view = view or view_of(t.shape[0] if t.dim() == 4 else 1, t.shape[-3])
    q, k, v, per_sample = qkv_operands(view, t, t, t, row_granule=granule)
    assert all((x.shape, x.stride()) == (q.shape, q.stride()) for x in (k, v))
    return q, per_sample


def test_strided_views_go_to_the_kernels_as_they_are():
    """Slices of a packed QKV tensor and a transposed BHSD tensor (at B = 1) are read in place, their
    row and head strides passed to the kernels; a size-1 mode's stride is the contiguous one."""
    T, hq, hkv, d = 48, 4, 2, 64
    packed = torch.empty(T, hq + 2 * hkv, d, dtype=torch.bfloat16)
    q, k, v = packed[:, :hq], packed[:, hq : hq + hkv], packed[:, hq + hkv :]
    got = qkv_operands(view_of(1, T), q, k, v, row_granule=None)
    assert all(a is b for a, b in zip(got, (q, k, v, False), strict=True))
    width = (hq + 2 * hkv) * d
    assert qkv_strides(q, k, v, 1, False) == (width, d, width, d, width, d, 0, 0, 0)  # unread: 0
    bhsd = torch.empty(1, hq, T, d, dtype=torch.float16).transpose(1, 2)
    kept, per_sample = operand(bhsd)
    assert kept.shape == (T, hq, d) and kept.data_ptr() == bhsd.data_ptr() and not per_sample
    assert qkv_strides(kept, kept, kept, 1, False)[:2] == (d, T * d)
    # one head: torch may give its mode any stride (5 here, not a 16-byte multiple); it is never used
    one_head = torch.empty(T, 3 * d, dtype=torch.bfloat16).as_strided((T, 1, d), (3 * d, 5, 1))
    assert operand(one_head)[0] is one_head and qkv_strides(one_head, q, q, 1, False)[:2] == (3 * d, d)


def test_bshd_views_of_bhsd_are_read_per_sample():
    """A ``[B, S, H, D]`` view of ``[B, H, S, D]`` at B > 1 has no THD view: the kernels read it in
    place, per sample, where the consumer can (a granule) and both lengths are multiples of the
    granule; otherwise it is copied, and a BSHD tensor whose rows merge is passed as THD."""
    B, S, H, d = 2, 256, 4, 64
    bhsd = torch.empty(B, H, S, d, dtype=torch.bfloat16).transpose(1, 2)
    kept, per_sample = operand(bhsd, granule=128)
    assert kept is bhsd and per_sample
    per_batch = H * S * d
    assert qkv_strides(kept, kept, kept, B, True) == (d, S * d) * 3 + (per_batch,) * 3
    contiguous = torch.empty(B * S, H, d, dtype=torch.bfloat16)  # THD beside it: its samples are S rows
    assert qkv_strides(contiguous, kept, kept, B, True)[6:] == (S * H * d, H * S * d, H * S * d)
    for granule, view in ((None, None), (96, None), (128, view_of(B, S, 192))):
        copy, per_sample = operand(bhsd, granule=granule, view=view)
        assert copy.shape == (B * S, H, d) and copy.is_contiguous() and not per_sample
    bshd = torch.empty(B, S, H, d, dtype=torch.bfloat16)
    merged, per_sample = operand(bshd, granule=128)
    assert merged.shape == (B * S, H, d) and merged.data_ptr() == bshd.data_ptr() and not per_sample
    one_row = torch.empty(B, 3, H, d, dtype=torch.bfloat16)[:, :1]  # S = 1: samples 3 rows apart merge
    merged, per_sample = operand(one_row, granule=128)
    assert merged.shape == (B, H, d) and merged.stride(0) == 3 * H * d and not per_sample


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.randn(48, 4, 68, dtype=torch.bfloat16)[:, :, :64],  # head stride of 136 bytes
        lambda: torch.randn(48 * 4 * 64 + 1, dtype=torch.bfloat16)[1:].view(48, 4, 64),  # base off 16 bytes
        lambda: torch.randn(48, 64, 4, dtype=torch.bfloat16).transpose(1, 2),  # head dim strided
        lambda: torch.randn(1, 4, 64, dtype=torch.bfloat16).expand(48, 4, 64),  # rows on one another
        lambda: torch.randn(2, 4, 128, 68, dtype=torch.bfloat16)[..., :64].transpose(1, 2),  # per sample
    ],
    ids=["row-stride", "base", "head-dim", "stride-0", "per-sample-row-stride"],
)
def test_views_tma_cannot_read_are_copied(make):
    t = make()
    copy, per_sample = operand(t, granule=128)
    assert copy is not t and copy.is_contiguous() and torch.equal(copy, t.reshape(copy.shape))
    assert copy.data_ptr() % 16 == 0 and not per_sample


def test_views_spanning_past_32_bit_offsets_are_copied():
    """Each element must lie within 32-bit offsets of the base, as a contiguous tensor's do."""
    wide = torch.empty(2**16, 2**16, dtype=torch.bfloat16, device="meta")[:, :128].view(2**16, 1, 128)
    narrow = wide[: 2**15 - 1]  # spans just under 2**31 elements
    assert operand(narrow)[0] is narrow
    assert operand(wide)[0].is_contiguous()


def test_int32_offsets_accept_the_largest_tensors_that_fit():
    tokens = (INT32_LIMIT - 1) // (16 * 128)  # q/out and k/v just below 2**31 elements
    require_int32_offsets(geometry(tokens, tokens))
    require_int32_offsets(geometry(1024, 1024), dq_accum=(1024, 128))
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
        require_int32_offsets(g, dq_accum=None if rows is None else (rows, g.head_dim_qk))


def test_the_dq_accumulator_counts_the_kernels_head_dim():
    """A pair held by a larger kernel ((72, 72) on the 80 ones) has its dQ accumulator at the
    kernel's head dim: 32 heads x 883008 rows fit 2^31 at 72 columns, not at 80."""
    g = geometry(883008, 1024, hq=32, hkv=32, dqk=72, dv=72)
    require_int32_offsets(g, dq_accum=(883008, 72))
    with pytest.raises(UnsupportedConfigError, match="the dQ accumulator holds 2260500480 elements"):
        require_int32_offsets(g, dq_accum=(883008, 80))


def test_batch_strides_are_passed_only_where_read():
    """A THD operand kept in place (a slice of a fused QKV tensor at B = 1) spans fewer than 2^31
    elements, but its THD batch stride (total rows x row stride) may reach 2^31: it is passed as 0
    unless the kernels read rows per sample (the launch bound-checks every int32 argument)."""
    T, hq, hkv, d = 2**20, 8, 4, 128
    packed = torch.empty(T, hq + 2 * hkv, d, dtype=torch.bfloat16, device="meta")
    q, k, v = packed[:, :hq], packed[:, hq : hq + hkv], packed[:, hq + hkv :]
    strides = qkv_strides(q, k, v, 1, False)
    assert strides[6:] == (0, 0, 0) and max(strides) < INT32_LIMIT


def test_int32_offsets_cover_the_mask_payload():
    """A mostly partial mask at long S has more payload words than q has elements."""
    require_int32_offsets(geometry(1024, 1024), payload_words=INT32_LIMIT - 1)
    with pytest.raises(UnsupportedConfigError, match="the mask payload holds 2147483648 elements"):
        require_int32_offsets(geometry(1024, 1024), payload_words=INT32_LIMIT)


def test_softmax_scales_past_fp32_are_refused():
    """The kernels scale scores in fp32: a scale past its range would make every score infinite
    (NaN outputs), so it is refused; the largest one, a negative one and zero are kept."""
    q = torch.ones(2, 1, 8)
    for scale in (1e39, -1e39, 2 * FP32_MAX):
        with pytest.raises(InputValueError, match="softmax_scale.*fp32 range"):
            positive_softmax_scale(q, scale)
    assert positive_softmax_scale(q, FP32_MAX)[1] == FP32_MAX
    negated, scale = positive_softmax_scale(q, -0.5)
    assert scale == 0.5 and torch.equal(negated, -q)
    assert 0 < positive_softmax_scale(q, 0.0)[1] < 1e-20
