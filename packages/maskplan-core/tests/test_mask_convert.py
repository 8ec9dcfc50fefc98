"""Tests for maskplan_core.masks.convert: from_dense, from_mask_mod and from_block_mask round trips
against brute-force dense masks, and what they refuse."""

from __future__ import annotations

import inspect
import re
import threading

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from mask_oracle import FAST, assert_matches, check_wellformed, decode, minimal_nfunc

from maskplan_core import masks
from maskplan_core.errors import InputValueError
from maskplan_core.masks import convert

# --------------------------------------------------------------------------------------------------
# from_dense
# --------------------------------------------------------------------------------------------------


def bool_tensor(draw, shape) -> torch.Tensor:
    n = 1
    for d in shape:
        n *= d
    flat = draw(st.lists(st.booleans(), min_size=n, max_size=n))
    return torch.tensor(flat, dtype=torch.bool).reshape(shape)


@st.composite
def fixed_masks(draw):
    h = draw(st.integers(1, 3))
    t = draw(st.integers(0, 8))
    sk = draw(st.integers(1, 9))
    return bool_tensor(draw, (h, t, sk))


@st.composite
def varlen_masks(draw):
    b = draw(st.integers(1, 4))
    h = draw(st.integers(1, 3))
    q_lens = draw(st.lists(st.integers(0, 4), min_size=b, max_size=b))
    k_lens = draw(st.lists(st.integers(0, 6), min_size=b, max_size=b))
    sk = max(k_lens) + draw(st.integers(0, 2))
    t = sum(q_lens)
    dense = bool_tensor(draw, (h, t, sk))
    row_klen = torch.repeat_interleave(torch.tensor(k_lens), torch.tensor(q_lens))
    dense &= torch.arange(sk)[None, None, :] < row_klen[None, :, None]
    cu_q = torch.tensor([0, *q_lens]).cumsum(0).to(torch.int32)
    cu_k = torch.tensor([0, *k_lens]).cumsum(0).to(torch.int32)
    return dense, cu_q, cu_k, row_klen


@FAST
@given(fixed_masks())
def test_from_dense_round_trip_fixed(dense):
    ep = masks.from_dense(dense)
    h, t, sk = dense.shape
    assert ep.shape == (h, minimal_nfunc(dense), t)
    assert_matches(ep, dense, sk)


@FAST
@given(varlen_masks())
def test_from_dense_round_trip_varlen(case):
    dense, cu_q, cu_k, row_klen = case
    ep = masks.from_dense(dense, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    h, t, sk = dense.shape
    assert ep.shape == (h, minimal_nfunc(dense), t)
    check_wellformed(ep, row_klen)
    assert torch.equal(decode(ep, sk), dense)


@FAST
@given(fixed_masks())
def test_from_dense_padding_repeats_last_endpoint(dense):
    ep = masks.from_dense(dense)
    # a row's representation is its minimal endpoints followed by copies of its last endpoint
    for hh in range(dense.shape[0]):
        for r in range(dense.shape[1]):
            need = minimal_nfunc(dense[hh : hh + 1, r : r + 1])
            row = ep[hh, :, r].tolist()
            assert all(v == row[need - 1] for v in row[need:])
            if not dense[hh, r].any():
                assert row == [0] * len(row)


def test_from_dense_examples():
    t, f = True, False
    m = torch.tensor([[[t, f, t, t], [f, t, f, f], [f, f, f, f], [t, t, t, t]]])
    ep = masks.from_dense(m)
    assert ep.tolist() == [[[1, 0, 0, 4], [2, 1, 0, 4], [4, 2, 0, 4]]]
    # all rows start True with one run -> nfunc 1
    assert masks.from_dense(torch.ones(2, 3, 5, dtype=torch.bool)).tolist() == [[[5, 5, 5]]] * 2
    # all False -> nfunc 1, zeros
    assert masks.from_dense(torch.zeros(1, 2, 3, dtype=torch.bool)).tolist() == [[[0, 0]]]
    # no rows at all
    assert masks.from_dense(torch.zeros(1, 0, 3, dtype=torch.bool)).shape == (1, 1, 0)


def test_from_dense_matches_builders():
    dense = decode(masks.sliding_window(7, 9, window_left=2, window_right=1, batch=2), 9)
    assert torch.equal(decode(masks.from_dense(dense), 9), dense)
    assert torch.equal(masks.from_dense(decode(masks.causal(5, 7, batch=2), 7)), masks.causal(5, 7, batch=2))


def test_from_dense_large_chunked(monkeypatch):
    # force many row chunks in the encoder and check it still round-trips
    monkeypatch.setattr(convert, "_CHUNK_ELEMENTS", 64)
    g = torch.Generator().manual_seed(0)
    dense = torch.rand(2, 57, 13, generator=g) < 0.4
    ep = masks.from_dense(dense)
    assert ep.shape[1] == minimal_nfunc(dense)
    assert_matches(ep, dense, 13)


def test_from_dense_validation():
    with pytest.raises(TypeError, match="mask"):
        masks.from_dense([[[True]]])
    with pytest.raises(TypeError, match="mask"):
        masks.from_dense(torch.ones(1, 2, 3, dtype=torch.int32))
    with pytest.raises(TypeError, match=r"hidden: pass mask == 0; a 0 / 1 mask: mask.bool\(\)"):
        masks.from_dense(torch.zeros(1, 1, 2, 3))  # SDPA's float attn_mask
    with pytest.raises(ValueError, match=r"\[None, None\].expand\(B, 1, Sq, Sk\); a \[B, Sk\] key-padding"):
        masks.from_dense(torch.ones(2, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match="mask"):
        masks.from_dense(torch.ones(0, 2, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"at least one head \(Hmask >= 1\)"):  # SDPA's [B, 0, Sq, Sk]
        masks.from_dense(torch.zeros(1, 0, 4, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"at least one sample \(B >= 1\)"):  # SDPA's [0, H, Sq, Sk]
        masks.from_dense(torch.ones(0, 1, 4, 4, dtype=torch.bool))
    with pytest.raises(TypeError, match=r"dense \(strided\) tensor, got layout torch.sparse_coo \(mask.to_"):
        masks.from_dense(torch.ones(1, 4, 4, dtype=torch.bool).to_sparse())
    with pytest.raises(TypeError, match=r"got dtype torch.int8 \(a 0 / 1 mask: mask.bool\(\)\)"):
        masks.from_dense(torch.ones(1, 4, 4, dtype=torch.int8))
    m = torch.ones(1, 3, 4, dtype=torch.bool)
    with pytest.raises(ValueError, match="cu_seqlens"):
        masks.from_dense(m, cu_seqlens_q=torch.tensor([0, 3], dtype=torch.int32))
    with pytest.raises(ValueError, match="cu_seqlens_q"):
        masks.from_dense(m, cu_seqlens_q=torch.tensor([0, 2]), cu_seqlens_k=torch.tensor([0, 4]))
    with pytest.raises(ValueError, match="cu_seqlens_k"):
        masks.from_dense(m, cu_seqlens_q=torch.tensor([0, 3]), cu_seqlens_k=torch.tensor([1, 4]))
    with pytest.raises(ValueError, match="non-decreasing"):
        masks.from_dense(m, cu_seqlens_q=torch.tensor([0, 3, 2, 3]), cu_seqlens_k=torch.tensor([0, 1, 2, 3]))
    with pytest.raises(ValueError, match="same length"):
        masks.from_dense(m, cu_seqlens_q=torch.tensor([0, 3]), cu_seqlens_k=torch.tensor([0, 1, 2]))
    with pytest.raises(TypeError, match="cu_seqlens_q"):
        masks.from_dense(m, cu_seqlens_q=torch.tensor([0.0, 3.0]), cu_seqlens_k=torch.tensor([0, 4]))
    with pytest.raises(ValueError, match="k_len"):
        masks.from_dense(m, cu_seqlens_q=torch.tensor([0, 3]), cu_seqlens_k=torch.tensor([0, 5]))


def test_from_dense_varlen_rejects_keys_past_k_len():
    m = torch.zeros(2, 5, 4, dtype=torch.bool)
    cu_q = torch.tensor([0, 2, 2, 5], dtype=torch.int32)
    cu_k = torch.tensor([0, 4, 7, 9], dtype=torch.int32)  # k_lens 4, 3, 2
    m[:, :2, :] = True  # sample 0 may use all 4 keys
    m[:, 2:, :2] = True
    ep = masks.from_dense(m, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    assert ep.tolist() == [[[4, 4, 2, 2, 2]]] * 2
    m[1, 3, 2] = True  # row 3 is in sample 2 (k_len 2)
    with pytest.raises(ValueError, match=r"row 3\b.*head 1.*sample 2"):
        masks.from_dense(m, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    # list forms of cu_seqlens are accepted too
    m[1, 3, 2] = False
    assert torch.equal(masks.from_dense(m, cu_seqlens_q=[0, 2, 2, 5], cu_seqlens_k=[0, 4, 7, 9]), ep)


# --------------------------------------------------------------------------------------------------
# from_mask_mod
# --------------------------------------------------------------------------------------------------


def test_from_mask_mod_causal_is_head_independent():
    ep = masks.from_mask_mod(lambda b, h, q, kv: kv <= q, 2, 4, 5, 5)
    assert ep.shape[0] == 1
    assert torch.equal(decode(ep, 5), decode(masks.causal(5, batch=2), 5))
    assert torch.equal(masks.from_mask_mod(lambda b, h, q, kv: kv <= q, 2, None, 5, 5), ep)


def test_from_mask_mod_head_and_batch_dependent():
    B, H, Sq, Sk = 3, 2, 4, 6

    def rule(b, h, q, kv):
        return ((kv - q) % (h + 2) == 0) | (kv < b)

    ep = masks.from_mask_mod(rule, B, H, Sq, Sk, device="cpu")
    assert ep.shape[0] == H
    ref = torch.tensor(
        [
            [
                [bool(((k - q) % (h + 2) == 0) or (k < b)) for k in range(Sk)]
                for b in range(B)
                for q in range(Sq)
            ]
            for h in range(H)
        ]
    )
    assert ep.shape[1] == minimal_nfunc(ref)
    assert_matches(ep, ref, Sk)


def test_from_mask_mod_is_evaluated_as_torch_evaluates_it():
    """mask_mods written for torch see 0-d indices: chained indexing works; H=None or 1 with a
    mask_mod that reads its head index is refused (torch calls it per head), H=Hq is not, nor H=1
    where mask_mod cannot be evaluated at head 1 (a model of one head)."""
    docs = torch.tensor([[0] * 32 + [1] * 32, [0] * 16 + [1] * 48])
    chained = masks.from_mask_mod(lambda b, h, q, kv: docs[b][q] == docs[b][kv], 2, None, 64, 64)
    indexed = masks.from_mask_mod(lambda b, h, q, kv: docs[b, q] == docs[b, kv], 2, None, 64, 64)
    assert torch.equal(chained, indexed)
    assert torch.equal(decode(chained, 64), decode(masks.document([[32, 32], [16, 48]], causal=False), 64))

    def window_per_head(b, h, q, kv):
        return (q >= kv) & (q - kv < 4 + 8 * h)

    # H=1 is create_block_mask's one head entry for every head: torch still calls mask_mod per head
    for shared in (None, 1):
        with pytest.raises(InputValueError, match="reads its head index.*pass H=Hq"):
            masks.from_mask_mod(window_per_head, 1, shared, 64, 64)
    assert masks.from_mask_mod(window_per_head, 1, 4, 64, 64).shape[0] == 4
    window = torch.tensor([6])  # one entry per head, of one head: torch never calls it at head 1

    def table_per_head(b, h, q, kv):
        return (q >= kv) & (q - kv < window[h])

    one_head_hint = r"reads its head index.*a model of one head, give it head 0: (lambda .*)$"
    with pytest.raises(InputValueError, match=one_head_hint) as refused:
        masks.from_mask_mod(table_per_head, 1, None, 64, 64)
    assert masks.from_mask_mod(table_per_head, 1, 1, 64, 64).shape[0] == 1
    # the hint's rewrite runs where a mask_mod that reads its head index is refused for one head
    rewrite = re.search(one_head_hint, str(refused.value)).group(1)
    head_zero = eval(rewrite, {"torch": torch, "mask_mod": window_per_head})
    assert torch.equal(
        masks.from_mask_mod(head_zero, 1, 1, 64, 64), masks.from_mask_mod(window_per_head, 1, 2, 64, 64)[:1]
    )


def test_a_shared_head_mask_mod_is_refused_wherever_it_reads_its_head_index(monkeypatch):
    """With one mask for every head, a mask_mod that reads its head index is refused, wherever the
    heads first differ (here at head 2: heads 0 and 1 are global, the others local), in
    from_mask_mod and from_block_mask, and in any sample (one that branches on its sample index in
    Python, or indexes a list with it, is followed per sample); one that reads the head index even
    where every head agrees is refused too (H=Hq keeps one mask). Where the check cannot tell (an
    evaluation it cannot follow), head 1 is compared with head 0."""
    fa = pytest.importorskip("torch.nn.attention.flex_attention")
    cpu = torch.device("cpu")

    def global_then_local(b, h, q, kv):
        return (kv <= q) & ((h < 2) | (q - kv < 16))

    assert convert._reads_head(global_then_local, cpu, 1)
    with pytest.raises(InputValueError, match="reads its head index.*H=None: pass H=Hq"):
        masks.from_mask_mod(global_then_local, 1, None, 256, 256)
    block_mask = fa.create_block_mask(global_then_local, 1, None, 256, 256, device="cpu")
    with pytest.raises(InputValueError, match="reads its head index.*pass heads=Hq"):
        masks.from_block_mask(block_mask)
    per_head = masks.from_mask_mod(global_then_local, 1, 4, 256, 256)
    assert torch.equal(per_head[0], per_head[1]) and not torch.equal(per_head[1], per_head[2])
    with pytest.raises(InputValueError, match=r"at head 2; the block mask was made with H=None \(or 1\)"):
        masks.from_block_mask(block_mask, heads=4)  # head 0's full blocks are not head 2's

    def same_for_every_head(b, h, q, kv):
        return (kv <= q) & (h >= 0)

    with pytest.raises(InputValueError, match="reads its head index"):
        masks.from_mask_mod(same_for_every_head, 1, None, 64, 64)
    assert torch.equal(masks.from_mask_mod(same_for_every_head, 1, 4, 64, 64), masks.causal(64))

    window, lengths = torch.tensor([3, 3, 7, 9]), [10, 12]  # heads 2, 3 differ; a Python list by b

    def per_sample_python(b, h, q, kv):
        return (kv <= q) & (q - kv < window[h]) & (kv < lengths[b])

    def second_sample_reads_it(b, h, q, kv):  # sample 0 never reads h
        return (kv <= q + window[h]) if b > 0 else (kv <= q)

    for mask_mod in (per_sample_python, second_sample_reads_it):
        assert convert._reads_head(mask_mod, cpu, 2)
        with pytest.raises(InputValueError, match="reads its head index"):
            masks.from_mask_mod(mask_mod, 2, None, 16, 16)
    assert not convert._reads_head(second_sample_reads_it, cpu, 1)
    assert not convert._reads_head(lambda b, h, q, kv: kv <= q, cpu, 3)

    monkeypatch.setattr(convert, "_reads_head", lambda *args: None)  # cannot tell: head 1 against head 0
    with pytest.raises(InputValueError, match="reads its head index"):
        masks.from_mask_mod(lambda b, h, q, kv: kv <= q + h, 1, None, 64, 64)
    one_entry = torch.tensor([6])  # fails at head 1: the refusal says so; H=1 takes it as one head's

    def window_of_one_head(b, h, q, kv):
        return (kv <= q) & (q - kv < one_entry[h])

    with pytest.raises(InputValueError, match=r"evaluated at head 1 .* raised there \(IndexError"):
        masks.from_mask_mod(window_of_one_head, 1, None, 64, 64)
    assert masks.from_mask_mod(window_of_one_head, 1, 1, 64, 64).shape[0] == 1


def test_the_head_index_check_is_the_calling_threads_alone():
    """The check follows h in a dispatch mode, which is the calling thread's: two threads asking at
    once both get the answer, and nothing of the process (nn.Module's call) is patched, so a
    torch.compile elsewhere in the process is not disturbed (fx tracing patched both). torch's
    process-wide "in a dispatch mode" flag is left unset (two modes entered at once left it set,
    and every later eager attention call took the traced route)."""
    from torch.utils._python_dispatch import is_in_torch_dispatch_mode

    call = torch.nn.Module.__call__

    def global_then_local(b, h, q, kv):
        return (kv <= q) & ((h < 2) | (q - kv < 16))

    answers = []

    def ask():
        answers.extend(convert._reads_head(global_then_local, torch.device("cpu"), 1) for _ in range(20))

    threads = [threading.Thread(target=ask) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert answers == [True] * 40
    assert torch.nn.Module.__call__ is call
    assert not is_in_torch_dispatch_mode()


@pytest.mark.parametrize("reads", ["none", "tensor", "list", "branch"])
def test_from_mask_mod_of_no_batch_evaluates_once_unless_it_reads_b(reads):
    """``B=None`` with ``batch=``: torch calls the mask_mod with each sample's index, so the
    endpoints are the per-sample conversion's; a mask_mod that does not read ``b`` is evaluated
    once for every sample (as many calls as for one sample), one that does (an operation on it, a
    list indexed with it, a Python branch on it) once per sample. Recorded for ``batch`` samples."""
    from maskplan_core.endpoint_samples import check_samples

    widths = [3, 5, 2]
    calls = []

    def window(b, h, q, kv):
        calls.append(1)
        width = {
            "none": lambda: 3,
            "tensor": lambda: 3 + b,
            "list": lambda: widths[b],
            "branch": lambda: 4 if b == 1 else 2,
        }[reads]()
        return (kv <= q) & (q - kv < width)

    got = masks.from_mask_mod(window, None, None, 6, 6, batch=3)
    per_sample = len(calls)
    calls.clear()
    assert torch.equal(got, masks.from_mask_mod(window, 3, None, 6, 6))
    calls.clear()
    masks.from_mask_mod(window, None, None, 6, 6, batch=1)
    assert (per_sample == len(calls)) == (reads == "none"), (per_sample, len(calls))
    check_samples(got, lambda: ([6] * 3, [6] * 3))
    with pytest.raises(ValueError, match="built by masks.from_mask_mod for 3 samples of 6 rows"):
        check_samples(got, lambda: ([6] * 2, [6] * 2))


def test_from_mask_mod_with_python_control_flow_says_why():
    """Python `and` / `if` and `.item()` on the index tensors fail under torch.vmap, as in torch:
    the error says so and names the tensor operators; other errors of the mask_mod pass through
    unchanged."""
    with pytest.raises(InputValueError, match="under torch.vmap.*`&`"):
        masks.from_mask_mod(lambda b, h, q, kv: (q >= kv) and (q - kv < 4), 1, None, 8, 8)
    with pytest.raises(InputValueError, match=r"under torch.vmap.*`\.item\(\)`"):
        masks.from_mask_mod(lambda b, h, q, kv: kv <= q.item(), 1, None, 8, 8)
    with pytest.raises(InputValueError, match="under torch.vmap"):
        masks.from_mask_mod(lambda b, h, q, kv: kv <= q.tolist(), 1, None, 8, 8)
    with pytest.raises(InputValueError, match=r"under torch.vmap.*`\.numpy\(\)`"):
        masks.from_mask_mod(lambda b, h, q, kv: kv <= int(q.numpy()), 1, None, 8, 8)
    for shaped_by_values in (
        lambda b, h, q, kv: torch.nonzero(kv <= q).sum() > 0,
        lambda b, h, q, kv: kv[kv <= q].sum() > 0,
    ):
        with pytest.raises(InputValueError, match=r"under torch.vmap.*shape depends on the values \(nonzero"):
            masks.from_mask_mod(shaped_by_values, 1, None, 8, 8)

    def raises(b, h, q, kv):
        raise RuntimeError("the user's own failure")

    with pytest.raises(RuntimeError, match="the user's own failure"):
        masks.from_mask_mod(raises, 1, None, 8, 8)


@st.composite
def dense_4d(draw):
    b = draw(st.integers(1, 3))
    h = draw(st.integers(1, 3))
    sq = draw(st.integers(1, 5))
    sk = draw(st.integers(1, 6))
    dense = bool_tensor(draw, (b, h, sq, sk))
    if draw(st.booleans()):
        dense = dense[:, :1].expand(b, h, sq, sk).clone()  # all heads equal
    return dense


@FAST
@given(dense_4d())
def test_from_mask_mod_round_trip(dense):
    b, h, sq, sk = dense.shape
    ep = masks.from_mask_mod(lambda bi, hi, qi, ki: dense[bi, hi, qi, ki], b, h, sq, sk)
    heads_equal = bool((dense == dense[:, :1]).all())
    flat = dense.permute(1, 0, 2, 3).reshape(h, b * sq, sk)  # row = b * Sq + q
    expect = flat[:1] if heads_equal else flat
    assert ep.shape == (expect.shape[0], minimal_nfunc(flat), b * sq)
    assert_matches(ep, expect, sk)
    # create_block_mask's positional device; SDPA's [B, H, Sq, Sk] dense layout
    by_position = masks.from_mask_mod(lambda bi, hi, qi, ki: dense[bi, hi, qi, ki], b, h, sq, sk, "cpu")
    assert torch.equal(by_position, ep)
    # a create_block_mask call with torch's keywords converts as it is
    by_torch_name = masks.from_mask_mod(
        lambda bi, hi, qi, ki: dense[bi, hi, qi, ki], B=b, H=h, Q_LEN=sq, KV_LEN=sk, device="cpu"
    )
    assert torch.equal(by_torch_name, ep)
    # ... its block options too, which change nothing (endpoints are per element)
    with_blocks = masks.from_mask_mod(
        lambda bi, hi, qi, ki: dense[bi, hi, qi, ki], b, h, sq, sk, "cpu", BLOCK_SIZE=(64, 32), _compile=True,
        separate_full_blocks=False, compute_dq_write_order=True, dq_kv_order=False,
    )  # fmt: skip
    assert torch.equal(with_blocks, ep)
    # every keyword of this torch's create_block_mask is taken
    fa = pytest.importorskip("torch.nn.attention.flex_attention")
    ours = inspect.signature(masks.from_mask_mod).parameters
    assert set(inspect.signature(fa.create_block_mask).parameters) <= set(ours)
    assert torch.equal(masks.from_dense(dense), masks.from_dense(flat))  # SDPA's layout, heads held apart


def test_from_mask_mod_validation():
    with pytest.raises(TypeError, match="mask_mod"):
        masks.from_mask_mod("causal", 1, 1, 2, 2)
    with pytest.raises(TypeError, match="mask_mod"):
        masks.from_mask_mod(lambda b, h, q, kv: (kv <= q).int(), 1, 1, 2, 2)
    with pytest.raises(TypeError, match=r"not a Python value: .* write `kv_idx >= 0`") as err:
        masks.from_mask_mod(lambda b, h, q, kv: True, 1, 1, 2, 2)
    assert "out_dims" not in str(err.value)  # torch's vmap advice, which does not apply
    with pytest.raises(TypeError, match="mask_mod must return a bool torch.Tensor, got tuple"):
        masks.from_mask_mod(lambda b, h, q, kv: (kv <= q, kv <= q), 1, 1, 2, 2)
    with pytest.raises(ValueError, match=r"one bool per .* shape \(3, 3\) for each"):
        masks.from_mask_mod(lambda b, h, q, kv: torch.ones(3, 3, dtype=torch.bool), 1, 1, 2, 2)
    with pytest.raises(ValueError, match="Sq"):
        masks.from_mask_mod(lambda b, h, q, kv: kv <= q, 1, 1, -1, 2)
    with pytest.raises(TypeError, match="B"):
        masks.from_mask_mod(lambda b, h, q, kv: kv <= q, 1.5, 1, 2, 2)
    with pytest.raises(TypeError, match="B=None needs batch=, the samples"):  # torch's B=None
        masks.from_mask_mod(lambda b, h, q, kv: kv <= q, None, 1, 2, 2)
    with pytest.raises(TypeError, match="batch= goes with B=None"):
        masks.from_mask_mod(lambda b, h, q, kv: kv <= q, 2, 1, 2, 2, batch=2)
    with pytest.raises(ValueError, match="batch must be >= 1"):
        masks.from_mask_mod(lambda b, h, q, kv: kv <= q, None, 1, 2, 2, batch=0)
    with pytest.raises(TypeError, match="Sq or Q_LEN .* got both"):
        masks.from_mask_mod(lambda b, h, q, kv: kv <= q, 1, 1, 2, 2, Q_LEN=2)
    with pytest.raises(TypeError, match="Sk or KV_LEN .* got neither"):
        masks.from_mask_mod(lambda b, h, q, kv: kv <= q, 1, 1, Q_LEN=2)
    # a score_mod is named as one (vmap's own error was a missing positional argument)
    with pytest.raises(TypeError, match=r"take \(b, h, q_idx, kv_idx\).* 5 required .* score_mod\(score"):
        masks.from_mask_mod(lambda score, b, h, q, kv: score, 1, None, 2, 2)
    with pytest.raises(TypeError, match=r"take \(b, h, q_idx, kv_idx\).* 3 required"):
        masks.from_mask_mod(lambda b, q, kv: kv <= q, 1, None, 2, 2)
    # create_block_mask's positional BLOCK_SIZE and _compile are taken (and change nothing)
    causal = lambda b, h, q, kv: kv <= q  # noqa: E731
    assert torch.equal(masks.from_mask_mod(causal, 1, None, 16, 16, "cpu", 128, False), masks.causal(16))


def test_from_block_mask_is_its_mask_mod():
    """torch FlexAttention's BlockMask: its mask_mod over its batch, heads and lengths; a B=None
    block mask with ``batch``; per-head masks keep their heads."""
    fa = pytest.importorskip("torch.nn.attention.flex_attention")
    doc = torch.tensor([[0] * 100 + [1] * 150 + [2] * 50, [0] * 300])

    def packed_docs(b, h, q, kv):
        return (doc[b, q] == doc[b, kv]) & (kv <= q)

    block_mask = fa.create_block_mask(packed_docs, 2, None, 300, 300, device="cpu")
    assert torch.equal(masks.from_block_mask(block_mask), masks.from_mask_mod(packed_docs, 2, None, 300, 300))
    shared = fa.create_block_mask(lambda b, h, q, kv: kv <= q, None, None, 200, 200, device="cpu")
    assert torch.equal(masks.from_block_mask(shared, batch=3), masks.causal(200, batch=3))
    per_head = fa.create_block_mask(lambda b, h, q, kv: kv <= q + 50 * h, 1, 3, 200, 200, device="cpu")
    assert masks.from_block_mask(per_head).shape[0] == 3


def test_from_block_mask_evaluates_the_heads_it_is_told():
    """A block mask made with H=None holds head 0's blocks; ``heads`` evaluates its mask_mod at
    every q head (torch calls it with the real head index), and refuses blocks that differ there."""
    fa = pytest.importorskip("torch.nn.attention.flex_attention")

    def shifted(b, h, q, kv):  # a hole h + 1 keys left of the diagonal: every head has the same
        return (kv <= q) & (kv != q - 1 - h)  # visible blocks, and none is full (torch's full blocks
        # skip the mask_mod, so one full only for head 0 would be refused, below)

    shared = fa.create_block_mask(shifted, None, None, 256, 256, device="cpu")
    # one head entry, but torch calls the mask_mod per head; a model of one head is heads=1 here
    # (from_mask_mod's rewrite of the mask_mod is not needed)
    one_head_hint = r"reads its head index.*pass heads=Hq.*pass heads=1$"
    with pytest.raises(InputValueError, match=one_head_hint) as refused:
        masks.from_block_mask(shared)
    assert "lambda" not in str(refused.value)
    assert masks.from_block_mask(shared, heads=1).shape[0] == 1  # a model of one head
    per_head = masks.from_block_mask(shared, heads=2)
    assert torch.equal(per_head, masks.from_mask_mod(shifted, 1, 2, 256, 256))
    assert per_head.shape[0] == 2 and not torch.equal(per_head[0], per_head[1])
    agreeing = fa.create_block_mask(lambda b, h, q, kv: kv <= q, None, None, 256, 256, device="cpu")
    assert torch.equal(masks.from_block_mask(agreeing, heads=4), masks.causal(256))  # Hmask = 1 kept
    widening = fa.create_block_mask(lambda b, h, q, kv: kv <= q + 150 * h, None, None, 256, 256, device="cpu")
    with pytest.raises(ValueError, match="sample 0 leave out .* at head 1; the block mask was made") as info:
        masks.from_block_mask(widening, heads=2)
    assert "from_mask_mod(block_mask.mask_mod, B, H, Sq, Sk)" in str(info.value)
    widening_mod = masks.from_mask_mod(widening.mask_mod, 1, 2, 256, 256)  # the way the hint names
    assert widening_mod.shape[0] == 2
    three = fa.create_block_mask(lambda b, h, q, kv: kv <= q + h, 1, 3, 256, 256, device="cpu")
    diagonal = fa.create_block_mask(lambda b, h, q, kv: kv <= q - 3 * h, None, None, 256, 256, device="cpu")
    with pytest.raises(ValueError, match="wholly visible.* at head 1"):  # block (1, 0): full at head 0 only
        masks.from_block_mask(diagonal, heads=2)
    with pytest.raises(ValueError, match="3 head entries but heads=2"):
        masks.from_block_mask(three, heads=2)
    with pytest.raises(TypeError, match="heads"):
        masks.from_block_mask(shared, heads=2.0)


def test_from_block_mask_refuses_blocks_its_mask_mod_does_not_make():
    fa = pytest.importorskip("torch.nn.attention.flex_attention")
    doc = torch.tensor([[0] * 150 + [1] * 150, [0] * 300])

    def packed_docs(b, h, q, kv):
        return doc[b, q] == doc[b, kv]

    one_entry = fa.create_block_mask(packed_docs, None, None, 300, 300, device="cpu")  # sample 0 only
    with pytest.raises(ValueError, match=r"sample 1 leave out .*made with B=None \(or 1\)"):
        masks.from_block_mask(one_entry, batch=2)
    with pytest.raises(ValueError, match="batch entries"):
        masks.from_block_mask(fa.create_block_mask(packed_docs, 2, None, 300, 300, device="cpu"), batch=3)
    listed_only = fa.BlockMask.from_kv_blocks(  # one full-visibility block per row, no mask_mod
        torch.tensor([[[1, 1, 1]]]),
        torch.zeros(1, 1, 3, 3, dtype=torch.int32),
        BLOCK_SIZE=128,
        seq_lengths=(300, 300),
    )
    with pytest.raises(ValueError, match=r"its mask_mod makes visible .*build that dense .* from_dense"):
        masks.from_block_mask(listed_only)
    with pytest.raises(TypeError, match="BlockMask"):
        masks.from_block_mask(packed_docs)


def test_from_block_mask_takes_listed_blocks_its_mask_mod_leaves_empty():
    """torch computes the mask_mod inside every listed partial block, so blocks listed besides the
    ones it makes visible change nothing: a B=None block mask whose sample 0 sees more blocks than
    sample 1, and a causal one listing an extra block, convert to their mask_mod's endpoints."""
    fa = pytest.importorskip("torch.nn.attention.flex_attention")
    window = torch.tensor([200, 40])

    def local(b, h, q, kv):  # sample 1's window is narrower: its blocks are a subset of sample 0's
        return (kv <= q) & (kv % 2 == 0) & (q - kv < window[b])

    one_entry = fa.create_block_mask(local, None, None, 256, 256, device="cpu", BLOCK_SIZE=64)
    converted = masks.from_block_mask(one_entry, batch=2)
    assert torch.equal(converted, masks.from_mask_mod(local, 2, None, 256, 256))

    def causal(b, h, q, kv):
        return kv <= q

    extra = fa.BlockMask.from_kv_blocks(  # row 0 lists block 1 too, above its diagonal
        torch.tensor([[[2, 2, 3]]]),
        torch.tensor([[[[0, 1, 2], [1, 0, 2], [2, 0, 1]]]], dtype=torch.int32),
        BLOCK_SIZE=128,
        mask_mod=causal,
        seq_lengths=(300, 300),
    )
    assert torch.equal(masks.from_block_mask(extra), masks.causal(300))


def test_from_block_mask_refuses_full_blocks_that_are_partial_for_another_sample():
    """torch applies no mask_mod in a block listed full: a B=None block mask's sample-0 full block
    that is only partly visible for sample 1 is refused (torch would show sample 1 all of it)."""
    fa = pytest.importorskip("torch.nn.attention.flex_attention")
    docs = torch.tensor([[0] * 256, [0] * 64 + [1] * 192])

    def packed_docs(b, h, q, kv):
        return (docs[b, q] == docs[b, kv]) & (q >= kv)

    one_entry = fa.create_block_mask(packed_docs, None, None, 256, 256, device="cpu")
    assert one_entry.to_dense()[0, 0].tolist() == [[1, 0], [1, 1]]  # sample 1's visible blocks too
    with pytest.raises(InputValueError, match="sample 1 leave out .*wholly visible.*made with B=None"):
        masks.from_block_mask(one_entry, batch=2)
    per_sample = fa.create_block_mask(packed_docs, 2, None, 256, 256, device="cpu")
    assert torch.equal(masks.from_block_mask(per_sample), masks.from_mask_mod(packed_docs, 2, None, 256, 256))


def test_mask_mods_are_evaluated_a_few_query_rows_at_a_time(monkeypatch):
    """from_mask_mod and from_block_mask evaluate the mask_mod a chunk of query rows at a time (the
    dense [H, Sq, Sk] never exists whole) and give one evaluation's endpoints; a block mask's chunks
    are whole Q blocks. A head-dependent mask_mod or a contradicting block found only past the
    first chunk is still refused."""
    fa = pytest.importorskip("torch.nn.attention.flex_attention")
    doc = torch.tensor([[0] * 100 + [1] * 156, [0] * 256])

    def packed(b, h, q, kv):
        return (doc[b, q] == doc[b, kv]) & (kv <= q)

    def late(b, h, q, kv):  # reads its head index at rows >= 200 only
        return (kv <= q) & ((q < 200) | (h == 0) | (kv > 0))

    whole = masks.from_mask_mod(packed, 2, None, 256, 256)
    per_sample = fa.create_block_mask(packed, 2, None, 256, 256, device="cpu", BLOCK_SIZE=64)
    one_entry = fa.create_block_mask(packed, None, None, 256, 256, device="cpu", BLOCK_SIZE=64)
    whole_blocks = masks.from_block_mask(per_sample)
    rows, evaluate = [], convert._evaluate
    monkeypatch.setattr(convert, "_evaluate", lambda *args: rows.append(args[3].numel()) or evaluate(*args))
    monkeypatch.setattr(convert, "_CHUNK_ELEMENTS", 40 * 257)  # 40 rows of 256 keys
    assert torch.equal(masks.from_mask_mod(packed, 2, None, 256, 256), whole)
    assert max(rows) == 40 and sum(rows) == 256 * 2  # its trace shows it reads no head index
    rows.clear()
    assert torch.equal(masks.from_block_mask(per_sample), whole_blocks)
    assert set(rows) == {64}
    with pytest.raises(InputValueError, match="reads its head index"):
        masks.from_mask_mod(late, 1, None, 256, 256)
    with pytest.raises(InputValueError, match="sample 1 leave out .*made with B=None"):
        masks.from_block_mask(one_entry, batch=2)  # sample 1 sees block (2, 0), past the first chunks

    # the answer does not depend on the chunks: head 1 reads rows 256 + q of a table of 296, so it
    # differs from head 0 in the first chunk (rows 0-39) and fails in the second; a failure at
    # head 1 means a model of one head with H=1 (H=None refuses it from its trace), as unchunked
    table = torch.cat([torch.arange(1, 257), torch.full((40,), 256)])

    def per_head_rows(b, h, q, kv):
        return kv < table[h * 256 + q]

    assert masks.from_mask_mod(per_head_rows, 1, 1, 256, 256).shape == (1, 1, 256)
    with pytest.raises(InputValueError, match="reads its head index"):
        masks.from_mask_mod(per_head_rows, 1, None, 256, 256)

    def late_heads(b, h, q, kv):  # head 2 shows more in the first chunk, head 1 only past it
        return (kv <= q) | ((h == 2) & (q < 40)) | ((h == 1) & (q >= 128))

    shared = fa.create_block_mask(lambda b, h, q, kv: kv <= q, 1, None, 256, 256, device="cpu", BLOCK_SIZE=64)
    shared.mask_mod = late_heads
    with pytest.raises(InputValueError, match="at head 1;"):  # the first head that differs anywhere
        masks.from_block_mask(shared, heads=3)


def test_from_block_mask_names_a_sliced_block_mask():
    """torch drops a sliced block mask's mask_mod (it raises a RuntimeError when called): the error
    is the library's, naming the slice and the way round it."""
    fa = pytest.importorskip("torch.nn.attention.flex_attention")
    whole = fa.create_block_mask(lambda b, h, q, kv: kv <= q, 2, 1, 256, 256, device="cpu")
    with pytest.raises(InputValueError, match=r"sliced BlockMask .* convert the unsliced.*\.contiguous\(\)"):
        masks.from_block_mask(whole[0])
    assert torch.equal(masks.from_block_mask(whole)[:, :, :256], masks.causal(256))  # sample 0's rows


def test_from_dense_of_an_sdpa_mask_expanded_over_the_heads_keeps_one():
    """SDPA's ``[B, H, Sq, Sk]`` expanded over the heads gives Hmask = 1 (one plan for every head,
    and PackGQA takes it); heads held apart keep H, equal or not (not a choice by the values)."""
    causal = torch.ones(64, 64, dtype=torch.bool).tril()
    expanded = masks.from_dense(causal[None, None].expand(2, 4, 64, 64))
    assert torch.equal(expanded, masks.causal(64, batch=2))
    assert masks.from_dense(causal[None, None].expand(2, 4, 64, 64).contiguous()).shape[0] == 4
    per_head = torch.stack([causal, causal.triu(-8)])[None].expand(2, 2, 64, 64)
    assert masks.from_dense(per_head).shape[0] == 2


def test_a_mask_mod_of_equal_heads_keeps_one_head_of_memory():
    """Equal heads collapse to one, which owns its memory (a slice kept every head's alive)."""
    endpoints = masks.from_mask_mod(lambda b, h, q, kv: kv <= q, 1, 16, 64, 64)
    assert endpoints.shape[0] == 1
    assert endpoints.untyped_storage().nbytes() == endpoints.numel() * endpoints.element_size()
