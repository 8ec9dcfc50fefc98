"""Tests for maskplan_core.masks.builders: every analytic builder against a brute-force dense mask."""

from __future__ import annotations

import itertools
import re

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from mask_oracle import FAST, assert_matches, decode, dense_from_rule

from maskplan_core import SeqlenError, masks

# --------------------------------------------------------------------------------------------------
# causal
# --------------------------------------------------------------------------------------------------


#: the diagonal's offset from the row where the sample's query and key counts differ
SHIFT = {"bottom_right": lambda sq, sk: sk - sq, "top_left": lambda sq, sk: 0}
ALIGNS = st.sampled_from(list(SHIFT))


def ref_causal(sq: int, sk: int, batch: int, align: str = "bottom_right") -> torch.Tensor:
    rows = [i for _ in range(batch) for i in range(sq)]
    return dense_from_rule(rows, sk, lambda i, k: k < i + 1 + SHIFT[align](sq, sk))


@FAST
@given(st.integers(1, 9), st.integers(1, 9), st.integers(1, 3), ALIGNS)
def test_causal_matches_dense(sq, sk, batch, align):
    ep = masks.causal(sq, sk, batch=batch, align=align)
    assert ep.shape == (1, 1, batch * sq)
    assert_matches(ep, ref_causal(sq, sk, batch, align), sk)


@pytest.mark.parametrize("sq,sk", [(3, 7), (7, 3), (5, 5)])
def test_top_left_causal_is_sdpas_is_causal(sq, sk):
    """SDPA's is_causal masks with ``ones(L, S).tril()`` (torch's documented equivalent), as does
    flex_attention's ``kv_idx <= q_idx``: ``align="top_left"`` gives it (the facade's hint for
    ``is_causal=True``)."""
    sdpa = torch.ones(sq, sk, dtype=torch.bool).tril()[None, None].expand(2, 1, sq, sk)
    assert torch.equal(masks.causal(sq, sk, batch=2, align="top_left"), masks.from_dense(sdpa))


def test_causal_default_square():
    ep = masks.causal(4)
    assert ep.tolist() == [[[1, 2, 3, 4]]]
    assert torch.equal(masks.causal(4, device="cpu"), masks.causal(4, 4, device=torch.device("cpu")))


def test_causal_more_queries_than_keys_gives_empty_rows():
    ep = masks.causal(5, 2)
    assert ep.tolist() == [[[0, 0, 0, 1, 2]]]


# --------------------------------------------------------------------------------------------------
# sliding_window
# --------------------------------------------------------------------------------------------------


def ref_sliding(sq: int, sk: int, wl: int, wr: int, batch: int, align: str = "bottom_right") -> torch.Tensor:
    rows = [i for _ in range(batch) for i in range(sq)]

    def rule(i, k):
        d = i + SHIFT[align](sq, sk)
        return d - wl <= k <= d + wr

    return dense_from_rule(rows, sk, rule)


@FAST
@given(
    sq=st.integers(1, 9), sk=st.integers(1, 9), wl=st.integers(0, 10), wr=st.integers(0, 10),
    batch=st.integers(1, 3), align=ALIGNS,
)  # fmt: skip
def test_sliding_window_matches_dense(sq, sk, wl, wr, batch, align):
    ep = masks.sliding_window(sq, sk, window_left=wl, window_right=wr, batch=batch, align=align)
    assert ep.shape == (1, 3, batch * sq)
    ref = ref_sliding(sq, sk, wl, wr, batch, align)
    assert_matches(ep, ref, sk)
    assert bool((ep[:, 0] == 0).all())
    # rows with no visible key have all endpoints equal
    empty = ~ref[0].any(-1)
    assert bool((ep[0, :, empty] == ep[0, :1, empty]).all())


def test_sliding_window_out_of_range_rows_are_all_zero():
    # Sq > Sk: first rows' windows lie entirely left of key 0; window_right=0
    ep = masks.sliding_window(6, 2, window_left=1)
    assert ep[0, :, 0].tolist() == [0, 0, 0]
    assert ep[0, :, 1].tolist() == [0, 0, 0]
    assert ep[0, :, 2].tolist() == [0, 0, 0]
    assert ep[0, :, 4].tolist() == [0, 0, 1]
    # Sq < Sk with a huge left window offset: nothing empty, but windows clip at 0
    assert masks.sliding_window(2, 5, window_left=100).tolist() == [[[0, 0], [0, 0], [4, 5]]]


@pytest.mark.parametrize(
    "q_lens,k_lens",
    [([3, 0, 5, 2], [4, 6, 5, 0]), ([1], [1]), ([7, 2], [2, 7])],
    ids=["mixed", "one", "cross"],
)
def test_varlen_causal_and_sliding_window_are_the_samples_concatenated(q_lens, k_lens):
    """Each sample aligned by its own lengths: the fixed builder per sample, rows of samples without
    keys see nothing, samples without queries add no rows."""
    cu_q = torch.tensor([0, *itertools.accumulate(q_lens)], dtype=torch.int32)
    cu_k = torch.tensor([0, *itertools.accumulate(k_lens)], dtype=torch.int32)
    builders = [(masks.causal, {}, 1), (masks.sliding_window, {"window_left": 2, "window_right": 1}, 3)]
    for (build, kw, nfunc), align in itertools.product(builders, SHIFT):
        kw = {**kw, "align": align}
        parts = [
            build(sq, sk, **kw) if sk else torch.zeros(1, nfunc, sq, dtype=torch.int32)
            for sq, sk in zip(q_lens, k_lens, strict=True)
            if sq
        ]
        want = torch.cat(parts, dim=2)
        assert torch.equal(build(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, **kw), want)
        assert torch.equal(build(cu_seqlens_q=cu_q.tolist(), cu_seqlens_k=cu_k.tolist(), **kw), want)


def test_an_alignment_other_than_the_two_is_refused_naming_them():
    for build, kw in ((masks.causal, {}), (masks.sliding_window, {"window_left": 2})):
        refusal = r"align must be one of \('bottom_right', 'top_left'\), got 'top-left'"
        with pytest.raises(ValueError, match=refusal):
            build(4, 6, align="top-left", **kw)


def test_varlen_builder_argument_errors():
    with pytest.raises(ValueError, match="given together"):
        masks.causal(cu_seqlens_q=[0, 2])
    with pytest.raises(ValueError, match="leave seqlen_q, seqlen_k and batch unset"):
        masks.sliding_window(4, window_left=1, cu_seqlens_q=[0, 2], cu_seqlens_k=[0, 2])
    with pytest.raises(ValueError, match="leave seqlen_q, seqlen_k and batch unset"):  # True == 1
        masks.causal(cu_seqlens_q=[0, 2], cu_seqlens_k=[0, 2], batch=True)
    with pytest.raises(ValueError, match="same length"):
        masks.causal(cu_seqlens_q=[0, 2, 3], cu_seqlens_k=[0, 2])
    with pytest.raises(TypeError, match="seqlen_q is required"):
        masks.causal()


@pytest.mark.parametrize(
    "cu_q, match",
    [([0], "at least 2"), ([1, 3], "start at 0"), ([0, 3, 2], "non-decreasing"), ([0, 2**31], "int32")],
)
def test_malformed_cu_seqlens_are_seqlen_errors(cu_q, match):
    """A builder's malformed prefix raises the planner's SeqlenError (a ValueError), as the planner does."""
    with pytest.raises(SeqlenError, match=match):
        masks.causal(cu_seqlens_q=cu_q, cu_seqlens_k=[0] * len(cu_q))


@FAST
@given(
    st.integers(1, 6), st.integers(0, 9), st.lists(st.integers(0, 9), min_size=1, max_size=3), st.booleans()
)
def test_seqused_k_is_the_builder_at_each_samples_used_keys(sq, sk, used, varlen):
    """Sample ``b`` with ``seqused_k[b]`` keys in use (a static KV cache's written slots) is the
    builder at those keys: aligned to the last one, the rest hidden; recorded for all ``seqlen_k``."""
    used = [min(u, sk) for u in used]
    window = {"window_left": 2, "window_right": 1}
    builders = {
        "causal": (masks.causal, {}),
        "causal top-left": (masks.causal, {"align": "top_left"}),
        "full": (masks.full, {}),
        "sliding": (masks.sliding_window, window),
        "sliding top-left": (masks.sliding_window, {**window, "align": "top_left"}),
    }
    n = len(used)
    lengths = dict(seqlen_q=sq, seqlen_k=sk, batch=n)
    if varlen:
        cu = lambda length: [length * b for b in range(n + 1)]  # noqa: E731
        lengths = dict(cu_seqlens_q=cu(sq), cu_seqlens_k=cu(sk))
    for build, kw in builders.values():
        want = torch.cat([build(sq, u, **kw) for u in used], dim=2)
        assert torch.equal(build(**lengths, seqused_k=torch.tensor(used), **kw), want)


def test_seqused_k_errors():
    with pytest.raises(ValueError, match=r"seqused_k has 2 entries for 3 samples"):
        masks.causal(1, 8, batch=3, seqused_k=[4, 5])
    with pytest.raises(ValueError, match=r"seqused_k\[1\] = 9: must be within the sample's 8 keys"):
        masks.full(1, 8, batch=2, seqused_k=[4, 9])
    with pytest.raises(TypeError, match="seqused_k must hold integers"):
        masks.sliding_window(1, 8, window_left=2, seqused_k=torch.tensor([4.0]))


# --------------------------------------------------------------------------------------------------
# document
# --------------------------------------------------------------------------------------------------


def ref_document(seqs: list[list[int]], causal: bool, wl) -> torch.Tensor:
    rows = []
    for seq in seqs:
        start = 0
        for n in seq:
            for i in range(start, start + n):
                rows.append((start, start + n, i))
            start += n
    s = sum(seqs[0])

    def rule(r, k):
        lo, hi, i = r
        if wl is not None:
            lo = max(lo, i - wl)
        if causal:
            hi = i + 1
        return lo <= k < hi

    return dense_from_rule(rows, s, rule)


@st.composite
def doc_batches(draw):
    total = draw(st.integers(1, 10))
    batch = draw(st.integers(1, 3))
    seqs = []
    for _ in range(batch):
        cuts = sorted(draw(st.lists(st.integers(0, total), max_size=4)))
        bounds = [0, *cuts, total]
        seqs.append([b - a for a, b in itertools.pairwise(bounds)])  # may contain zero-length docs
    return seqs


@FAST
@given(doc_batches(), st.booleans(), st.one_of(st.none(), st.integers(0, 6)), st.booleans())
def test_document_matches_dense(seqs, causal, wl, as_tensor):
    s = sum(seqs[0])
    if len(seqs) == 1 and as_tensor:
        arg = torch.tensor(seqs[0])
    elif len(seqs) == 1:
        arg = seqs[0]
    else:
        arg = seqs
    ep = masks.document(arg, causal=causal, window_left=wl)
    assert ep.shape == (1, 3, len(seqs) * s)
    assert_matches(ep, ref_document(seqs, causal, wl), s)


def test_document_examples():
    assert masks.document([2, 3]).tolist() == [[[0] * 5, [0, 0, 2, 2, 2], [1, 2, 3, 4, 5]]]
    assert masks.document([2, 3], causal=False).tolist() == [[[0] * 5, [0, 0, 2, 2, 2], [2, 2, 5, 5, 5]]]
    assert masks.document([4], window_left=1).tolist() == [[[0] * 4, [0, 0, 1, 2], [1, 2, 3, 4]]]
    two_d = masks.document(torch.tensor([[1, 2], [2, 1]]))
    assert torch.equal(two_d, masks.document([[1, 2], [2, 1]]))
    np = pytest.importorskip("numpy")  # a numpy array of lengths reads as the lists it holds
    assert torch.equal(masks.document(np.array([[1, 2], [2, 1]])), two_d)
    assert torch.equal(masks.document(np.array([[1, 2], [3]], dtype=object)), masks.document([[1, 2], [3]]))
    with pytest.raises(TypeError, match=r"doc_lens\[0\] must be an int, got float"):
        masks.document(np.array([1.0, 2.0]))


@FAST
@given(doc_batches(), st.booleans(), st.one_of(st.none(), st.integers(0, 6)), st.integers(0, 2**31 - 2))
def test_document_ids_is_document_of_the_runs(seqs, causal, wl, seed):
    """Per-token ids (random values, each document's differing from its neighbour's) give the same
    endpoints as the document lengths; empty documents have no tokens and leave no trace."""
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for seq in seqs:
        ids, prev = [], None
        for n in (n for n in seq if n):
            value = int(torch.randint(0, 3, (1,), generator=gen))
            value = value if value != prev else value + 1  # a new run
            ids += [value] * n
            prev = value
        rows.append(ids)
    doc_ids = torch.tensor(rows) if len(rows) > 1 else torch.tensor(rows[0])
    got = masks.document_ids(doc_ids, causal=causal, window_left=wl)
    assert torch.equal(got, masks.document(seqs, causal=causal, window_left=wl))


def test_document_ids_takes_runs_and_checks_its_argument():
    same = masks.document_ids(torch.tensor([[0, 0, 1, 1, 1], [4, 9, 9, 4, 4]], dtype=torch.int32))
    assert torch.equal(same, masks.document([[2, 3], [1, 2, 2]]))
    with pytest.raises(TypeError, match="doc_ids must be an integer tensor"):
        masks.document_ids(torch.zeros(4))
    with pytest.raises(TypeError, match="doc_ids must be a torch.Tensor"):
        masks.document_ids([0, 0, 1])
    with pytest.raises(ValueError, match=r"doc_ids must be \[S\] or \[B, S\]"):
        masks.document_ids(torch.zeros(2, 2, 2, dtype=torch.long))
    with pytest.raises(ValueError, match="window_left"):
        masks.document_ids(torch.zeros(3, dtype=torch.long), window_left=-1)


def test_a_window_per_head_is_told_the_mask_mod_that_gives_it():
    """A tensor (or list) of windows is no builder's argument; sliding_window's refusal gives the
    mask_mod of a window per head (each head's the builder's mask at that head's window), and
    refusals whose mask that mask_mod is not (window_right, a document's window) give none."""
    sizes = torch.tensor([3, 10])
    for windows in (sizes, [3, 10]):
        with pytest.raises(TypeError, match=r"window_left must be an int.*masks\.from_mask_mod\(lambda"):
            masks.sliding_window(32, window_left=windows)
    for refused_without_hint in (
        lambda: masks.sliding_window(32, window_left=3, window_right=[1, 2]),
        lambda: masks.document([[32]], window_left=sizes),
    ):
        with pytest.raises(TypeError, match="must be an int") as plain:
            refused_without_hint()
        assert "from_mask_mod" not in str(plain.value)
    with pytest.raises(TypeError) as refused:
        masks.sliding_window(32, window_left=sizes)
    rule = re.search(r"from_mask_mod\((lambda b, h, q, kv: .*?), B,", str(refused.value)).group(1)
    per_head = masks.from_mask_mod(eval(rule, {"window": sizes}), 1, 2, 32, 32)
    for h, w in enumerate(sizes.tolist()):
        builder = masks.sliding_window(32, window_left=w)
        assert torch.equal(decode(per_head[h : h + 1], 32), decode(builder, 32))


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("window_left", [None, 20])
def test_document_chunks_count_from_each_documents_start(causal, window_left):
    """chunk_size: chunked attention inside each document (chunks from the document's start), the
    mask_mod of that rule; document_ids gives the same; a chunk past every document changes nothing."""
    lens = [[100, 0, 156], [256]]
    doc = torch.tensor([[0] * 100 + [1] * 156, [0] * 256])
    start = torch.stack([torch.tensor([0] * 100 + [100] * 156), torch.zeros(256, dtype=torch.long)])

    def rule(b, h, q, kv):
        seen = (doc[b][q] == doc[b][kv]) & ((q - start[b][q]) // 48 == (kv - start[b][kv]) // 48)
        if causal:
            seen = seen & (kv <= q)
        return seen if window_left is None else seen & (kv >= q - window_left)

    chunked = masks.document(lens, causal=causal, window_left=window_left, chunk_size=48)
    assert torch.equal(decode(chunked, 256), decode(masks.from_mask_mod(rule, 2, 1, 256, 256), 256))
    by_ids = masks.document_ids(doc, causal=causal, window_left=window_left, chunk_size=48)
    assert torch.equal(chunked, by_ids)
    whole = masks.document(lens, causal=causal, window_left=window_left)
    assert torch.equal(masks.document(lens, causal=causal, window_left=window_left, chunk_size=256), whole)
    with pytest.raises(ValueError, match="chunk_size"):
        masks.document(lens, chunk_size=0)


@pytest.mark.parametrize("window_left,chunk_size", [(None, None), (20, None), (None, 48)], ids=str)
def test_document_prefixes_are_prefix_lm_inside_each_document(window_left, chunk_size):
    """prefix_lens / prefix: a document's prefix tokens see one another both ways, every token its
    document's keys up to itself (the mask_mod of that rule, with a window or chunks on top);
    document_ids' prefix tokens give the same, and a prefix run away from a document's start too."""
    lens, prefixes = [[100, 0, 156], [256]], [[30, 0, 156], [0]]
    doc = torch.tensor([[0] * 100 + [1] * 156, [0] * 256])
    start = torch.stack([torch.tensor([0] * 100 + [100] * 156), torch.zeros(256, dtype=torch.long)])
    prefix = torch.zeros(2, 256, dtype=torch.bool)
    prefix[0, :30] = prefix[0, 100:] = True

    def rule(b, h, q, kv):
        seen = (doc[b][q] == doc[b][kv]) & ((kv <= q) | (prefix[b][q] & prefix[b][kv]))
        if chunk_size is not None:
            seen = seen & ((q - start[b][q]) // chunk_size == (kv - start[b][kv]) // chunk_size)
        return seen if window_left is None else seen & (kv >= q - window_left)

    options = dict(window_left=window_left, chunk_size=chunk_size)
    want = decode(masks.from_mask_mod(rule, 2, 1, 256, 256), 256)
    by_lens = masks.document(lens, prefix_lens=prefixes, **options)
    assert torch.equal(decode(by_lens, 256), want)
    assert torch.equal(masks.document_ids(doc, prefix=prefix, **options), by_lens)
    no_prefix = masks.document(lens, prefix_lens=[[0, 0, 0], [0]], **options)
    assert torch.equal(no_prefix, masks.document(lens, **options))
    middle = torch.zeros(1, 256, dtype=torch.bool)
    middle[0, 40:60] = True  # a prompt in the middle of a document: only that run sees both ways
    rule_middle = lambda b, h, q, kv: (kv <= q) | (middle[0][q] & middle[0][kv])  # noqa: E731
    assert torch.equal(
        decode(masks.document_ids(torch.zeros(256, dtype=torch.long), prefix=middle[0]), 256),
        decode(masks.from_mask_mod(rule_middle, 1, 1, 256, 256), 256),
    )


def test_document_prefixes_are_checked():
    with pytest.raises(ValueError, match=r"prefix_lens\[0\]\[1\] must be in \[0, 0\]"):
        masks.document([[4, 0], [4]], prefix_lens=[[1, 1], [0]])
    with pytest.raises(ValueError, match="one prefix per document"):
        masks.document([[4, 4]], prefix_lens=[[1]])
    with pytest.raises(ValueError, match=r"prefix_lens\[1\] must be in \[0, 4\]"):
        masks.document([4, 4], prefix_lens=[1, 5])
    with pytest.raises(ValueError, match="only causal documents"):
        masks.document([4, 4], prefix_lens=[1, 1], causal=False)
    with pytest.raises(TypeError, match="prefix_lens must hold integers, got a tensor of dtype torch.bool"):
        masks.document([4, 4], prefix_lens=torch.tensor([True, False]))
    by_tensor = masks.document([4, 4], prefix_lens=torch.tensor([1, 2]))
    assert torch.equal(by_tensor, masks.document([4, 4], prefix_lens=[1, 2]))
    ids = torch.zeros(2, 8, dtype=torch.long)
    with pytest.raises(TypeError, match="prefix must be a bool tensor"):
        masks.document_ids(ids, prefix=torch.zeros(2, 8, dtype=torch.long))
    with pytest.raises(ValueError, match=r"prefix must be shaped as doc_ids \(2, 8\)"):
        masks.document_ids(ids, prefix=torch.zeros(8, dtype=torch.bool))


@pytest.mark.parametrize("causal", [True, False])
def test_document_ids_pad_rows_see_nothing(causal):
    """With pad_id the padding rows see no key (endpoints 0, 0, 0); every other row sees what it
    saw without it (a padding run is a document of its own, which no other row sees)."""
    ids = torch.tensor([[3, 3, 3, -1, -1], [5, 5, 6, 6, -1]])
    plain, padded = masks.document_ids(ids, causal=causal), masks.document_ids(ids, causal=causal, pad_id=-1)
    pad = (ids == -1).reshape(-1)
    assert bool((padded[:, :, pad] == 0).all())
    assert torch.equal(padded[:, :, ~pad], plain[:, :, ~pad])
    assert torch.equal(masks.document_ids(ids, causal=causal, pad_id=7), plain)  # no such id
    with pytest.raises(TypeError, match="pad_id must be an int"):
        masks.document_ids(ids, pad_id=-1.0)
    # torch compares ids with a scalar cast to their dtype: -1 would be uint8's 255, a document's id
    wrapped = r"pad_id = -1 is not a value of doc_ids' dtype torch.uint8 \(0 .. 255\)"
    with pytest.raises(ValueError, match=wrapped):
        masks.document_ids(torch.tensor([[0, 0, 255, 255]], dtype=torch.uint8), pad_id=-1)
    with pytest.raises(ValueError, match="pad_id = 18446744073709551616 is not a value"):
        masks.document_ids(ids, pad_id=2**64)


def test_fixed_length_builders_refuse_more_rows_than_int32_offsets_reach():
    """A batch of B x S rows past int32 is refused before the rows are made (it was an allocation
    of tens of GB, or the process killed, where create_mask_plan would refuse it anyway)."""
    for build, name in (
        (lambda: masks.causal(1, batch=2**31), "batch"),
        (lambda: masks.sliding_window(2**16, window_left=4, batch=2**15), "batch"),
        (lambda: masks.chunked(2**16, 4, batch=2**15), "batch"),
        (lambda: masks.prefix_lm(2**16, 3, batch=2**15), "batch"),
        (lambda: masks.prefix_lm(2**16, [3] * 2**15), r"len\(prefix_len\)"),
    ):
        with pytest.raises(ValueError, match=f"^{name} x seqlen = .* = 2147483648 rows of .*int32 offsets"):
            build()
    with pytest.raises(ValueError, match="= 0 rows of 1099511627776 samples"):  # empty samples count too
        masks.causal(0, batch=2**40)


@pytest.mark.parametrize(
    "dtype", [torch.uint8, torch.int8, torch.int16, torch.uint16, torch.uint32, torch.int32]
)
@pytest.mark.parametrize("causal", [True, False])
def test_document_ids_of_any_integer_dtype(dtype, causal):
    """Ids from a data loader come in narrow dtypes too; S may exceed what they can hold."""
    seqs = [[150, 40000 - 150]] if dtype.itemsize >= 2 else [[150, 150]]
    ids = torch.cat([torch.full((n,), d, dtype=dtype) for d, n in enumerate(seqs[0])])
    assert torch.equal(masks.document_ids(ids, causal=causal), masks.document(seqs, causal=causal))


# --------------------------------------------------------------------------------------------------
# prefix_lm
# --------------------------------------------------------------------------------------------------


def ref_prefix(s: int, prefixes: list[int]) -> torch.Tensor:
    rows = [(p, i) for p in prefixes for i in range(s)]
    return dense_from_rule(rows, s, lambda r, k: k < r[0] or k <= r[1])


@FAST
@given(st.integers(1, 9), st.lists(st.integers(0, 12), min_size=1, max_size=3), st.booleans())
def test_prefix_lm_matches_dense(s, prefixes, per_batch):
    if per_batch:
        ep = masks.prefix_lm(s, prefixes)
        expect = prefixes
    else:
        ep = masks.prefix_lm(s, prefixes[0], batch=len(prefixes))
        expect = [prefixes[0]] * len(prefixes)
    assert ep.shape == (1, 1, len(expect) * s)
    assert_matches(ep, ref_prefix(s, expect), s)


def test_prefix_lm_batch_and_tensor_forms():
    assert masks.prefix_lm(3, 2).tolist() == [[[2, 2, 3]]]
    assert torch.equal(masks.prefix_lm(3, torch.tensor([1, 2])), masks.prefix_lm(3, [1, 2], batch=2))
    assert torch.equal(masks.prefix_lm(3, torch.tensor(2)), masks.prefix_lm(3, 2))
    with pytest.raises(ValueError, match="batch"):
        masks.prefix_lm(3, [1, 2], batch=3)
    with pytest.raises(ValueError, match=r"prefix_len\[1\]"):
        masks.prefix_lm(3, [1, -2])


# --------------------------------------------------------------------------------------------------
# chunked
# --------------------------------------------------------------------------------------------------


def ref_chunked(s: int, chunk: int, causal: bool, batch: int) -> torch.Tensor:
    rows = [i for _ in range(batch) for i in range(s)]

    def rule(i, k):
        same = k // chunk == i // chunk
        return same and (k <= i or not causal)

    return dense_from_rule(rows, s, rule)


@FAST
@given(st.integers(1, 12), st.integers(1, 14), st.booleans(), st.integers(1, 3))
def test_chunked_matches_dense(s, chunk, causal, batch):
    ep = masks.chunked(s, chunk, causal=causal, batch=batch)
    assert ep.shape == (1, 3, batch * s)
    assert_matches(ep, ref_chunked(s, chunk, causal, batch), s)


def test_document_ids_recipe_for_packed_sft_batches():
    """document_ids' recipe from a data loader's position ids, attention mask and labels: a row
    opening with the tail of a document, prompts (labels -100) seen both ways, padding seeing
    nothing and seen by nobody."""
    pos = torch.tensor([[37, 38, 39, 0, 1, 2, 3, 0, 1, 0, 0]])
    attention_mask = torch.tensor([[1, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0]])
    labels = torch.tensor([[5, 5, 5, -100, -100, 5, 5, -100, 5, -100, -100]])
    ids = (pos == 0).cumsum(-1).masked_fill(attention_mask == 0, -1)
    endpoints = masks.document_ids(ids, prefix=labels == -100, pad_id=-1)
    doc, prompt = torch.tensor([0, 0, 0, 1, 1, 1, 1, 2, 2, -1, -1]), labels[0] == -100

    def rule(b, h, q, kv):  # each document's prompt is one run
        return (doc[q] == doc[kv]) & (doc[q] >= 0) & ((kv <= q) | (prompt[q] & prompt[kv]))

    assert torch.equal(decode(endpoints, 11), decode(masks.from_mask_mod(rule, 1, 1, 11, 11), 11))


@pytest.mark.parametrize(
    "build",
    [
        lambda cq, ck: masks.causal(cu_seqlens_q=cq, cu_seqlens_k=ck),
        lambda cq, ck: masks.full(cu_seqlens_q=cq, cu_seqlens_k=ck),
        lambda cq, ck: masks.sliding_window(cu_seqlens_q=cq, cu_seqlens_k=ck, window_left=8),
    ],
)
def test_a_varlen_builder_reads_each_prefix_tensor_back_once(build, monkeypatch):
    """On a GPU each host read of a device tensor is a round trip that waits for the stream: a
    varlen builder reads each prefix tensor once and checks it on the host (it took seven reads)."""
    reads = []
    for name in ("tolist", "item", "__int__", "__bool__", "__index__"):
        real = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name, lambda t, *a, _real=real: reads.append(t) or _real(t, *a))
    cq, ck = torch.tensor([0, 64, 128], dtype=torch.int32), torch.tensor([0, 80, 150], dtype=torch.int32)
    build(cq, ck)
    assert len(reads) == 2 and reads[0] is cq and reads[1] is ck
