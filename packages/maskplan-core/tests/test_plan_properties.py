"""Property tests of the reference planner: every view invariant of spec sections 4-5 and 9,
checked against a brute-force dense mask decoded directly from the endpoints.

Plans are built two ways: through ``maskplan_core.reference.build_plan`` with small custom tiles
(many blocks and tails at tiny sizes, so hypothesis is fast), and through the public
``flexattn.create_mask_plan`` (the reference consumer's 128x128 tiles, sequences up to ~400).
Nothing here trusts the library's own decoders: CSR rows, payload bits and the forward
schedule order are recomputed in plain Python.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mask_oracle import decode_within_samples

from maskplan_core import PlanSignature, RowMajorLayout, Topology, ViewConfig, validate_plan_inputs
from maskplan_core.errors import InputValueError
from maskplan_core.reference import build_plan

PROPS = settings(
    max_examples=80,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
PROPS_BIG = settings(PROPS, max_examples=25)

L2_SECTION_BYTES = 50 * 1024 * 1024  # ARCHITECTURE.md "L2 section"
KINDS = ("random", "shared", "causal", "window", "full", "empty")
HEADS = ((1, 1), (2, 1), (4, 2), (3, 3))  # (Hq, Hkv); (3, 3) splits kv heads into two L2 sections
# (forward tile, backward tile) pairs for the small-tile reference config; (8, 40) has payload padding
SMALL_TILES = (((16, 32), (32, 16)), ((8, 40), (16, 16)), ((16, 32), (16, 32)))


# --------------------------------------------------------------------------------------------------
# problem generation
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Problem:
    varlen: bool
    q_lens: tuple[int, ...]
    k_lens: tuple[int, ...]
    max_q: int
    max_k: int
    hq: int
    hkv: int
    hmask: int
    nfunc: int
    kinds: tuple[str, ...]  # one per (mask head, sample)
    seed: int
    dqk: int = 8
    dv: int = 4

    @property
    def batch(self) -> int:
        return len(self.q_lens)

    @property
    def cu_q(self) -> list[int]:
        return _prefix(self.q_lens)

    @property
    def cu_k(self) -> list[int]:
        return _prefix(self.k_lens)


def _prefix(lens) -> list[int]:
    out = [0]
    for n in lens:
        out.append(out[-1] + n)
    return out


@st.composite
def problems(draw, max_len: int, max_batch: int = 3) -> Problem:
    varlen = draw(st.booleans())
    hq, hkv = draw(st.sampled_from(HEADS))
    hmask = draw(st.sampled_from((1, hq)))
    nfunc = draw(st.integers(0, 4)) * 2 + 1
    batch = draw(st.integers(1, max_batch))
    if varlen:
        # a quarter of the samples are empty (q_len 0 and/or k_len 0)
        length = st.tuples(st.integers(0, 3), st.integers(1, max_len)).map(lambda t: t[1] if t[0] else 0)
        lens = st.lists(length, min_size=batch, max_size=batch)
        q_lens, k_lens = draw(lens), draw(lens)
        max_q = max(max(q_lens), 1) + draw(st.integers(0, 3))
        max_k = max(max(k_lens), 1) + draw(st.integers(0, 3))
    else:
        sq, sk = draw(st.integers(1, max_len)), draw(st.integers(1, max_len))
        q_lens, k_lens, max_q, max_k = [sq] * batch, [sk] * batch, sq, sk
    kinds = draw(st.lists(st.sampled_from(KINDS), min_size=hmask * batch, max_size=hmask * batch))
    seed = draw(st.integers(0, 2**31 - 1))
    return Problem(
        varlen, tuple(q_lens), tuple(k_lens), max_q, max_k, hq, hkv, hmask, nfunc, tuple(kinds), seed
    )


def make_endpoints(p: Problem) -> torch.Tensor:
    """int32 [Hmask, nfunc, total_q] of sorted, sample-local endpoints in [0, k_len]."""
    gen = torch.Generator().manual_seed(p.seed)
    cu_q = p.cu_q
    ep = torch.zeros(p.hmask, p.nfunc, cu_q[-1], dtype=torch.int64)
    for h in range(p.hmask):
        for b, (ql, kl) in enumerate(zip(p.q_lens, p.k_lens, strict=True)):
            if ql == 0:
                continue
            kind = p.kinds[h * p.batch + b]
            i = torch.arange(ql)
            vals = torch.full((p.nfunc, ql), kl, dtype=torch.int64)
            if kind == "random":
                vals = torch.randint(0, kl + 1, (p.nfunc, ql), generator=gen)
            elif kind == "shared":  # one row pattern for the whole sample, snapped to multiples of 8
                v = torch.randint(0, kl + 1, (p.nfunc, 1), generator=gen)
                vals = torch.where(v == kl, v, v // 8 * 8).expand(p.nfunc, ql)
            elif kind == "causal" or (kind == "window" and p.nfunc == 1):
                vals[0] = (i + 1 + kl - ql).clamp(0, kl)
            elif kind == "window":
                w = int(torch.randint(1, 40, (1,), generator=gen))
                diag = i + kl - ql
                vals[0] = 0
                vals[1] = (diag - w + 1).clamp(0, kl)
                vals[2] = (diag + 1).clamp(0, kl)
            elif kind == "empty":
                vals.zero_()
            ep[h, :, cu_q[b] : cu_q[b + 1]] = vals.sort(0).values
    return ep.to(torch.int32).contiguous()


def qkv(p: Problem, dtype=torch.float32):
    if p.varlen:
        tq, tk = sum(p.q_lens), sum(p.k_lens)
        shapes = ((tq, p.hq, p.dqk), (tk, p.hkv, p.dqk), (tk, p.hkv, p.dv))
    else:
        b, sq, sk = p.batch, p.q_lens[0], p.k_lens[0]
        shapes = ((b, sq, p.hq, p.dqk), (b, sk, p.hkv, p.dqk), (b, sk, p.hkv, p.dv))
    return tuple(torch.zeros(s, dtype=dtype) for s in shapes)


def varlen_kwargs(p: Problem) -> dict:
    if not p.varlen:
        return {}
    return dict(
        cu_seqlens_q=torch.tensor(p.cu_q, dtype=torch.int32),
        cu_seqlens_k=torch.tensor(p.cu_k, dtype=torch.int32),
        max_seqlen_q=p.max_q,
        max_seqlen_k=p.max_k,
    )


def small_config(direction: str, tile: tuple[int, int]) -> ViewConfig:
    tm, tn = tile
    layout = RowMajorLayout(tm, tn)
    signature = PlanSignature(
        arch_family="reference",
        direction=direction,
        kernel_family="test-small-tiles",
        topology=Topology(tile_m=tm, tile_n=tn),
        mma_layout="none",
        payload=layout.spec,
        scheduler_layout="k-major" if direction == "backward" else "plan-fwd-work-desc-v1",
        dq_order_format="rank_int32" if direction == "backward" else "none",
    )
    return ViewConfig(signature, layout)


def small_plan(p: Problem, tiles, build_backward: bool, ep: torch.Tensor | None = None):
    ep = make_endpoints(p) if ep is None else ep
    q, k, v = qkv(p)
    g = validate_plan_inputs(ep, q, k, v, **varlen_kwargs(p))
    fwd = small_config("forward", tiles[0])
    bwd = small_config("backward", tiles[1]) if build_backward else None
    return ep, build_plan(ep, g, fwd, bwd, "test-small"), torch.float32


# --------------------------------------------------------------------------------------------------
# brute-force block relation
# --------------------------------------------------------------------------------------------------


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def block_states(dense: torch.Tensor, p: Problem, tm: int, tn: int) -> dict:
    """{(h, b, q_block, k_block): ("partial" | "full", tile)} for every non-empty valid block pair.
    A pair is full iff its tile lies entirely inside the sample and every element is visible."""
    out = {}
    cu_q = p.cu_q
    for h in range(p.hmask):
        for b, (ql, kl) in enumerate(zip(p.q_lens, p.k_lens, strict=True)):
            for i in range(cdiv(ql, tm)):
                rows = dense[h, cu_q[b] + i * tm : cu_q[b] + min((i + 1) * tm, ql)]
                for j in range(cdiv(kl, tn)):
                    tile = rows[:, j * tn : min((j + 1) * tn, kl)]
                    if not bool(tile.any()):
                        continue
                    in_bounds = (i + 1) * tm <= ql and (j + 1) * tn <= kl
                    padded = torch.zeros(tm, tn, dtype=torch.bool)
                    padded[: tile.shape[0], : tile.shape[1]] = tile
                    state = "full" if in_bounds and bool(tile.all()) else "partial"
                    out[(h, b, i, j)] = (state, padded)
    return out


def valid_pairs(p: Problem, tm: int, tn: int) -> int:
    return p.hmask * sum(cdiv(ql, tm) * cdiv(kl, tn) for ql, kl in zip(p.q_lens, p.k_lens, strict=True))


def outer_rows(p: Problem, role: str, tm: int, tn: int) -> list[tuple[int, int]]:
    """(sample, outer block) of every compact plan row: Q blocks (forward) or K blocks (backward)."""
    lens, tile = (p.q_lens, tm) if role == "forward" else (p.k_lens, tn)
    return [(b, o) for b, n in enumerate(lens) for o in range(cdiv(n, tile))]


def pack_rowmajor(tile: torch.Tensor, words: int) -> list[list[int]]:
    """Expected int32 words [tile_m][words] of RowMajorLayout: group = m, word = n // 32, bit = n % 32."""
    out = []
    for row in tile.tolist():
        ws = [0] * words
        for n, bit in enumerate(row):
            if bit:
                ws[n // 32] |= 1 << (n % 32)
        out.append([w - (1 << 32) if w >= 1 << 31 else w for w in ws])
    return out


def decode_csr(view, p: Problem, kind: str) -> list[tuple[int, int, int, int, int]]:
    """[(h, b, q_block, k_block, entry index)] read row by row from cnt/offset/idx."""
    prefix = "mask_block" if kind == "partial" else "full_block"
    cnt = getattr(view, f"{prefix}_cnt").tolist()
    off = getattr(view, f"{prefix}_offset").tolist()
    idx = getattr(view, f"{prefix}_idx").tolist()
    tm, tn = view.block_size
    rows = outer_rows(p, view.role, tm, tn)
    out = []
    for h in range(len(cnt)):
        for r, (b, o) in enumerate(rows):
            for e in range(off[h][r], off[h][r] + cnt[h][r]):
                qb, kb = (o, idx[e]) if view.role == "forward" else (idx[e], o)
                out.append((h, b, qb, kb, e))
    return out


# --------------------------------------------------------------------------------------------------
# the checks
# --------------------------------------------------------------------------------------------------


def check_csr_structure(view, p: Problem) -> None:
    tm, tn = view.block_size
    rows = outer_rows(p, view.role, tm, tn)
    inner_lens, inner_tile = (p.k_lens, tn) if view.role == "forward" else (p.q_lens, tm)
    for prefix in ("mask_block", "full_block"):
        cnt = getattr(view, f"{prefix}_cnt")
        off = getattr(view, f"{prefix}_offset")
        idx = getattr(view, f"{prefix}_idx")
        assert cnt.dtype == off.dtype == idx.dtype == torch.int32
        assert tuple(cnt.shape) == tuple(off.shape) == (p.hmask, len(rows))
        flat = cnt.reshape(-1).tolist()
        scan = _prefix(flat)[:-1]
        assert off.reshape(-1).tolist() == scan, f"{prefix}_offset is not the exclusive scan of the counts"
        assert idx.numel() == sum(flat)
        ids = idx.tolist()
        for h in range(p.hmask):
            for r, (b, _) in enumerate(rows):
                o, n = int(off[h, r]), int(cnt[h, r])
                seg = ids[o : o + n]
                ascending = all(a < c for a, c in zip(seg, seg[1:], strict=False))
                assert ascending, f"{prefix}_idx not ascending in row ({h}, {r})"
                assert all(0 <= x < cdiv(inner_lens[b], inner_tile) for x in seg), "inner block out of sample"
    masks = view.mask_block_masks
    spec = view.signature.payload
    assert masks.dtype == torch.int32
    assert masks.shape[0] == view.mask_block_idx.numel()
    assert tuple(masks.shape[1:]) == (spec.physical_subtiles, spec.payload_groups, spec.words_per_group)


def check_block_relation(view, p: Problem, dense: torch.Tensor) -> None:
    """Partial entries == visible-but-not-full pairs (with exact payloads), full entries == full pairs."""
    tm, tn = view.block_size
    expected = block_states(dense, p, tm, tn)
    partial = decode_csr(view, p, "partial")
    full = decode_csr(view, p, "full")
    got_partial = {key[:4] for key in partial}
    got_full = {key[:4] for key in full}
    assert len(got_partial) == len(partial) and len(got_full) == len(full), "duplicate CSR entries"
    assert got_partial == {key for key, (s, _) in expected.items() if s == "partial"}
    assert got_full == {key for key, (s, _) in expected.items() if s == "full"}
    assert not got_partial & got_full
    empty = valid_pairs(p, tm, tn) - len(partial) - len(full)
    assert empty == valid_pairs(p, tm, tn) - len(expected) >= 0
    masks = view.mask_block_masks
    words = view.signature.payload.words_per_group
    for h, b, qb, kb, e in partial:
        want = pack_rowmajor(expected[(h, b, qb, kb)][1], words)
        assert masks[e, 0].tolist() == want, f"payload of partial block {(h, b, qb, kb)} is wrong"


def check_dense(view, p: Problem, dense: torch.Tensor) -> None:
    if p.varlen:  # as wide as the longest sample, whatever bound max_seqlen_k gave
        dense = dense[:, :, : max(p.k_lens)]
    got = view.to_dense()
    assert got.dtype == torch.bool
    assert got.shape == dense.shape
    where = (got ^ dense).nonzero()[:5].tolist()
    assert torch.equal(got, dense), f"{view.role} to_dense() differs at (head, row, key) {where}"


def check_sequence_desc(view, p: Problem) -> None:
    tm, tn = view.block_size
    q_blocks = [cdiv(n, tm) for n in p.q_lens]
    k_blocks = [cdiv(n, tn) for n in p.k_lens]
    outer, inner = (q_blocks, k_blocks) if view.role == "forward" else (k_blocks, q_blocks)
    begin = _prefix(outer)
    expected = [
        [p.cu_q[b], p.cu_k[b], p.q_lens[b], p.k_lens[b], begin[b], outer[b], inner[b], 0]
        for b in range(p.batch)
    ]
    # retained iff varlen (spec 4.8); a fixed-length view derives it (maskplan_core.plan.fixed_sequence_desc)
    assert ("sequence_desc" in view.tensors) == p.varlen
    assert view.sequence_desc().dtype == torch.int32
    assert view.sequence_desc().tolist() == expected


def check_header(plan, p: Problem) -> None:
    header = plan.metadata["allocation_header"]
    fwd = plan.view("forward")
    q_rows = sum(cdiv(n, fwd.block_size[0]) for n in p.q_lens)
    assert header["forward_q_rows"] == fwd.mask_block_cnt.shape[1] == q_rows
    assert header["forward_partial_nnz"] == fwd.mask_block_idx.numel()
    assert header["forward_full_nnz"] == fwd.full_block_idx.numel()
    assert header["error_flags"] == 0
    if plan.has_backward:
        bwd = plan.view("backward")
        tm, tn = bwd.block_size
        assert header["backward_q_rows"] == sum(cdiv(n, tm) for n in p.q_lens)
        assert header["backward_k_rows"] == bwd.mask_block_cnt.shape[1] == sum(cdiv(n, tn) for n in p.k_lens)
        assert header["backward_partial_nnz"] == bwd.mask_block_idx.numel()
        assert header["backward_full_nnz"] == bwd.full_block_idx.numel()
    else:
        for name in ("backward_q_rows", "backward_k_rows", "backward_partial_nnz", "backward_full_nnz"):
            assert header[name] == 0, name


def check_dq_write_order(view, p: Problem) -> None:
    """For every (head, Q block), the ranks over all contributing K blocks (partial + full) are
    0..n-1, each exactly once, ascending in K block; the rank arrays parallel the index arrays."""
    assert view.dq_write_order.dtype == view.dq_write_order_full.dtype == torch.int32
    assert view.dq_write_order.numel() == view.mask_block_idx.numel()
    assert view.dq_write_order_full.numel() == view.full_block_idx.numel()
    by_q_block: dict[tuple[int, int, int], list[tuple[int, int]]] = {}
    ranks = {"partial": view.dq_write_order.tolist(), "full": view.dq_write_order_full.tolist()}
    for kind in ("partial", "full"):
        for h, b, qb, kb, e in decode_csr(view, p, kind):
            by_q_block.setdefault((h, b, qb), []).append((kb, ranks[kind][e]))
    for key, contributions in by_q_block.items():
        contributions.sort()
        assert [r for _, r in contributions] == list(range(len(contributions))), f"dq ranks of Q block {key}"


def heads_per_section(kv_bytes: int, hkv: int) -> int:
    """Largest power of two <= Hkv whose kv heads fit the L2 budget together (at least 1)."""
    hps = 1
    while hps * 2 <= hkv and kv_bytes * hps * 2 <= L2_SECTION_BYTES:
        hps *= 2
    return hps


def order_tasks(tasks: list[dict]) -> list[list[int]]:
    """Spec 4.8 order: positive-cost tasks by section (descending section cost, ties by section
    index), then descending cost, then head/Q block; zero-cost tasks last in batch/head/Q-block order."""
    section_cost: dict[int, int] = {}
    for t in tasks:
        section_cost[t["section"]] = section_cost.get(t["section"], 0) + t["cost"]
    rank = {s: r for r, s in enumerate(sorted(section_cost, key=lambda s: (-section_cost[s], s)))}
    positive = sorted(
        (t for t in tasks if t["cost"] > 0), key=lambda t: (rank[t["section"]], -t["cost"], t["h"], t["m"])
    )
    zero = sorted((t for t in tasks if t["cost"] == 0), key=lambda t: (t["b"], t["h"], t["m"]))
    return [t["row"] for t in positive + zero]


def expected_schedule(p: Problem, fwd_states: dict, tm: int, tn: int, element_size: int) -> list[list[int]]:
    """fwd_work_desc recomputed from ARCHITECTURE.md "L2 section" with plain Python sorts."""
    group = p.hq // p.hkv
    tasks = []
    for b in range(p.batch):
        kv_bytes = p.k_lens[b] * (p.dqk + p.dv) * element_size
        hps = heads_per_section(kv_bytes, p.hkv)
        for h in range(p.hq):
            mh = h if p.hmask > 1 else 0
            for m in range(cdiv(p.q_lens[b], tm)):
                cost = sum(1 for j in range(cdiv(p.k_lens[b], tn)) if (mh, b, m, j) in fwd_states)
                section = b * p.hkv + (h // group) // hps
                q_valid = min(p.q_lens[b] - m * tm, tm)
                tasks.append(dict(b=b, h=h, m=m, cost=cost, section=section, row=[m, h, b, q_valid]))
    return order_tasks(tasks)


def check_schedule(plan, p: Problem, dense: torch.Tensor, element_size: int) -> None:
    fwd = plan.view("forward")
    tm, tn = fwd.block_size
    work = fwd.fwd_work_desc
    assert work.dtype == torch.int32
    rows = work.tolist()
    all_tasks = {(m, h, b) for b, m in outer_rows(p, "forward", tm, tn) for h in range(p.hq)}
    assert len(rows) == len(all_tasks), "fwd_work_desc must hold one task per (valid Q plan row, head)"
    assert {tuple(r[:3]) for r in rows} == all_tasks, "fwd_work_desc is not a permutation of the tasks"
    assert rows == expected_schedule(p, block_states(dense, p, tm, tn), tm, tn, element_size)


def check_block_map(view, p: Problem, dense: torch.Tensor) -> None:
    """``block_map`` of every sample and mask head: the brute-force classification of its blocks."""
    tm, tn = view.block_size
    states = block_states(dense, p, tm, tn)
    for h in range(p.hmask):
        for b, (ql, kl) in enumerate(zip(p.q_lens, p.k_lens, strict=True)):
            want = torch.zeros(cdiv(ql, tm), cdiv(kl, tn), dtype=torch.int8)
            for (hh, bb, i, j), (state, _) in states.items():
                if (hh, bb) == (h, b):
                    want[i, j] = 2 if state == "full" else 1
            assert torch.equal(view.block_map(b, h), want), (view.role, h, b)


def check_plan(plan, ep: torch.Tensor, p: Problem, element_size: int) -> None:
    dense = decode_within_samples(ep, p.max_k, p.q_lens, p.k_lens)
    check_header(plan, p)
    for role in plan.roles:
        view = plan.view(role)
        check_csr_structure(view, p)
        check_sequence_desc(view, p)
        check_block_relation(view, p, dense)
        check_dense(view, p, dense)
        check_block_map(view, p, dense)
        stats = view.stats()
        assert (stats["partial"], stats["full"]) == (view.mask_block_idx.numel(), view.full_block_idx.numel())
        assert stats["partial"] + stats["full"] + stats["empty"] == valid_pairs(p, *view.block_size)
        elements = p.hmask * sum(q * k for q, k in zip(p.q_lens, p.k_lens, strict=True))
        assert round(stats["visible"] * elements) == int(dense.sum()), (view.role, stats["visible"])
    check_schedule(plan, p, dense, element_size)
    assert plan.view("forward").dq_write_order is None
    if plan.has_backward:
        assert plan.view("backward").fwd_work_desc is None
        check_dq_write_order(plan.view("backward"), p)


# --------------------------------------------------------------------------------------------------
# tests
# --------------------------------------------------------------------------------------------------


@PROPS
@given(p=problems(max_len=90, max_batch=4), tiles=st.sampled_from(SMALL_TILES), build_backward=st.booleans())
def test_small_tile_plan_invariants(p, tiles, build_backward):
    ep, plan, dtype = small_plan(p, tiles, build_backward)
    assert plan.has_backward == build_backward
    check_plan(plan, ep, p, element_size=torch.empty((), dtype=dtype).element_size())


@PROPS_BIG
@given(p=problems(max_len=400, max_batch=2), dtype=st.sampled_from((torch.float32, torch.float64)))
def test_create_mask_plan_invariants(p, dtype):
    flexattn = pytest.importorskip("flexattn")
    ep = make_endpoints(p)
    q, k, v = qkv(p, dtype)
    plan = flexattn.create_mask_plan(ep, q, k, v, build_backward=True, **varlen_kwargs(p))
    assert plan.view("forward").block_size == (128, 128)
    check_plan(plan, ep, p, element_size=torch.empty((), dtype=dtype).element_size())


def _fixed(sq, sk, *, batch=1, hq=1, hkv=1, hmask=1, nfunc=1, kinds=None, seed=0) -> Problem:
    kinds = kinds or ("random",) * (hmask * batch)
    return Problem(False, (sq,) * batch, (sk,) * batch, sq, sk, hq, hkv, hmask, nfunc, tuple(kinds), seed)


@pytest.mark.parametrize(
    "p",
    [
        _fixed(64, 96, kinds=("full",)),  # every block full: no partial entries at all
        _fixed(50, 70, kinds=("full",)),  # tails: the same mask is partial at the edges
        _fixed(40, 40, batch=2, kinds=("empty", "empty")),  # no visible block at all
        _fixed(64, 64, nfunc=3, hq=2, hmask=2, kinds=("causal", "empty")),
        Problem(True, (0, 33, 0), (20, 0, 0), 40, 25, 4, 2, 1, 3, ("random",) * 3, 1),  # q/k-empty samples
        Problem(True, (17, 0, 48), (0, 5, 64), 48, 64, 2, 1, 2, 5, ("full",) * 6, 2),
    ],
    ids=["all-full", "full-with-tails", "all-empty", "causal-and-empty-heads", "varlen-empty", "varlen-full"],
)
@pytest.mark.parametrize("tiles", SMALL_TILES[:2], ids=["16x32", "8x40"])
def test_small_tile_edge_cases(p, tiles):
    ep, plan, dtype = small_plan(p, tiles, build_backward=True)
    check_plan(plan, ep, p, element_size=torch.empty((), dtype=dtype).element_size())


@pytest.mark.parametrize("tiles", SMALL_TILES[:2], ids=["16x32", "8x40"])
def test_chunked_planning_builds_the_same_plan(tiles, monkeypatch):
    """The reference planner's chunks (classification rows, tile predicates, payload packing) of a
    few tiles each give the plan of one chunk, tensor for tensor: where most tiles are partial the
    predicates of all of them are the dense mask, so they are made and packed a chunk at a time.
    ``to_dense`` and ``validate`` decode a few tiles at a time too (check_plan compares it with the
    mask)."""
    # the modules themselves (the package's ``classify`` is also a function of that name)
    names = ("classify", "csr", "intervals")
    modules = [importlib.import_module(f"maskplan_core.reference.{name}") for name in names]
    p = _fixed(90, 150, batch=2, hq=2, hmask=2, nfunc=7, seed=3)
    ep, whole, dtype = small_plan(p, tiles, build_backward=True)
    tile_elements = tiles[0][0] * tiles[0][1]
    for module in modules:
        monkeypatch.setattr(module, "CHUNK_ELEMENTS", 3 * tile_elements)
    monkeypatch.setattr(
        importlib.import_module("maskplan_core.view_check"), "TILE_CHUNK_ELEMENTS", 2 * tile_elements
    )
    _, chunked, _ = small_plan(p, tiles, build_backward=True)
    for role in whole.roles:
        a, b = whole.view(role).tensors, chunked.view(role).tensors
        assert a.keys() == b.keys()
        for name in a:
            assert torch.equal(a[name], b[name]), f"{role} {name}"
    check_plan(chunked, ep, p, element_size=torch.empty((), dtype=dtype).element_size())


def _same_lengths_varlen(p: Problem) -> Problem:
    """``p`` (fixed-length) as a varlen problem with every sample of the same lengths."""
    return Problem(True, *[getattr(p, f) for f in Problem.__dataclass_fields__ if f != "varlen"])


@pytest.mark.parametrize("pack_gqa", [False, True], ids=["mha", "pack-gqa"])
def test_fixed_length_views_derive_sequence_desc(pack_gqa):
    """A fixed-length view retains no ``sequence_desc``; its derived one is BlockGeometry's (the
    varlen path's) at the view's block, forward and backward; PackGQA's block counts Q positions.
    The plan is B * 32 bytes smaller per view than the same problem planned as varlen."""
    from maskplan_core.reference import block_geometry

    p = _fixed(50, 70, batch=3, hq=4, hkv=2, nfunc=3, kinds=("causal", "random", "window"), seed=4)
    fwd_tile, bwd_tile = (8, 40), (16, 16)  # pack_gqa: 16 rows of G = 2 heads = 8 positions
    fwd, bwd = small_config("forward", fwd_tile), small_config("backward", bwd_tile)
    if pack_gqa:
        topology = fwd.signature.topology.model_copy(update=dict(pack_gqa=True, qhead_per_kvhead=2))
        fwd = ViewConfig(fwd.signature.model_copy(update=dict(topology=topology)), fwd.layout)
    plans = {}
    for name, problem in (("fixed", p), ("varlen", _same_lengths_varlen(p))):
        g = validate_plan_inputs(make_endpoints(problem), *qkv(problem), **varlen_kwargs(problem))
        plans[name] = (g, build_plan(make_endpoints(problem), g, fwd, bwd, "test-small"))
    g, fixed = plans["fixed"]
    varlen = plans["varlen"][1]
    for role, tile, outer in (("forward", fwd_tile, "q"), ("backward", bwd_tile, "k")):
        view = fixed.view(role)
        assert "sequence_desc" not in view.tensors and view.block_size == tile
        assert torch.equal(view.sequence_desc(), block_geometry(g, *tile).sequence_desc(outer))
        assert torch.equal(view.sequence_desc(), varlen.view(role).tensors["sequence_desc"])
        assert view.nbytes() == varlen.view(role).nbytes() - p.batch * 8 * 4
        assert torch.equal(view.to_dense(), varlen.view(role).to_dense())


@pytest.mark.parametrize("tiles", SMALL_TILES[:2], ids=["16x32", "8x40"])
@pytest.mark.parametrize(
    "row, ends",
    [(0, (0, 1, 160)), (7, (31, 32, 160)), (9, (40, 41, 160)), (63, (17, 18, 160)), (20, (10, 10, 159))],
    ids=["first-key", "block-end", "block-start", "last-row", "row-end"],
)
def test_one_hidden_key_leaves_its_block_partial(tiles, row, ends):
    """A block is full only when every row of its tile sees every key of it: in an all-visible
    mask, one row hiding one key (between its intervals, or at its end) leaves that block partial
    and every other block full."""
    p = _fixed(64, 160, nfunc=3, kinds=("full",))  # every tile inside: all full but the one
    ep = make_endpoints(p)
    ep[0, :, row] = torch.tensor(ends)
    _, plan, _ = small_plan(p, tiles, build_backward=True, ep=ep)
    check_plan(plan, ep, p, element_size=4)
    for role in plan.roles:
        assert plan.view(role).mask_block_idx.numel() == 1, role


def test_all_full_mask_has_no_payloads():
    p = _fixed(64, 96, kinds=("full",))
    ep, plan, _ = small_plan(p, ((16, 32), (32, 16)), build_backward=True)
    for role in ("forward", "backward"):
        view = plan.view(role)
        assert view.mask_block_idx.numel() == 0
        assert view.mask_block_masks.shape[0] == 0
        assert view.full_block_idx.numel() == valid_pairs(p, *view.block_size)
        assert view.entries("partial").head.numel() == 0
        with pytest.raises(InputValueError, match="kind must be 'partial' or 'full', got 'Full'"):
            view.entries("Full")


@pytest.mark.parametrize("k_lens", [(64, 96), (96, 64), (160, 20)])
def test_schedule_sections_follow_the_l2_budget(k_lens):
    """Per-sample heads_per_section at the 50 MiB boundary: with (Dqk + Dv) * element_size =
    budget / 128, a sample of 64 keys fits two kv heads per section (exactly the budget), one of 96
    keys only one. Tiny real geometries never reach the budget, so the schedule stage is driven
    directly with random costs."""
    from maskplan_core.reference import block_geometry, forward_schedule

    p = Problem(True, (40, 20), k_lens, 40, max(k_lens), 4, 2, 4, 3, ("random",) * 8, 3)
    g = validate_plan_inputs(make_endpoints(p), *qkv(p), **varlen_kwargs(p))
    geom = block_geometry(g, 16, 32)
    gen = torch.Generator().manual_seed(5)
    costs = torch.randint(0, 4, (p.hq, geom.n_q_rows), generator=gen, dtype=torch.int64)
    row_bytes = L2_SECTION_BYTES // 128
    work = forward_schedule(
        costs, geom, num_heads_kv=p.hkv, kv_head_of=torch.arange(p.hq) // 2, row_bytes_kv=row_bytes
    ).tolist()
    hps = [heads_per_section(kl * row_bytes, p.hkv) for kl in k_lens]
    assert sorted(hps) == [1, 2] or k_lens == (160, 20)
    tasks = [
        dict(b=b, h=h, m=m, cost=int(costs[h, r]), section=b * p.hkv + (h // 2) // hps[b],
             row=[m, h, b, min(p.q_lens[b] - 16 * m, 16)])
        for h in range(p.hq)
        for r, (b, m) in enumerate(outer_rows(p, "forward", 16, 32))
    ]
    assert work == order_tasks(tasks)


@pytest.mark.parametrize("width", [1, 3, 4, 100])
def test_block_map_text_draws_long_maps_coarser(width):
    """``width``: a character per f x f blocks, f the smallest factor fitting the K blocks in
    ``width``; '#' all full, '.' all empty, '+' otherwise (an edge group counts its real blocks)."""
    p = _fixed(230, 250, batch=1, kinds=("causal",))  # full, partial and empty blocks, and groups of each
    _, plan, _ = small_plan(p, SMALL_TILES[0], build_backward=False)
    view = plan.view("forward")
    blocks = view.block_map().tolist()
    n_rows, n_cols = len(blocks), len(blocks[0])
    f = -(-n_cols // width)
    want = []
    for r in range(0, n_rows, f):
        line = ""
        for c in range(0, n_cols, f):
            group = {blocks[i][j] for i in range(r, min(r + f, n_rows)) for j in range(c, min(c + f, n_cols))}
            line += "#" if group == {2} else "." if group == {0} else "+"
        want.append(line)
    text = view.block_map_text(width=width)
    assert text.splitlines() == want and max(map(len, want)) <= width
    assert view.block_map_text(width=None) == view.block_map_text()
    with pytest.raises(ValueError, match="width must be >= 1"):
        view.block_map_text(width=0)


def test_block_map_text_draws_the_block_map():
    p = _fixed(40, 40, batch=2)
    ep, plan, _ = small_plan(p, SMALL_TILES[0], build_backward=True)
    for role in plan.roles:
        view = plan.view(role)
        text = view.block_map_text(sample=1)
        block_map = view.block_map(sample=1)
        assert text.splitlines() == ["".join(".+#"[c] for c in row) for row in block_map.tolist()]
        with pytest.raises(ValueError, match="sample=2"):
            view.block_map(sample=2)
        with pytest.raises(ValueError, match="head=1"):
            view.block_map(head=1)
        for bad in (0.5, True, "0"):
            with pytest.raises(TypeError, match="sample must be an int"):
                view.block_map(sample=bad)
        with pytest.raises(TypeError, match="head must be an int"):
            view.block_map(head=1.0)


@pytest.mark.parametrize("width", [None, 2])
def test_block_map_text_legend_says_what_a_character_is(width):
    """``legend=True``: lines naming the view, sample, head and the blocks, then what a character
    covers, then the same map."""
    p = _fixed(230, 250, batch=2, kinds=("causal", "causal"))
    _, plan, _ = small_plan(p, SMALL_TILES[0], build_backward=True)
    for role in plan.roles:
        view = plan.view(role)
        tm, tn = view.block_size
        rows, cols = view.block_map(sample=1).shape
        f = 1 if width is None else -(-cols // width)
        first, second, *drawn = view.block_map_text(sample=1, width=width, legend=True).splitlines()
        assert drawn == view.block_map_text(sample=1, width=width).splitlines()
        assert first == f"{role} view, sample 1, mask head 0: {rows} x {cols} blocks (Q x K) of {tm} x {tn}"
        cover = "a block" if f == 1 else f"{f} x {f} blocks, {f * tm} x {f * tn} positions"
        assert second == f"a character: {cover}; # full, + partial, . empty"
    with pytest.raises(TypeError, match="legend must be a bool, got int"):
        view.block_map_text(legend=1)


def test_block_map_text_legend_of_a_pack_gqa_view():
    """A PackGQA Q block is ``tile_m`` positions of every packed head: the legend says so, and a
    character covers ``tile_n / tile_m`` times as many Q blocks as K blocks."""
    p = _fixed(50, 70, batch=1, hq=4, hkv=2, kinds=("causal",))
    fwd = small_config("forward", (8, 40))
    topology = fwd.signature.topology.model_copy(update=dict(pack_gqa=True, qhead_per_kvhead=2))
    fwd = ViewConfig(fwd.signature.model_copy(update=dict(topology=topology)), fwd.layout)
    g = validate_plan_inputs(make_endpoints(p), *qkv(p))
    view = build_plan(make_endpoints(p), g, fwd, None, "test-small").view("forward")
    lines = view.block_map_text(width=1, legend=True).splitlines()
    assert lines[:3] == [
        "forward view, sample 0, mask head 0: 7 x 2 blocks (Q x K) of 8 x 40",
        "PackGQA: a block is 8 positions x 2 q heads",
        "a character: 10 x 2 blocks, 80 x 80 positions; # full, + partial, . empty",
    ]
    assert lines[3:] == view.block_map_text(width=1).splitlines()


def test_a_large_to_dense_warns_before_it_allocates(monkeypatch):
    """to_dense() of DENSE_WARN_BYTES or more says how large, and what shows the blocks instead."""
    import warnings

    from maskplan_core import plan as plan_module

    _, plan, _ = small_plan(_fixed(40, 30, batch=2), SMALL_TILES[0], build_backward=False)
    view = plan.view("forward")
    monkeypatch.setattr(plan_module, "DENSE_WARN_BYTES", 80 * 30 + 1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        dense = view.to_dense()
    monkeypatch.setattr(plan_module, "DENSE_WARN_BYTES", 80 * 30)
    said = r"allocates a bool \[1, 80, 30\] tensor \(0.0 GiB\); block_map\(\)"
    with pytest.warns(UserWarning, match=said):
        assert torch.equal(view.to_dense(), dense)
    # before the work: under an error filter nothing is allocated or decoded
    monkeypatch.setattr(plan_module, "entry_tiles", None)  # called: a TypeError, not the warning
    with warnings.catch_warnings(), pytest.raises(UserWarning, match=said):
        warnings.simplefilter("error")
        view.to_dense()


def test_summary_and_repr_name_what_a_row_is():
    """A forward view's rows are Q blocks, a backward view's K blocks: the text says which."""
    _, plan, _ = small_plan(_fixed(40, 40, batch=2), SMALL_TILES[0], build_backward=True)
    forward, backward = plan.summary().splitlines()[1:]
    assert forward.lstrip().startswith("forward") and " Q rows " in forward and " K rows " in backward
    assert "Q rows=" in repr(plan.view("forward")) and "K rows=" in repr(plan.view("backward"))


def test_block_map_text_of_an_empty_sample_says_so():
    """A varlen sample of no query rows (or no keys) has no map to draw: one line says so (it was
    an empty string, which printed as nothing)."""
    from maskplan_core import masks

    q, k = torch.zeros(30, 2, 16), torch.zeros(30, 2, 16)
    cu_q, cu_k = (torch.tensor(c, dtype=torch.int32) for c in ([0, 20, 20, 30], [0, 10, 25, 30]))
    mask = masks.causal(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    g = validate_plan_inputs(
        mask, q, k, k, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=20, max_seqlen_k=15
    )
    view = build_plan(mask, g, small_config("forward", (16, 16)), None, "test-small").view("forward")
    assert view.block_map_text(sample=1) == "(sample 1: 0 Q blocks x 1 K blocks)"
    assert view.block_map_text(sample=1, width=4) == view.block_map_text(sample=1)
    assert view.block_map_text(sample=0) == "+\n+"  # 2 Q blocks of 16 rows, 1 K block


@pytest.mark.parametrize("width", [None, 4])
def test_a_packed_views_block_map_keeps_its_aspect_and_says_it_is_packed(width):
    """A PackGQA forward view's Q block is 128 / G positions of G heads: its text map groups G Q
    blocks a line (as many positions as a character's keys), so it draws what the unpacked map
    draws, and its repr and the plan's summary say what a block is."""
    from maskplan_core import masks
    from maskplan_core.reference import ReferenceConsumer
    from maskplan_core.testing import resolve_view

    q, k = torch.randn(1, 1024, 8, 8), torch.randn(1, 1024, 2, 8)
    mask = masks.document([[300, 724]])
    g = validate_plan_inputs(mask, q, k, k)
    consumer = ReferenceConsumer()
    views = [resolve_view(consumer, g, "forward", pack_gqa=pack) for pack in (False, True)]
    flat, packed = (consumer.build_plan(mask, g, view, None).view("forward") for view in views)
    assert packed.block_size == (32, 128) and packed.block_map().shape == (32, 8)
    assert packed.block_map_text(width=width) == flat.block_map_text(width=width)
    assert "PackGQA: a block is 32 positions x 4 q heads" in repr(packed)
    assert "PackGQA" in consumer.build_plan(mask, g, views[1], None).summary() and not flat.packing()
