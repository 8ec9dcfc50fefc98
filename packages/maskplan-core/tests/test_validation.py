"""Every input rule of spec sections 2-4.1, violated once, at the maskplan-core layer.

Structural rules are checked by ``validate_plan_inputs``; endpoint and prefix *values* by the
reference planner (``build_plan``), which reports them through the allocation header's error
word. Each case asserts the precise ``maskplan_core.errors`` class, the builtin
``ValueError``/``TypeError`` it derives from, and that the message names the culprit.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from contextlib import contextmanager

import pytest
import torch

from maskplan_core import (
    EndpointError,
    FlexAttnError,
    InputTypeError,
    InputValueError,
    PlanSignature,
    RowMajorLayout,
    SeqlenError,
    Topology,
    UnsupportedConfigError,
    ViewConfig,
    validate_plan_inputs,
)
from maskplan_core.reference import build_plan

B, SQ, SK, HQ, HKV, D = 2, 24, 20, 4, 2, 8


@contextmanager
def expect(cls, builtin, *needles):
    """pytest.raises(cls) that also checks the builtin base class and the message contents."""
    with pytest.raises(cls) as info:
        yield info
    assert isinstance(info.value, builtin), f"{type(info.value).__name__} is not a {builtin.__name__}"
    assert isinstance(info.value, FlexAttnError)
    message = str(info.value)
    for needle in needles:
        assert needle in message, f"{needle!r} not in message {message!r}"


def fixed_qkv(b=B, sq=SQ, sk=SK, hq=HQ, hkv=HKV, dqk=D, dv=D, dtype=torch.float32):
    return (
        torch.zeros(b, sq, hq, dqk, dtype=dtype),
        torch.zeros(b, sk, hkv, dqk, dtype=dtype),
        torch.zeros(b, sk, hkv, dv, dtype=dtype),
    )


def causal(total_q=B * SQ, sq=SQ, sk=SK, hmask=1, nfunc=1) -> torch.Tensor:
    i = torch.arange(total_q) % sq
    f0 = (i + 1 + sk - sq).clamp(0, sk)
    ep = torch.full((hmask, nfunc, total_q), sk, dtype=torch.int32)
    ep[:, 0] = f0
    return ep


# varlen problem: sample lengths q (5, 0, 11), k (7, 3, 0); endpoints are sample-local
CU_Q, CU_K = [0, 5, 5, 16], [0, 7, 10, 10]


def varlen_args(cu_q=None, cu_k=None, max_q=11, max_k=7):
    return dict(
        cu_seqlens_q=torch.tensor(CU_Q if cu_q is None else cu_q, dtype=torch.int32),
        cu_seqlens_k=torch.tensor(CU_K if cu_k is None else cu_k, dtype=torch.int32),
        max_seqlen_q=max_q,
        max_seqlen_k=max_k,
    )


def varlen_qkv(total_q=16, total_k=10):
    return (torch.zeros(total_q, HQ, D), torch.zeros(total_k, HKV, D), torch.zeros(total_k, HKV, D))


def varlen_mask(nfunc=3) -> torch.Tensor:
    """Row r of sample b sees [0, k_len_b): every endpoint equals the sample's k_len."""
    k_len_of_row = [7] * 5 + [0] * 11
    return torch.tensor(k_len_of_row, dtype=torch.int32).expand(1, nfunc, 16).contiguous()


def config(direction: str, pack_gqa: bool = False) -> ViewConfig:
    layout = RowMajorLayout(8, 32)
    signature = PlanSignature(
        arch_family="reference",
        direction=direction,
        kernel_family="test",
        topology=Topology(tile_m=8, tile_n=32, pack_gqa=pack_gqa, qhead_per_kvhead=HQ // HKV),
        mma_layout="none",
        payload=layout.spec,
        scheduler_layout="test",
        dq_order_format="rank_int32" if direction == "backward" else "none",
    )
    return ViewConfig(signature, layout)


def plan(mask_func, q, k, v, **kw):
    geometry = validate_plan_inputs(mask_func, q, k, v, **kw)
    return build_plan(mask_func, geometry, config("forward"), config("backward"), "test")


def test_a_planner_refuses_a_mask_its_geometry_was_not_validated_from():
    """The planner's own check (a library author calls build_plan with a geometry and views):
    another mask's shape, dtype or layout than the geometry's, and PackGQA with a mask per head
    (its work queue has one task per kv head), are refused by name before anything is built."""
    q, k, v = fixed_qkv()
    mask = causal()
    geometry = validate_plan_inputs(mask, q, k, v)
    fwd = config("forward")
    for other in (causal(nfunc=3), causal(hmask=HQ), mask.to(torch.int64), mask[:, :, : B * SQ - 1]):
        with expect(InputValueError, ValueError, "mask_func", "[Hmask, nfunc, total_q] = [1, 1, 48]"):
            build_plan(other, geometry, fwd, None, "test")
    with expect(InputValueError, ValueError, "contiguous"):
        build_plan(torch.cat([mask, mask], 2)[:, :, ::2], geometry, fwd, None, "test")
    with expect(InputTypeError, TypeError, "mask_func", "list"):
        build_plan(mask.tolist(), geometry, fwd, None, "test")
    on_cuda = dataclasses.replace(geometry, device=torch.device("cuda"))  # no CUDA needed to refuse
    with expect(InputValueError, ValueError, "mask_func", "on cpu", "on cuda"):
        build_plan(mask, on_cuda, fwd, None, "test")
    per_head = causal(hmask=HQ)
    packed = config("forward", pack_gqa=True)
    with pytest.raises(UnsupportedConfigError, match=r"Hmask=4, PackGQA needs Hmask=1.*mask_func\[:1\]"):
        build_plan(per_head, validate_plan_inputs(per_head, q, k, v), packed, None, "test")
    assert build_plan(mask, geometry, packed, None, "test").view("forward").fwd_work_desc.shape[0] > 0


def test_a_view_request_where_a_config_belongs_is_refused_by_name():
    """A request describes the problem; the planner takes the consumer's config for it. Handing it
    the request (through a consumer or the reference planner) names the argument and the fix."""
    from maskplan_core import ViewRequest
    from maskplan_core.reference.consumer import ReferenceConsumer

    q, k, v = fixed_qkv()
    geometry = validate_plan_inputs(causal(), q, k, v)
    request = ViewRequest.for_geometry(geometry, "forward", "maskplan-reference")
    with expect(InputTypeError, TypeError, "forward must be a ViewConfig, got ViewRequest", ".resolve("):
        ReferenceConsumer().build_plan(causal(), geometry, request, None)
    with expect(InputTypeError, TypeError, "backward must be a ViewConfig or None, got str"):
        build_plan(causal(), geometry, config("forward"), "backward", "test")
    backward = ViewRequest.for_geometry(geometry, "backward", "maskplan-reference")
    with expect(InputTypeError, TypeError, "backward must be a ViewConfig or None, got ViewRequest",
                "consumer.resolve(backward_request)"):  # fmt: skip
        build_plan(causal(), geometry, config("forward"), backward, "test")


def test_valid_inputs_pass():
    g = validate_plan_inputs(causal(), *fixed_qkv())
    assert (g.batch, g.max_seqlen_q, g.max_seqlen_k, g.total_q, g.total_k) == (B, SQ, SK, B * SQ, B * SK)
    assert (g.num_heads_q, g.num_heads_kv, g.mask_heads, g.nfunc, g.varlen) == (HQ, HKV, 1, 1, False)
    assert g.cu_seqlens_q.tolist() == [0, SQ, 2 * SQ] and g.cu_seqlens_k.tolist() == [0, SK, 2 * SK]
    gv = validate_plan_inputs(varlen_mask(), *varlen_qkv(), **varlen_args())
    assert (gv.batch, gv.total_q, gv.total_k, gv.varlen) == (3, 16, 10, True)
    plan(varlen_mask(), *varlen_qkv(), **varlen_args())
    plan(causal(hmask=HQ, nfunc=5), *fixed_qkv())


def test_fixed_length_batches_past_int32_tokens_are_refused():
    """B x S past 2^31 - 1 tokens would wrap the int32 prefixes (``[0, 2^30, -2^31]`` at B = 2,
    S = 2^30): refused naming the tensor, as a varlen total is. Expanded tensors: no memory."""
    big = torch.empty(1, 1, 1, 8).expand(2, 2**30, 1, 8)
    small = torch.empty(1, 1, 1, 8).expand(2, 16, 1, 8)
    mask = torch.empty(1, 1, 1, dtype=torch.int32).expand(1, 1, 2**31)
    with pytest.raises(InputValueError, match=r"q \(2, 1073741824, 1, 8\) holds 2147483648 tokens"):
        validate_plan_inputs(mask, big, small, small)
    with pytest.raises(InputValueError, match=r"k \(2, 1073741824, 1, 8\) holds 2147483648 tokens"):
        validate_plan_inputs(mask[..., :32], small, big, big)


def test_fixed_length_prefixes_are_made_once_per_shape():
    a = validate_plan_inputs(causal(), *fixed_qkv())
    b = validate_plan_inputs(causal(), *fixed_qkv())
    assert a.cu_seqlens_q is b.cu_seqlens_q and a.cu_seqlens_k is b.cu_seqlens_k
    q, k, v = (t[:1] for t in fixed_qkv())  # batch 1: other prefixes
    c = validate_plan_inputs(causal()[:, :, :SQ].contiguous(), q, k, v)
    assert c.cu_seqlens_q.tolist() == [0, SQ] and c.cu_seqlens_k.tolist() == [0, SK]


def test_error_hierarchy():
    for cls in (EndpointError, SeqlenError):
        assert issubclass(cls, InputValueError) and issubclass(cls, ValueError)
    assert issubclass(InputTypeError, TypeError) and issubclass(InputValueError, ValueError)


# --------------------------------------------------------------------------------------------------
# mask_func structure (spec 2)
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "mask_func, cls, builtin, needles",
    [
        (causal().tolist(), InputTypeError, TypeError, ("mask_func", "Tensor", "list")),
        (None, InputTypeError, TypeError, ("mask_func", "Tensor")),
        (torch.ones(B * SQ, SK, dtype=torch.bool), InputTypeError, TypeError,
         ("mask_func", "bool tensor", "from_dense")),
        (lambda b, h, q, kv: q >= kv, InputTypeError, TypeError, ("mask_func", "function", "from_mask_mod")),
        (functools.partial(lambda b, h, q, kv, w: q - kv < w, w=4), InputTypeError, TypeError,
         ("mask_func", "partial", "from_mask_mod")),
        (causal().to(torch.int64), InputTypeError, TypeError, ("mask_func", "int32", "int64")),
        (causal().float(), InputTypeError, TypeError, ("mask_func", "int32", "float32")),
        (causal()[0], InputValueError, ValueError, ("mask_func", "rank 3")),
        (causal()[None], InputValueError, ValueError, ("mask_func", "rank 3")),
        (causal(nfunc=3, total_q=2 * B * SQ)[:, :, ::2], InputValueError, ValueError,
         ("mask_func", "contiguous")),
        (causal(hmask=HQ, nfunc=3).transpose(0, 1).contiguous().transpose(0, 1), InputValueError, ValueError,
         ("mask_func", "contiguous")),
        (causal(nfunc=3).to_sparse(), InputTypeError, TypeError,
         ("mask_func", "dense (strided)", "sparse_coo")),
        (causal(hmask=3), InputValueError, ValueError, ("mask_func", "Hmask=3", f"Hq={HQ}")),
        (causal(hmask=HKV), InputValueError, ValueError,
         ("mask_func", f"Hmask={HKV}", "one per k/v head", f"repeat_interleave({HQ // HKV}, dim=0)")),
        (causal(nfunc=2), InputValueError, ValueError, ("mask_func", "nfunc", "2", "[0, F0) U [F1, F2)")),
        (causal(nfunc=4), InputValueError, ValueError, ("mask_func", "nfunc", "4")),
        (causal(nfunc=3)[:, :0], InputValueError, ValueError, ("mask_func", "nfunc", "0")),
        (causal(total_q=B * SQ + 1), InputValueError, ValueError, ("mask_func", "total_q", str(B * SQ + 1))),
        (causal(total_q=SQ), InputValueError, ValueError,
         ("mask_func", "total_q", str(B * SQ), "one sample", "batch=B")),
        (causal(nfunc=3).transpose(1, 2).contiguous(), InputValueError, ValueError,
         ("mask_func", "nfunc", str(B * SQ), "[Hmask, total_q, nfunc]", "transpose(1, 2)")),
    ],
    ids=[
        "list", "none", "dense-bool", "mask-mod", "partial-mask-mod", "int64", "float32", "rank2", "rank4",
        "strided-rows", "transposed-heads", "sparse",
        "hmask-3", "hmask-hkv", "nfunc-2", "nfunc-4", "nfunc-0", "total_q-plus-1", "total_q-one-sample",
        "transposed-rows",
    ],
)
def test_mask_func_structure(mask_func, cls, builtin, needles):
    with expect(cls, builtin, *needles):
        validate_plan_inputs(mask_func, *fixed_qkv())


def test_transposed_endpoints_with_as_many_endpoints_as_samples_are_named():
    """nfunc = B = 3: the transposed layout is named ahead of the one-row-per-sample guess; one
    sample is "1 sample"; q without heads is named as that."""
    q, k, v = fixed_qkv(b=3, sk=SQ)
    with expect(InputValueError, ValueError, "[Hmask, total_q, nfunc]", "transpose(1, 2)"):
        validate_plan_inputs(causal(total_q=3 * SQ, sk=SQ, nfunc=3).transpose(1, 2).contiguous(), q, k, v)
    with expect(InputValueError, ValueError, "(1 sample of 48)"):
        validate_plan_inputs(causal(total_q=SQ, sk=2 * SQ), *fixed_qkv(b=1, sq=2 * SQ, sk=2 * SQ))
    for heads in (dict(hq=0), dict(hkv=0)):
        with expect(InputValueError, ValueError, "at least one head each"):
            validate_plan_inputs(causal(), *fixed_qkv(**heads))


def test_transposed_endpoints_of_an_odd_row_count_are_named():
    """[Hmask, total_q, nfunc] with an odd total_q passes the nfunc check, then its rows are named."""
    q, k, v = fixed_qkv(b=1, sq=25)
    with expect(InputValueError, ValueError, "total_q=25", "[Hmask, total_q, nfunc]"):
        validate_plan_inputs(causal(total_q=25, sq=25, nfunc=3).transpose(1, 2).contiguous(), q, k, v)


@pytest.mark.parametrize(
    "mask_func, q_shape, needles",
    [
        # one decoding query, a mask of 100 rows (nfunc 1 = total_q): transposing it gives nfunc 100
        (causal(total_q=100, sq=100, sk=100), (1, 1), ("100 query rows", "total_q=1")),
    ],
    ids=["decode-step"],
)
def test_no_transpose_hint_where_a_transpose_cannot_be_meant(mask_func, q_shape, needles):
    q, k, v = fixed_qkv(b=q_shape[0], sq=q_shape[1], sk=100)
    with pytest.raises(InputValueError) as info:
        validate_plan_inputs(mask_func, q, k, v)
    assert all(n in str(info.value) for n in needles) and "transpose" not in str(info.value), str(info.value)


def test_both_readings_named_where_both_fit():
    """A mask of one row and nfunc 3 for a batch of 3 single-token samples is a mask for one
    sample, or [Hmask, total_q, nfunc] transposed: the error names both."""
    q, k, v = fixed_qkv(b=3, sq=1, sk=100)
    needles = ("[Hmask, total_q, nfunc]", "; or, ", "one sample", "from_mask_mod(mask_mod, B")
    with expect(InputValueError, ValueError, *needles):
        validate_plan_inputs(causal(total_q=1, sq=1, sk=50, nfunc=3), q, k, v)


def test_a_builders_mask_for_other_lengths_names_them_and_qs():
    """A mask a builder made for longer samples than q's (a mask_mod converted for the model's
    longest length): no generic hint fits, so the error names both lengths."""
    from maskplan_core.masks import causal, from_mask_mod

    q, k, v = fixed_qkv(sq=20, sk=20)
    for mask, builder in ((from_mask_mod(lambda b, h, i, j: i >= j, B, 1, 32, 32), "from_mask_mod"),
                          (causal(32, batch=B), "causal")):  # fmt: skip
        with expect(InputValueError, ValueError, f"built by masks.{builder} for {B} samples of 32 rows",
                    f"build it for q's samples ({B} samples of 20 rows)"):  # fmt: skip
            validate_plan_inputs(mask, q, k, v)


def test_a_builders_mask_counts_the_samples_without_query_rows_apart():
    """Samples without query rows have no mask rows: the error says there are such samples beside
    the ones it lists (it said "3 samples" of a batch of 4)."""
    from maskplan_core.masks import causal

    cu = torch.tensor([0, 100, 100, 164, 400], dtype=torch.int32)
    built_k = torch.tensor([0, 90, 154, 390], dtype=torch.int32)
    mask = causal(cu_seqlens_q=torch.tensor([0, 100, 164, 400], dtype=torch.int32), cu_seqlens_k=built_k)
    q = torch.zeros(400, 2, 16)
    kwargs = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=236, max_seqlen_k=236)
    said = "but k has 3 samples of 100, 64, 236 keys (besides 1 without query rows)"
    with expect(InputValueError, ValueError, said):
        validate_plan_inputs(mask, q, q, q, **kwargs)


def test_a_key_padding_mask_of_one_row_per_sample_gets_the_expand_hint():
    """SDPA's key-padding mask ``[B, 1, 1, Sk]`` converted as it is gives one query row per sample:
    the error says to expand it to every query row first."""
    q, k, v = fixed_qkv()
    from maskplan_core.masks import from_dense

    padding = from_dense(torch.ones(B, 1, 1, SK, dtype=torch.bool))
    with expect(InputValueError, ValueError, f"{B} query rows", "key-padding", f"expand({B}, -1, {SQ}, -1)"):
        validate_plan_inputs(padding, q, k, v)
    # B == Sq: one sample's rows or one row per sample, the error cannot tell: it names both
    q, k, v = fixed_qkv(b=4, sq=4)
    with expect(InputValueError, ValueError, "one sample of 4 rows", "or, if mask_func came from a [B, 1, 1"):
        validate_plan_inputs(from_dense(torch.ones(4, 1, 1, SK, dtype=torch.bool)), q, k, v)


def test_a_batch_mask_of_another_length_names_both_readings():
    """A mask for B samples of S/B rows has as many rows as one sample of q: the error gives q's
    samples and lengths and names both readings (one sample; the batch at another S)."""
    q, k, v = fixed_qkv(b=2, sq=128, sk=128)
    needles = ("total_q=256 (2 samples of 128)", "batch=B", "if for 2 samples, its S is not q's 128")
    with expect(InputValueError, ValueError, *needles):
        validate_plan_inputs(causal(total_q=128, sq=64, sk=64), q, k, v)


def test_bhsd_q_gets_a_layout_hint():
    """torch FlexAttention's BHSD layout, passed as is, names the layout flexattn takes."""
    q, k, v = fixed_qkv(sk=SQ, hq=4, hkv=4)
    with expect(InputValueError, ValueError, "total_q", "BHSD", "transpose(1, 2)"):
        validate_plan_inputs(causal(sk=SQ), *(t.transpose(1, 2) for t in (q, k, v)))


def test_bhsd_tensors_of_other_lengths_get_the_layout_hint():
    """With Sq != Sk, torch's BHSD tensors fail on their "heads" (the sequence lengths) before the
    mask is looked at: the error shows the shapes and names the layout; a true head mismatch in
    BSHD tensors gets no layout hint."""
    q, k, v = fixed_qkv(sq=SQ, sk=SQ + 3, hq=4, hkv=2)
    bhsd = [t.transpose(1, 2) for t in (q, k, v)]
    shapes = (str(tuple(bhsd[0].shape)), str(tuple(bhsd[1].shape)))
    with expect(InputValueError, ValueError, f"q heads ({SQ})", *shapes, "BHSD", "transpose(1, 2)"):
        validate_plan_inputs(causal(total_q=B * 4, sq=4, sk=4), *bhsd)
    with pytest.raises(InputValueError, match=r"k/v heads \(2\): q .*\)$"):
        validate_plan_inputs(causal(), *fixed_qkv(hq=3, hkv=2))
    with pytest.raises(InputValueError, match=r"k/v heads \(2\): q .*\)$"):  # Sq = Sk: still BSHD
        validate_plan_inputs(causal(sk=SQ), *fixed_qkv(sk=SQ, hq=3, hkv=2))


def test_per_kv_head_hint_only_where_the_rows_fit():
    """A per-sample [B, Sq, Sk] dense mask read as B heads, where B = Hkv: the batch-as-heads
    hint, not the per-kv-head one, which needs a mask of total_q rows."""
    q, k, v = fixed_qkv(sk=SQ, hq=4, hkv=B)
    with pytest.raises(InputValueError, match="read its 2 samples as heads") as info:
        validate_plan_inputs(causal(total_q=SQ, sk=SQ, hmask=B), q, k, v)
    assert "one per k/v head" not in str(info.value)


def test_bhsd_q_alone_gets_a_conditional_layout_hint():
    """q of fewer positions than heads may be BSHD (a decoding step) or BHSD: the hint is
    conditional; with k too in the BHSD shape it says they look so."""
    q, k = torch.zeros(1, 8, 12, 16), torch.zeros(1, 100, 8, 16)
    with expect(InputValueError, ValueError, "if q is BHSD [B, H, S, D]", "(q.transpose(1, 2))"):
        validate_plan_inputs(causal(total_q=8, sq=8, sk=100), q, k, k)
    q, k, v = fixed_qkv(sq=SQ, sk=SQ + 3, hq=4, hkv=2)
    with expect(InputValueError, ValueError, "q and k look like BHSD"):
        validate_plan_inputs(causal(total_q=B * 4, sq=4, sk=4), *(t.transpose(1, 2) for t in (q, k, v)))


def test_bhsd_k_and_v_alone_get_the_layout_hint():
    """q transposed to BSHD but k, v still [B, Hkv, S, D] (a KV cache in torch's layout): the head
    check names k and v's layout and their transposes, not q's."""
    q, k, v = fixed_qkv(sk=SQ, hq=4, hkv=2)
    needles = ("if k and v are BHSD", "k.transpose(1, 2), v.transpose(1, 2)")
    with expect(InputValueError, ValueError, *needles):
        validate_plan_inputs(causal(sk=SQ), q, k.transpose(1, 2), v.transpose(1, 2))


def test_mask_on_another_device_names_the_builders_device():
    """A mask built on the CPU (the builders' default; torch's create_block_mask defaults to the
    accelerator) for q elsewhere: the error says where to build it."""
    q, k, v = fixed_qkv(sk=SQ)
    with expect(InputValueError, ValueError, "mask_func is on meta but q is on cpu", "device=q.device"):
        validate_plan_inputs(causal(sk=SQ).to("meta"), q, k, v)


def test_varlen_rows_mismatch_names_q_and_cu_seqlens_q():
    """A varlen q shorter than its mask (and cu_seqlens_q) is not blamed on the mask alone."""
    with expect(InputValueError, ValueError, "mask_func", "total_q=15", "q.shape[0]", "cu_seqlens_q[-1]"):
        validate_plan_inputs(varlen_mask(), *varlen_qkv(total_q=15), **varlen_args())


def test_bhsd_tensors_whose_mask_fits_draw_a_warning():
    """BHSD tensors with a mask built for their (misread) S pass every shape check: many heads and
    few positions per sample draw a warning naming the layout; a BSHD problem does not."""
    q, k, v = fixed_qkv(sq=4, sk=4, hq=256, hkv=256)
    with pytest.warns(UserWarning, match=r"256 heads and 4 positions.*transpose\(1, 2\)") as said:
        validate_plan_inputs(causal(total_q=B * 4, sq=4, sk=4), q, k, v)
    assert said[0].filename == __file__  # the caller's line, past the library's frames
    q, k, v = fixed_qkv(sq=256, sk=256, hq=256, hkv=256)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        validate_plan_inputs(causal(total_q=B * 256, sq=256, sk=256), q, k, v)
        # MQA with more q heads than positions: k's one head rules the transposed reading out
        q, k, v = fixed_qkv(sq=100, sk=100, hq=128, hkv=1)
        validate_plan_inputs(causal(total_q=B * 100, sq=100, sk=100), q, k, v)


def test_a_bad_q_dtype_names_q():
    """q of an unsupported dtype is named itself, not k / v for differing from it."""
    q, k, v = fixed_qkv()
    with expect(InputTypeError, TypeError, "q dtype", "int64"):
        validate_plan_inputs(causal(), q.to(torch.int64), k, v)


def test_mask_func_on_another_device():
    with expect(InputValueError, ValueError, "mask_func", "meta", "cpu"):
        validate_plan_inputs(causal().to("meta"), *fixed_qkv())


# --------------------------------------------------------------------------------------------------
# endpoint values (spec 2, 4.3): reported by the planner through the header's error word
# --------------------------------------------------------------------------------------------------


def test_endpoint_above_k_len():
    ep = causal(nfunc=3)
    ep[0, 2, 30] = SK + 1
    needles = ("mask_func[0, 2, 30]", str(SK + 1), "row 30", f"k_len = {SK}", "inside the row's sample")
    with expect(EndpointError, ValueError, *needles):
        plan(ep, *fixed_qkv())


def test_a_flat_document_list_for_a_batch_gets_the_per_sample_hint():
    """One flat list of document lengths for a batch of 2 has the batch's rows but counts keys across
    samples: the builder's record refuses it, and a copy (no record) gets the planner's range error;
    both say to build the mask per sample."""
    from maskplan_core.masks import document

    q, k, v = fixed_qkv(b=2, sq=64, sk=64)
    flat = document([20, 50, 58])
    with expect(InputValueError, ValueError, "built by masks.document for 1 sample of 128 rows",
                "q has 2 samples of 64 rows", "one list of document lengths per sample"):  # fmt: skip
        plan(flat, q, k, v)
    with expect(EndpointError, ValueError, "k_len = 64", "masks.document([[lengths of sample 0]"):
        plan(flat.clone(), q, k, v)
    plan(document([[20, 44], [50, 14]]), q, k, v)
    wrong = document([[20, 44], [50, 14]]).clone()
    wrong[0, 2, 10] = 65  # past k_len in sample 0, where no flat list counts across samples
    with pytest.raises(EndpointError, match="k_len = 64") as info:
        plan(wrong, q, k, v)
    assert "masks.document" not in str(info.value)
    wrong = document([[20, 44], [50, 14]]).clone()
    wrong[0, 2, 100] = 129  # in sample 1, but past the batch's 128 keys: no flat list either
    with pytest.raises(EndpointError, match="k_len = 64") as info:
        plan(wrong, q, k, v)
    assert "masks.document" not in str(info.value)


def test_the_sample_record_leaves_out_empty_samples_and_rewritten_buffers():
    """Samples of no rows hold no endpoints: a mask of 2 x 64 serves varlen samples 64, 64, 0. A
    builder's tensor written in place since (a reused buffer) no longer claims the builder's split."""
    from maskplan_core import masks

    mask = masks.causal(64, batch=2)
    qkv, varlen = _varlen_qkv([0, 64, 128, 128])
    plan(mask, *qkv, **varlen)
    q1 = fixed_qkv(b=1, sq=128, sk=128)
    with expect(InputValueError, ValueError, "built by masks.causal for 2 samples of 64 rows"):
        plan(mask, *q1)
    mask.copy_(masks.causal(128))
    plan(mask, *q1)


@pytest.mark.parametrize("hq", [4, 2])
def test_a_per_sample_dense_mask_read_as_heads_gets_the_sdpa_hint(hq):
    """``masks.from_dense`` reads rank 3 as ``[Hmask, total_q, Sk]``: a per-sample ``[B, Sq, Sk]``
    mask becomes B heads of Sq rows. Whichever check it then fails (B heads for Hq = 4, Sq rows for
    a batch of 2 where Hq = B = 2), the error says to pass SDPA's ``[B, 1, Sq, Sk]``."""
    from maskplan_core import masks

    per_sample = torch.ones(2, 8, 8, dtype=torch.bool).tril()
    q = torch.randn(2, 8, hq, D)
    with expect(InputValueError, ValueError, "read its 2 samples as heads", "pass mask[:, None]"):
        plan(masks.from_dense(per_sample), q, q, q)
    plan(masks.from_dense(per_sample[:, None]), q, q, q)


CU = [0, 64, 128]  # two varlen samples of 64


def _causal_block_mask(batch: int, seqlen: int):
    from torch.nn.attention.flex_attention import create_block_mask

    return create_block_mask(lambda b, h, q, kv: kv <= q, batch, None, seqlen, seqlen, device="cpu")


def _varlen_qkv(cu: list[int]):
    t = torch.randn(cu[-1], HQ, D)
    cu_t = torch.tensor(cu, dtype=torch.int32)
    n = max(b - a for a, b in zip(cu, cu[1:], strict=False))
    return (t, t, t), dict(cu_seqlens_q=cu_t, cu_seqlens_k=cu_t, max_seqlen_q=n, max_seqlen_k=n)


@pytest.mark.parametrize(
    "builder, make",
    [
        ("masks.causal", lambda m: m.causal(64, batch=2)),
        ("masks.sliding_window", lambda m: m.sliding_window(cu_seqlens_q=CU, cu_seqlens_k=CU, window_left=5)),
        ("masks.full", lambda m: m.full(64, batch=2)),
        ("masks.document_ids", lambda m: m.document_ids(torch.zeros(2, 64, dtype=torch.int64))),
        ("masks.prefix_lm", lambda m: m.prefix_lm(64, [3, 9])),
        ("masks.chunked", lambda m: m.chunked(64, 16, batch=2)),
        ("masks.from_mask_mod", lambda m: m.from_mask_mod(lambda b, h, q, kv: kv <= q, 2, None, 64, 64)),
        ("masks.from_dense", lambda m: m.from_dense(torch.ones(2, 1, 64, 64, dtype=torch.bool).tril())),
        ("masks.from_block_mask", lambda m: m.from_block_mask(_causal_block_mask(2, 64))),
    ],
)
def test_a_mask_built_for_other_samples_of_the_same_rows_is_refused(builder, make):
    """Endpoints are sample-local: a mask built for 2 samples of 64 rows has the row count of one
    sample of 128 (or of varlen samples 50 + 78), where its endpoints would show other keys. The
    builders record the split of what they return, so such a plan is refused (as torch refuses a
    BlockMask of other lengths) rather than built; the same split, fixed or varlen, plans."""
    from maskplan_core import masks

    endpoints = make(masks)
    with expect(InputValueError, ValueError, f"built by {builder} for 2 samples of 64 rows",
                "q has 1 sample of 128 rows"):  # fmt: skip
        plan(endpoints, *fixed_qkv(b=1, sq=128, sk=128))
    qkv, varlen = _varlen_qkv([0, 50, 128])
    with expect(InputValueError, ValueError, "q has 2 samples of 50, 78 rows"):
        plan(endpoints, *qkv, **varlen)
    plan(endpoints, *fixed_qkv(b=2, sq=64, sk=64))
    qkv, varlen = _varlen_qkv([0, 64, 128])
    plan(endpoints, *qkv, **varlen)
    plan(endpoints.clone(), *fixed_qkv(b=1, sq=128, sk=128))  # a copy has no record: taken as it is


def _tril(b, h, q, kv):
    return kv <= q


@pytest.mark.parametrize(
    "builder, make, how",
    [
        ("masks.causal", lambda m: m.causal(64, batch=2), "masks.causal(seqlen_q, seqlen_k"),
        ("masks.full", lambda m: m.full(64, batch=2), "masks.full(seqlen_q, seqlen_k"),
        ("masks.sliding_window", lambda m: m.sliding_window(64, batch=2, window_left=8), "sliding_window("),
        ("masks.document", lambda m: m.document([[20, 44], [64]]), "builds self-attention masks"),
        ("masks.chunked", lambda m: m.chunked(64, 16, batch=2), "builds self-attention masks"),
        ("masks.from_mask_mod", lambda m: m.from_mask_mod(_tril, 2, 1, 64, 64), "Sk (KV_LEN)"),
        ("masks.from_block_mask", lambda m: m.from_block_mask(_causal_block_mask(2, 64)), "KV_LEN"),
        ("masks.from_dense", lambda m: m.from_dense(torch.ones(2, 1, 64, 64).bool()), "k's key columns"),
    ],
)
def test_a_mask_built_for_other_key_lengths_is_refused(builder, make, how):
    """A mask built for 64 keys planned with 96 would hide keys 64-95 (and a bottom-right aligned
    diagonal would sit 32 keys early): the builders record the keys of their samples too, and the
    error says how to give the builder k's length (and that a copy is taken as it is). With fewer
    keys than built for, its endpoints may reach past them: a copy is no way out, and not offered."""
    from maskplan_core import masks

    endpoints = make(masks)
    with expect(InputValueError, ValueError, f"built by {builder} for 2 samples of 64 keys",
                "k has 2 samples of 96 keys", how, "keys past them are hidden", ".clone()"):  # fmt: skip
        plan(endpoints, *fixed_qkv(b=2, sq=64, sk=96))
    with pytest.raises(InputValueError, match="may reach past k's keys") as fewer:
        plan(endpoints, *fixed_qkv(b=2, sq=64, sk=48))
    assert ".clone()" not in str(fewer.value)
    plan(endpoints, *fixed_qkv(b=2, sq=64, sk=64))


@pytest.mark.parametrize(
    "builder, make",
    [
        ("masks.from_mask_mod", lambda m, heads: m.from_mask_mod(_tril, 2, heads, 64, 64)),
        ("masks.from_block_mask", lambda m, heads: m.from_block_mask(_causal_block_mask(2, 64), heads=heads)),
    ],
)
def test_a_mask_mod_evaluated_for_other_heads_is_refused(builder, make):
    """A mask_mod's head index is a q head's (torch's): evaluated for the kv heads (H = 2) it never
    saw q heads 2-3, even where heads 0-1 agree and the endpoints keep one mask for every head
    (Hmask = 1), so planning it for 4 q heads is refused with the H to pass; H = 1 and H = Hq plan."""
    from maskplan_core import masks

    endpoints = make(masks, HKV)
    assert endpoints.shape[0] == 1
    with expect(InputValueError, ValueError, f"built by {builder} for {HKV} heads", f"q has {HQ}",
                f"H={HQ}, or H=1"):  # fmt: skip
        plan(endpoints, *fixed_qkv(b=2, sq=64, sk=64))
    for heads in (1, HQ, 2 * HQ):  # more heads than q's: every head q has was evaluated
        plan(make(masks, heads), *fixed_qkv(b=2, sq=64, sk=64))


def test_a_model_of_one_head_is_refused_for_q_of_more_heads():
    """A mask_mod that raises at head 1 (a per-head table of one entry), taken with H=1 as one
    head's, and a head-reading block mask converted for heads=1 were never evaluated for q's other
    heads (torch's flex_attention calls them with each head's index): refused for q of more heads,
    planned for q of one head. A block mask that does not read h plans for any heads."""
    from maskplan_core import masks

    one_entry = torch.tensor([6])
    one_head = masks.from_mask_mod(lambda b, h, q, kv: (kv <= q) & (q - kv < one_entry[h]), 2, 1, 64, 64)
    fa = pytest.importorskip("torch.nn.attention.flex_attention")
    shifted = fa.create_block_mask(lambda b, h, q, kv: (kv <= q) & (kv != q - 1 - h), 2, None, 64, 64,
                                   device="cpu")  # fmt: skip
    converted = masks.from_block_mask(shifted, heads=1)
    for endpoints, builder in ((one_head, "from_mask_mod"), (converted, "from_block_mask")):
        with expect(InputValueError, ValueError, builder, "model of one head", f"q has {HQ} heads"):
            plan(endpoints, *fixed_qkv(b=2, sq=64, sk=64))
        q = torch.randn(2, 64, 1, D)
        plan(endpoints, q, q, q)
    plan(masks.from_block_mask(_causal_block_mask(2, 64), heads=1), *fixed_qkv(b=2, sq=64, sk=64))


def test_a_mask_mod_of_kv_heads_whose_heads_differ_gets_the_q_heads_fix():
    """Heads that differ keep Hmask = H: for H = Hkv the record's refusal (h is a q head's index)
    comes before the Hmask check's kv-head hint (repeat_interleave), which fits masks made per kv
    head, not a mask_mod evaluated for q heads 0 .. Hkv - 1."""
    from maskplan_core import masks

    per_head = masks.from_mask_mod(lambda b, h, q, kv: kv <= q + h, 2, HKV, 64, 64)
    assert per_head.shape[0] == HKV
    with expect(InputValueError, ValueError, f"built by masks.from_mask_mod for {HKV} heads", f"H={HQ}"):
        plan(per_head, *fixed_qkv(b=2, sq=64, sk=64))


def test_a_recorded_mask_of_other_rows_names_its_samples_and_builder():
    """A row count that is not q's is refused before the sample check; where a builder recorded the
    mask, the refusal names what it was built for and that builder's own way to q's samples (not
    the generic hints, which name other builders' arguments)."""
    from maskplan_core import masks

    with expect(InputValueError, ValueError, "built by masks.document for 1 sample of 64 rows",
                "one list of document lengths per sample"):  # fmt: skip
        plan(masks.document([32, 32]), *fixed_qkv(b=2, sq=64, sk=64))
    with expect(InputValueError, ValueError, "built by masks.document for 1 sample of 60 rows"):
        plan(masks.document([30, 30]), *fixed_qkv(b=1, sq=64, sk=64))
    with expect(InputValueError, ValueError, "built by masks.document_ids", "doc_ids.expand(B, -1)"):
        plan(masks.document_ids(torch.zeros(64, dtype=torch.int64)), *fixed_qkv(b=2, sq=64, sk=64))


def test_a_mask_func_of_another_dtype_names_its_conversion():
    """Endpoints of another dtype (their shape says so) are cast; an additive float mask and a 0/1
    integer mask (a padding mask) are dense masks, converted by masks.from_dense."""
    with expect(InputTypeError, TypeError, "mask_func", "int64", "mask_func.int()"):
        plan(causal().long(), *fixed_qkv())
    additive = torch.zeros(B, 1, SQ, SK)
    with expect(InputTypeError, TypeError, "mask_func", "float32", "masks.from_dense(mask == 0)"):
        plan(additive, *fixed_qkv())
    with expect(InputTypeError, TypeError, "mask_func", "int64", "masks.from_dense(mask.bool())"):
        plan(torch.ones(B, SK, dtype=torch.int64), *fixed_qkv())


def test_the_key_record_follows_each_varlen_sample():
    """Varlen samples are aligned each by its own key count: a causal mask for keys 80, 40 is
    refused for keys 40, 80 (the same total) and plans for its own; a sample of no query rows
    holds no endpoints, so its keys do not count."""
    from maskplan_core import masks

    cu_q = [0, 64, 128, 128]
    mask = masks.causal(cu_seqlens_q=cu_q, cu_seqlens_k=[0, 80, 120, 150])
    (q, _, _), varlen = _varlen_qkv(cu_q)

    def run(cu_k):
        k = torch.randn(cu_k[-1], HQ, D)
        cu_k = torch.tensor(cu_k, dtype=torch.int32)
        return plan(mask, q, k, k, cu_seqlens_q=varlen["cu_seqlens_q"], cu_seqlens_k=cu_k,
                    max_seqlen_q=64, max_seqlen_k=80)  # fmt: skip

    with expect(InputValueError, ValueError, "built by masks.causal for 2 samples of 80, 40 keys",
                "k has 2 samples of 40, 80 keys"):  # fmt: skip
        run([0, 40, 120, 150])
    run([0, 80, 120, 121])
    with expect(SeqlenError, ValueError, "cu_seqlens_k decreases at index 2"):  # not "samples of 80, -10"
        run([0, 80, 70, 150])


def test_a_varlen_dense_mask_names_cu_seqlens_k_for_other_keys():
    from maskplan_core import masks

    cu_q, cu_k = [0, 50, 128], [0, 80, 120]
    dense = torch.zeros(1, 128, 80, dtype=torch.bool)
    dense[:, :, :40] = True
    mask = masks.from_dense(dense, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    (q, _, _), varlen = _varlen_qkv(cu_q)
    k = torch.randn(120, HQ, D)
    swapped = torch.tensor([0, 40, 120], dtype=torch.int32)
    with expect(InputValueError, ValueError, "2 samples of 80, 40 keys", "from_dense(mask, cu_seqlens_q"):
        plan(mask, q, k, k, cu_seqlens_q=varlen["cu_seqlens_q"], cu_seqlens_k=swapped, max_seqlen_q=78,
             max_seqlen_k=80)  # fmt: skip


def test_prefixes_that_do_not_fit_q_are_named_before_the_sample_record():
    """A mask recorded for samples 100, 0, 1, 155 planned with cu_seqlens_q ending at 250 for q of
    256 rows: the error is the prefixes' (their end is not q's rows), not the mask's samples."""
    from maskplan_core import masks

    cu = [0, 100, 100, 101, 256]
    mask = masks.causal(cu_seqlens_q=cu, cu_seqlens_k=cu)
    t = torch.randn(256, HQ, D)
    stale = torch.tensor([0, 100, 100, 101, 250], dtype=torch.int32)
    with expect(SeqlenError, ValueError, "cu_seqlens_q", "250", "256"):
        plan(mask, t, t, t, cu_seqlens_q=stale, cu_seqlens_k=torch.tensor(cu, dtype=torch.int32),
             max_seqlen_q=155, max_seqlen_k=155)  # fmt: skip
    moved = torch.tensor([0, 200, 200, 201, 256], dtype=torch.int32)  # sample 0 past max_seqlen_q
    with expect(SeqlenError, ValueError, "cu_seqlens_q gives sample 0 length 200", "max_seqlen_q = 155"):
        plan(mask, t, t, t, cu_seqlens_q=moved, cu_seqlens_k=torch.tensor(cu, dtype=torch.int32),
             max_seqlen_q=155, max_seqlen_k=155)  # fmt: skip


def test_only_a_recorded_mask_reads_varlen_prefixes_back(monkeypatch):
    """A GPU plan build reads 8 sizes back; the sample check's read of cu_seqlens happens only for
    a builder's mask (a copy, or endpoints of one's own, never read them there)."""
    from maskplan_core import masks, validation

    cu = [0, 64, 128]
    mask = masks.causal(cu_seqlens_q=cu, cu_seqlens_k=cu)
    (q, k, v), varlen = _varlen_qkv(cu)
    calls = []
    real = validation._varlen_samples
    monkeypatch.setattr(validation, "_varlen_samples", lambda *a: calls.append(a) or real(*a))
    plan(mask.clone(), q, k, v, **varlen)
    assert calls == []
    plan(mask, q, k, v, **varlen)
    assert len(calls) == 1


def test_a_flat_document_mask_for_varlen_samples_gets_the_varlen_hint():
    """Varlen samples of other lengths cannot take one list of document lengths per sample (the
    builder wants equal totals): the hint says how to build their mask."""
    from maskplan_core import masks

    cu = [0, 50, 128]
    flat = masks.document([20, 30, 78])
    (q, k, v), varlen = _varlen_qkv(cu)
    with expect(InputValueError, ValueError, "built by masks.document for 1 sample of 128 rows",
                "torch.cat([masks.document(lens_b)"):  # fmt: skip
        plan(flat, q, k, v, **varlen)
    per_sample = torch.cat([masks.document([20, 30]), masks.document([78])], dim=2)
    plan(per_sample, q, k, v, **varlen)


def test_endpoint_negative():
    ep = causal(hmask=HQ, nfunc=3)
    ep[2, 0, 7] = -3
    ep[2, 1, 7] = -1
    with expect(EndpointError, ValueError, "mask_func[2, 0, 7]", "-3", "row 7"):
        plan(ep, *fixed_qkv())


@pytest.mark.parametrize("value", [-1000, -(2**31)], ids=["far-below", "int32-min"])
def test_endpoint_far_below_zero(value):
    """The planner reads malformed endpoints safely (clamped) until it reports them."""
    ep = causal(nfunc=3)
    ep[0, :, 5] = torch.tensor([value, value, value], dtype=torch.int32)
    with expect(EndpointError, ValueError, "mask_func[0, 0, 5]", str(value), "row 5"):
        plan(ep, *fixed_qkv())


def test_endpoints_unordered():
    ep = causal(hmask=HQ, nfunc=5)
    ep[1, :, 11] = torch.tensor([3, 9, 6, 10, 12], dtype=torch.int32)
    with expect(EndpointError, ValueError, "mask_func[1, :, 11]", "sorted", "6", "9"):
        plan(ep, *fixed_qkv())


def test_first_culprit_is_named():
    ep = causal(nfunc=3)
    ep[0, 1, 40] = SK + 5
    ep[0, 0, 12] = SK + 2  # earlier row
    with expect(EndpointError, ValueError, "row 12", str(SK + 2)):
        plan(ep, *fixed_qkv())


def test_range_is_checked_against_the_samples_own_k_len():
    """Varlen: an endpoint within max_seqlen_k but beyond its own sample's k_len is rejected."""
    ep = varlen_mask()
    ep[0, 2, 3] = 7  # sample 0 has k_len 7: fine
    plan(ep, *varlen_qkv(), **varlen_args())
    ep[0, 2, 9] = 1  # row 9 belongs to sample 2, whose k_len is 0 (max_seqlen_k is 7)
    with expect(EndpointError, ValueError, "mask_func[0, 2, 9]", "= 1", "row 9", "k_len = 0"):
        plan(ep, *varlen_qkv(), **varlen_args())


def test_range_error_is_reported_before_order_error():
    ep = causal(nfunc=3)
    ep[0, :, 5] = torch.tensor([9, 4, 6], dtype=torch.int32)  # unordered row 5
    ep[0, 2, 40] = SK + 3  # out-of-range row 40
    with expect(EndpointError, ValueError, "row 40", "outside"):
        plan(ep, *fixed_qkv())


def test_prefix_error_is_reported_before_endpoint_errors():
    """A malformed prefix makes every row's k_len meaningless: it is reported first."""
    ep = varlen_mask()
    ep[0, 0, 0] = -1
    with expect(SeqlenError, ValueError, "cu_seqlens_k[0]"):
        plan(ep, *varlen_qkv(), **varlen_args(cu_k=[1, 7, 10, 10]))


def test_endpoint_equal_to_k_len_and_empty_intervals_are_valid():
    ep = causal(nfunc=5)
    ep[0, :, 0] = torch.tensor([0, 0, SK, SK, SK], dtype=torch.int32)
    ep[0, :, 1] = torch.tensor([4, 4, 4, 9, 9], dtype=torch.int32)
    plan(ep, *fixed_qkv())


# --------------------------------------------------------------------------------------------------
# varlen arguments (spec 3.2)
# --------------------------------------------------------------------------------------------------

VARLEN_NAMES = ("cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k")


@pytest.mark.parametrize(
    "given", [("cu_seqlens_q",), ("cu_seqlens_q", "cu_seqlens_k"), ("max_seqlen_q", "max_seqlen_k"),
              ("cu_seqlens_q", "cu_seqlens_k", "max_seqlen_k"), ("max_seqlen_q",)],
)
def test_varlen_needs_all_four_arguments(given):
    args = {name: value for name, value in varlen_args().items() if name in given}
    missing = [n for n in VARLEN_NAMES if n not in given]
    with expect(InputValueError, ValueError, *missing):
        validate_plan_inputs(varlen_mask(), *varlen_qkv(), **args)


@pytest.mark.parametrize("name", ["cu_seqlens_q", "cu_seqlens_k"])
@pytest.mark.parametrize(
    "make, cls, builtin, needles",
    [
        (lambda t: t.to(torch.int64), InputTypeError, TypeError, ("int32", "int64", ".int()")),
        (lambda t: t.float(), InputTypeError, TypeError, ("int32",)),
        (lambda t: t.tolist(), InputTypeError, TypeError, ("Tensor", "dtype=torch.int32, device=q.device")),
        (lambda t: t[None], InputValueError, ValueError, ("rank-1",)),
        (lambda t: t[:1], InputValueError, ValueError, ("rank-1", "(1,)")),
        (lambda t: t.repeat_interleave(2)[::2], InputValueError, ValueError, ("contiguous", ".contiguous()")),
        (lambda t: t.to("meta"), InputValueError, ValueError, ("meta",)),
    ],
    ids=["int64", "float", "list", "rank2", "one-entry", "non-contiguous", "meta-device"],
)
def test_cu_seqlens_structure(name, make, cls, builtin, needles):
    args = varlen_args()
    args[name] = make(args[name])
    with expect(cls, builtin, name, *needles):
        validate_plan_inputs(varlen_mask(), *varlen_qkv(), **args)


def test_cu_seqlens_shapes_differ():
    args = varlen_args(cu_k=[0, 10])
    with expect(InputValueError, ValueError, "cu_seqlens_q", "cu_seqlens_k", "(4,)", "(2,)"):
        validate_plan_inputs(varlen_mask(), *varlen_qkv(), **args)


@pytest.mark.parametrize(
    "name, value, cls, needles",
    [
        ("max_seqlen_k", -4, InputValueError, (">= 0", "-4")),
        ("max_seqlen_q", 11.0, InputTypeError, ("int", "float")),
        ("max_seqlen_k", True, InputTypeError, ("int", "bool")),
        ("max_seqlen_k", torch.tensor(7), InputTypeError, ("int", "Tensor", "max_seqlen_k.item()")),
        ("max_seqlen_k", 2**31, InputValueError, ("2147483648", "int32")),
    ],
)
def test_max_seqlen_values(name, value, cls, needles):
    args = varlen_args()
    args[name] = value
    builtin = TypeError if cls is InputTypeError else ValueError
    with expect(cls, builtin, name, *needles):
        validate_plan_inputs(varlen_mask(), *varlen_qkv(), **args)


@pytest.mark.parametrize(
    "kw, qkv, needles",
    [
        (dict(cu_q=[1, 5, 5, 16]), (16, 10), ("cu_seqlens_q[0] must be 0", "got 1")),
        (dict(cu_k=[2, 7, 10, 10]), (16, 10), ("cu_seqlens_k[0] must be 0", "got 2")),
        (dict(cu_q=[0, 5, 5, 15]), (16, 10), ("cu_seqlens_q[-1]", "16", "got 15")),
        (dict(cu_k=[0, 7, 10, 12]), (16, 10), ("cu_seqlens_k[-1]", "10", "got 12")),
        (dict(cu_q=[0, 9, 5, 16]), (16, 10), ("cu_seqlens_q", "decreases at index 2", "9 -> 5")),
        (dict(cu_k=[0, 7, 3, 10]), (16, 10), ("cu_seqlens_k", "decreases at index 2", "7 -> 3")),
        (dict(max_q=10), (16, 10), ("cu_seqlens_q", "sample 2 length 11", "max_seqlen_q = 10")),
        (dict(max_k=6), (16, 10), ("cu_seqlens_k", "sample 0 length 7", "max_seqlen_k = 6")),
    ],
    ids=["q-start", "k-start", "q-end", "k-end", "q-decreasing", "k-decreasing", "q-max", "k-max"],
)
def test_cu_seqlens_values(kw, qkv, needles):
    ep = torch.zeros(1, 1, qkv[0], dtype=torch.int32)  # all rows empty: only the prefix is wrong
    with expect(SeqlenError, ValueError, *needles):
        plan(ep, *varlen_qkv(*qkv), **varlen_args(**kw))


def test_host_prefix_rule_is_the_planners_first_flag():
    """``broken_prefix_rule`` (which names a prefix's broken rule, and lets the sample check step
    aside for it) breaks a rule exactly where the planner's prefix flags do, and names the
    lowest-numbered one, on random prefixes that break none, one or several rules."""
    from maskplan_core.error_flags import broken_prefix_rule, prefix_error_flags

    words = ("[0] must be 0", "[-1] must equal", "decreases at", "more than max_seqlen")
    g = torch.Generator().manual_seed(0)
    seen = set()
    for _ in range(400):
        n = int(torch.randint(1, 6, (1,), generator=g))
        cu = torch.randint(-2, 12, (n + 1,), generator=g).sort().values
        if torch.rand(1, generator=g) < 0.5:
            cu = cu[torch.randperm(n + 1, generator=g)]
        if torch.rand(1, generator=g) < 0.5:
            cu = cu - cu[0]
        total = int(cu[-1]) + int(torch.randint(-1, 2, (1,), generator=g))
        max_len = int(torch.randint(0, 12, (1,), generator=g))
        flags = prefix_error_flags(cu.to(torch.int32), total, max_len, is_q=False)
        rule = broken_prefix_rule("cu_seqlens_k", cu.tolist(), total, max_len)
        if flags == 0:
            assert rule is None, (cu.tolist(), total, max_len, rule)
            continue
        first = (flags >> 4 & -(flags >> 4)).bit_length() - 1
        assert rule is not None and rule.startswith("cu_seqlens_k") and words[first] in rule, (cu, rule)
        seen.add(first)
    assert seen == {0, 1, 2, 3}


# --------------------------------------------------------------------------------------------------
# q / k / v (spec 4.1)
# --------------------------------------------------------------------------------------------------


def test_max_seqlen_0_plans_a_batch_of_empty_samples():
    """``max_seqlen = seqlens.max()`` of a batch whose samples are all empty is 0: an empty problem,
    as a fixed-length batch of S = 0 is; with a token in some sample it is refused by name."""
    empty = dict(cu_seqlens_q=torch.tensor([0, 0, 0], dtype=torch.int32), max_seqlen_q=0, max_seqlen_k=0)
    empty["cu_seqlens_k"] = empty["cu_seqlens_q"]
    geometry = validate_plan_inputs(torch.zeros(1, 1, 0, dtype=torch.int32), *varlen_qkv(0, 0), **empty)
    assert (geometry.total_q, geometry.max_seqlen_q, geometry.max_seqlen_k) == (0, 0, 0)
    with expect(SeqlenError, ValueError, "cu_seqlens_q", "sample 0 length 5", "max_seqlen_q = 0"):
        plan(varlen_mask(), *varlen_qkv(), **varlen_args(max_q=0))


def _replace(index: int, tensor):
    def make():
        qkv = list(fixed_qkv())
        qkv[index] = tensor
        return qkv

    return make


@pytest.mark.parametrize(
    "make, cls, needles",
    [
        (_replace(0, torch.zeros(B * SQ, HQ, D)), InputValueError, ("q", "rank 4", "BSHD")),
        (_replace(1, torch.zeros(B, SK, HKV, D, 1)), InputValueError, ("k", "rank 4")),
        (_replace(2, torch.zeros(B * SK, HKV, D)), InputValueError, ("v", "rank 4")),
        (_replace(0, [[0.0]]), InputTypeError, ("q", "Tensor")),
        (_replace(2, None), InputTypeError, ("v", "Tensor")),
        (_replace(1, fixed_qkv(dtype=torch.float64)[1]), InputTypeError, ("k", "float64", "float32")),
        (_replace(2, fixed_qkv(dtype=torch.float16)[2]), InputTypeError, ("v", "float16", "float32")),
        (lambda: [t.to(torch.int32) for t in fixed_qkv()], InputTypeError, ("dtype", "int32")),
        (_replace(1, torch.zeros(B, SK, HKV, D + 8)), InputValueError, ("q", "k", "head dims", str(D + 8))),
        (lambda: fixed_qkv(hq=3, hkv=2), InputValueError, ("q heads (3)", "k/v heads (2)")),
        (lambda: fixed_qkv(hq=2, hkv=4), InputValueError, ("q heads (2)", "k/v heads (4)")),
        (_replace(2, torch.zeros(B, SK + 1, HKV, D)), InputValueError, ("k", "v", str(SK + 1))),
        (_replace(2, torch.zeros(B, SK, HKV + 2, D)), InputValueError, ("k", "v", str(HKV + 2))),
        (_replace(1, torch.zeros(B + 1, SK, HKV, D)), InputValueError, ("k", "v")),
        (lambda: (fixed_qkv()[0], *fixed_qkv(b=B + 1)[1:]), InputValueError, ("q", "k", "batch", str(B + 1))),
        (_replace(0, torch.zeros(B, SQ, HQ, 2 * D)[..., ::2]), InputValueError, ("q", "contiguous")),
        (_replace(1, torch.zeros(B, SK, HKV, D, device="meta")), InputValueError, ("k", "meta", "cpu")),
        (lambda: fixed_qkv(b=0), InputValueError, ("q", "nonzero")),
        (lambda: [t[..., :0] for t in fixed_qkv()], InputValueError, ("head dims", ">= 1", "q/k 0")),
        (_replace(2, torch.zeros(B, SK, HKV, 0)), InputValueError, ("head dims", ">= 1", "v 0")),
    ],
    ids=[
        "q-rank3", "k-rank5", "v-rank3", "q-not-tensor", "v-none", "k-dtype", "v-dtype", "int-dtype",
        "head-dim", "hq-not-multiple", "hkv-gt-hq", "kv-seq", "kv-heads", "k-batch", "qk-batch",
        "q-non-contiguous", "k-device", "batch-zero", "qk-dim-zero", "v-dim-zero",
    ],
)
def test_qkv_structure(make, cls, needles):
    q, k, v = make()
    fixed_4d = isinstance(q, torch.Tensor) and q.dim() == 4
    mask_func = causal(total_q=q.shape[0] * q.shape[1] if fixed_4d else B * SQ)
    builtin = TypeError if cls is InputTypeError else ValueError
    with expect(cls, builtin, *needles):
        validate_plan_inputs(mask_func, q, k, v)


def test_varlen_qkv_must_be_thd():
    q, k, v = fixed_qkv()
    with expect(InputValueError, ValueError, "q", "THD", "rank 3"):
        validate_plan_inputs(varlen_mask(), q, k, v, **varlen_args())


def test_prefixes_are_cloned():
    args = varlen_args()
    g = validate_plan_inputs(varlen_mask(), *varlen_qkv(), **args)
    args["cu_seqlens_q"][1] = 3
    args["cu_seqlens_k"].zero_()
    assert g.cu_seqlens_q.tolist() == CU_Q and g.cu_seqlens_k.tolist() == CU_K


def test_a_shard_of_query_positions_is_pointed_to_select_rows():
    """q holding some positions of each sample (a context-parallel shard) with the whole sequence's
    mask, or a builder's mask of the shard's row count (bottom-right: the last positions, other
    keys than the shard's), is refused with a hint to take the shard's rows, which then plan."""
    from maskplan_core import masks

    whole = masks.causal(64, batch=2)
    mine = [*range(8, 16), *range(48, 56)]
    q, k, v = fixed_qkv(sq=16, sk=64)
    for mask in (whole, whole.clone()):
        with expect(InputValueError, ValueError, "masks.select_rows(mask_func, positions, batch=2)"):
            plan(mask, q, k, v)
    with expect(InputValueError, ValueError, "rows as the last seqlen_q", "masks.select_rows of its whole"):
        plan(masks.causal(16, batch=2), q, k, v)
    with expect(InputValueError, ValueError, "masks.select_rows(mask_func, positions, batch=1)"):
        plan(whole[..., :64].clone(), q[:1], k[:1], v[:1])
    plan(masks.select_rows(whole, mine), q, k, v)
    with expect(InputValueError, ValueError, "masks.causal(seqlen_q, seqlen_k, ...), or") as info:
        plan(masks.causal(16, align="top_left", batch=2), q, k, v)  # its rows are the first positions
    assert "last seqlen_q" not in str(info.value)


def test_a_prefix_buffer_refilled_behind_torchs_back_is_read_anew():
    """A reused cu_seqlens buffer refilled through a write torch does not count (a numpy alias, as a
    collective's): the sample check reads its values, not those its mask's builder saw."""
    from maskplan_core import masks

    cu = torch.tensor([0, 64, 128], dtype=torch.int32)
    stale = masks.causal(cu_seqlens_q=cu, cu_seqlens_k=cu)
    cu.numpy()[1] = 32
    t = torch.randn(128, HQ, D)
    kw = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=96, max_seqlen_k=96)
    with expect(InputValueError, ValueError, "built by masks.causal for 2 samples of 64 rows", "32, 96"):
        plan(stale, t, t, t, **kw)
    plan(masks.causal(cu_seqlens_q=cu, cu_seqlens_k=cu), t, t, t, **kw)
