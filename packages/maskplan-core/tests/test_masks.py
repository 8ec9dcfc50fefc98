"""Tests for maskplan_core.masks as a whole: the argument checks shared by the builders (and one
of from_mask_mod's), device handling, the docstring examples. Each builder's and converter's own
argument checks are with its tests (test_mask_builders, test_mask_convert)."""

from __future__ import annotations

import doctest

import pytest
import torch

from maskplan_core import masks
from maskplan_core.errors import FlexAttnError, InputValueError

# --------------------------------------------------------------------------------------------------
# argument validation of the analytic builders, device handling, docstring examples
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("call", "exc", "pattern"),
    [
        (lambda: masks.causal(-1), ValueError, "seqlen_q must be >= 0, got -1"),
        (lambda: masks.causal(3, -1), ValueError, "seqlen_k"),
        (lambda: masks.causal(3.0), TypeError, "seqlen_q"),
        (lambda: masks.causal(True), TypeError, "seqlen_q"),
        (lambda: masks.causal(3, batch=0), ValueError, "batch"),
        (lambda: masks.causal(3, device=3), TypeError, "device"),
        (lambda: masks.sliding_window(4, window_left=-3), ValueError, "window_left must be >= 0, got -3"),
        (lambda: masks.sliding_window(4, window_left=1, window_right=-1), ValueError, "window_right"),
        (lambda: masks.sliding_window(4, window_left=None), TypeError, "window_left"),
        (lambda: masks.document([]), ValueError, "doc_lens"),
        (lambda: masks.document([2, -1]), ValueError, r"doc_lens\[1\]"),
        (lambda: masks.document([[1, 2], [2]]), ValueError, "same total length"),
        (lambda: masks.document([[1, 2], 3]), TypeError, "doc_lens"),
        (lambda: masks.document([1.5, 2]), TypeError, "doc_lens"),
        (lambda: masks.document(5), TypeError, "doc_lens"),
        (lambda: masks.document(torch.ones(2, 2, 2, dtype=torch.int64)), ValueError, "doc_lens"),
        (lambda: masks.document([2, 2], causal=None), TypeError, "causal"),
        (lambda: masks.document([2, 2], window_left=-1), ValueError, r"window_left.*no limit.*window_left=S"),
        (lambda: masks.prefix_lm(-1, 1), ValueError, "seqlen"),
        (lambda: masks.prefix_lm(4, -1), ValueError, "prefix_len"),
        (lambda: masks.prefix_lm(4, "2"), TypeError, "prefix_len"),
        (lambda: masks.prefix_lm(4, []), ValueError, "prefix_len"),
        (lambda: masks.chunked(4, 0), ValueError, "chunk_size"),
        (lambda: masks.chunked(4, 2, causal=1), TypeError, "causal"),
        (lambda: masks.chunked(4, 2, batch=-1), ValueError, "batch"),
        # endpoints are int32: longer sequences are refused by name, not wrapped around
        (lambda: masks.causal(4, 2**31), ValueError, "seqlen_k = 2147483648 exceeds the int32"),
        (lambda: masks.sliding_window(2**33, window_left=1), ValueError, "seqlen_q = 8589934592"),
        (lambda: masks.chunked(2**31, 4), ValueError, "seqlen = 2147483648"),
        (lambda: masks.document([2**31, 5]), ValueError, "doc_lens sum to 2147483653"),
        (lambda: masks.causal(cu_seqlens_q=[0, 2], cu_seqlens_k=[0, 2**32]), ValueError, "= 4294967296"),
        (lambda: masks.from_mask_mod(lambda b, h, q, kv: kv <= q, 1, 1, 2, 2**31), ValueError, "Sk = "),
        (lambda: masks.document_ids(torch.zeros(0, 5, dtype=torch.int64)), ValueError, "B >= 1"),
        # lengths the meta device holds no values of: refused by name, not torch's .item() error
        (lambda: masks.document(torch.tensor([2, 2], device="meta")), ValueError, "doc_lens must hold"),
        (lambda: masks.prefix_lm(4, torch.tensor([1], device="meta")), ValueError, "prefix_len must hold"),
        (lambda: masks.causal(cu_seqlens_q=[0, 2], cu_seqlens_k=[0, 2], device="meta"), ValueError,
         "cu_seqlens_q: a varlen mask is built from its samples' lengths"),
    ],
)
def test_builder_validation(call, exc, pattern):
    with pytest.raises(exc, match=pattern) as info:
        call()
    assert isinstance(info.value, FlexAttnError)  # one base class for every library error


def test_windows_chunks_and_prefixes_beyond_int32_are_unbounded():
    """A size beyond any sequence length means "no limit": the same endpoints as one of exactly
    the sequence length, with no int64 overflow."""
    huge = 2**70
    assert torch.equal(masks.sliding_window(6, window_left=huge), masks.sliding_window(6, window_left=6))
    assert torch.equal(
        masks.sliding_window(6, window_left=1, window_right=huge),
        masks.sliding_window(6, window_left=1, window_right=6),
    )
    assert torch.equal(masks.chunked(5, huge, causal=False), masks.chunked(5, 5, causal=False))
    assert torch.equal(masks.prefix_lm(3, [1, huge]), masks.prefix_lm(3, [1, 3]))
    ids = torch.tensor([4, 4, 4, 9, 9])
    assert torch.equal(masks.document_ids(ids, window_left=huge), masks.document_ids(ids))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_cuda_device_without_cuda_is_named():
    with pytest.raises(ValueError, match="device='cuda:0', but this torch has no CUDA device") as info:
        masks.causal(8, device="cuda:0")
    assert isinstance(info.value, FlexAttnError)
    with pytest.raises(ValueError, match="device='cuda'"):
        masks.document([2, 3], device=torch.device("cuda"))


def test_device_argument_forms():
    for dev in (None, "cpu", torch.device("cpu")):
        for ep in (
            masks.causal(3, device=dev),
            masks.sliding_window(3, window_left=1, device=dev),
            masks.document([1, 2], device=dev),
            masks.prefix_lm(3, 1, device=dev),
            masks.chunked(3, 2, device=dev),
            masks.from_mask_mod(lambda b, h, q, kv: kv <= q, 1, 1, 3, 3, device=dev),
        ):
            assert ep.device.type == "cpu"
            assert ep.dtype == torch.int32 and ep.is_contiguous()


def test_module_docstring_examples():
    result = doctest.testmod(masks, extraglobs={"torch": torch}, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0
    assert result.failed == 0


def test_builders_on_the_meta_device():
    """Builders that compute endpoints from lengths alone build them on the meta device (shapes
    only, e.g. to size a plan); those that read a dense mask's or a mask_mod's values name why
    they cannot."""
    meta = torch.device("meta")
    for ep, on_cpu in (
        (masks.document([3, 5], device=meta), masks.document([3, 5])),
        (masks.document([3, 5], prefix_lens=[1, 2], device=meta), masks.document([3, 5], prefix_lens=[1, 2])),
        (masks.causal(8, device=meta), masks.causal(8)),
        (masks.sliding_window(8, window_left=2, device=meta), masks.sliding_window(8, window_left=2)),
    ):
        assert ep.device == meta and ep.shape == on_cpu.shape and ep.dtype == torch.int32
    with pytest.raises(InputValueError, match="from_dense reads the endpoints from values.*meta"):
        masks.from_dense(torch.ones(1, 4, 4, dtype=torch.bool, device=meta))
    with pytest.raises(InputValueError, match="from_mask_mod reads the endpoints from values.*meta"):
        masks.from_mask_mod(lambda b, h, q, kv: kv <= q, 1, None, 4, 4, "meta")
