"""CPU tests of what the SM90 backward kernels assume about a plan's backward view, and a torch
twin of the kernels' indexing (no GPU, no compile).

* The launcher's plan-derived tensors (sample of each K plan row, first padded Q block of each
  sample) match the view's ``sequence_desc()``; the kernels get the retained descriptor only for a
  varlen view.
* ``dq_write_order`` is a complete turnstile: for every (mask head, Q block) the ranks of its
  writers are 0..n-1 in ascending K-block order (descending in the mirrored order's
  ``mirrored_view_args``), so the turnstile neither deadlocks (a writer only waits on lower ranks,
  i.e. lower tickets: deterministic mode on its rank, atomic mode on sparse rows on rank 0's
  store) nor skips a rank.
* :func:`emulate_backward` takes the items in ticket order and walks Q heads and each K row's
  partial and full entries merged by Q block exactly as ``bwd_kernel.py`` does, in either order
  (padded LSE2 / D rows, global Q blocks, per-(head, block) dQ accumulation in rank order, which
  one CTA running the items one after another meets only where every rank's writer comes in an
  earlier ticket than the next rank's; the packed predicate applied after the exponential), and
  must agree with ``attention_backward``.
"""

import math

import pytest
import torch

pytest.importorskip("cutlass.cute")

from launch_order_probe import host_stagger  # noqa: E402

from flexattn_sm90 import Sm90Consumer  # noqa: E402
from flexattn_sm90.bwd_kernel import Sm90BwdKernel  # noqa: E402
from flexattn_sm90.bwd_launch import config_for_view  # noqa: E402
from flexattn_sm90.heuristics import SUPPORTED_HEAD_DIMS, select_bwd_config  # noqa: E402
from maskplan_core import ViewRequest, masks, validate_plan_inputs  # noqa: E402
from maskplan_core.errors import PlanSignatureMismatch  # noqa: E402
from maskplan_core.reference import attention_backward, attention_forward, build_plan  # noqa: E402
from maskplan_kernels.consumer_k2q import (  # noqa: E402
    SPARSE_ROW_FILL,
    STAGGER_PAIRS,
    STAGGER_RUN,
    grouped_launch_slot,
    k2q_row_fill,
    stagger_pair_row,
)
from maskplan_kernels.consumer_launch import bwd_view_args, mirrored_view_args  # noqa: E402

CPU = torch.device("cpu")
CU_Q = [0, 100, 100, 164, 500, 700]
CU_K = [0, 300, 500, 500, 760, 893]


def plan_for(mask_func, q, k, v, **varlen):
    g = validate_plan_inputs(mask_func, q, k, v, **varlen)
    consumer = Sm90Consumer()
    views = [
        consumer.resolve(
            ViewRequest(
                arch_family="sm90",
                direction=d,
                head_dim_qk=g.head_dim_qk,
                head_dim_v=g.head_dim_v,
                num_heads_q=g.num_heads_q,
                num_heads_kv=g.num_heads_kv,
                mask_heads=g.mask_heads,
                dtype="bfloat16",
                varlen=g.varlen,
            )  # fmt: skip
        )
        for d in ("forward", "backward")
    ]
    return build_plan(mask_func, g, *views, consumer.name)


def random_intervals(hmask, nfunc, row_k_len, seed):
    gen = torch.Generator().manual_seed(seed)
    k_len = row_k_len.to(torch.float64)
    u = torch.rand(hmask, nfunc, k_len.numel(), generator=gen, dtype=torch.float64)
    return torch.floor(u * (k_len + 1)).clamp(max=k_len).to(torch.int32).sort(dim=1).values.contiguous()


def problems():
    """(name, mask_func, q, k, v, varlen): fixed, GQA with per-head masks, varlen with empty samples,
    at D = 64 (the 128 x 128 backward tile); fixed at D = 128 (64 x 128)."""
    gen = torch.Generator().manual_seed(0)

    def qkv(tq, tk, hq, hkv, d=64):
        q = torch.randn(*tq, hq, d, generator=gen).bfloat16()
        return (
            q,
            torch.randn(*tk, hkv, d, generator=gen).bfloat16(),
            torch.randn(*tk, hkv, d, generator=gen).bfloat16(),
        )

    out = [("causal", masks.causal(300, batch=2), *qkv((2, 300), (2, 300), 2, 2), {})]
    out.append(("causal-d128", masks.causal(300, batch=2), *qkv((2, 300), (2, 300), 2, 2, d=128), {}))
    ep = random_intervals(4, 5, torch.full((2 * 200,), 333), seed=1)
    out.append(("gqa-per-head", ep, *qkv((2, 200), (2, 333), 4, 2), {}))
    cu_q, cu_k = torch.tensor(CU_Q, dtype=torch.int32), torch.tensor(CU_K, dtype=torch.int32)
    k_len = (cu_k[1:] - cu_k[:-1]).repeat_interleave(cu_q[1:] - cu_q[:-1])
    varlen = {"cu_seqlens_q": cu_q, "cu_seqlens_k": cu_k, "max_seqlen_q": 400, "max_seqlen_k": 300}
    ep = random_intervals(1, 3, k_len, seed=2)
    ep[..., 400:470] = 0  # rows without a visible key
    out.append(("varlen", ep, *qkv((CU_Q[-1],), (CU_K[-1],), 4, 2), varlen))
    return out


PROBLEMS = problems()


@pytest.mark.parametrize("problem", PROBLEMS, ids=[p[0] for p in PROBLEMS])
def test_prepared_tensors(problem):
    _, ep, q, k, v, varlen = problem
    view = plan_for(ep, q, k, v, **varlen).view("backward")
    prep = bwd_view_args(view, CPU)
    desc = view.sequence_desc().to(torch.int64)
    # the kernels read the retained descriptor of a varlen view and derive a fixed-length one's
    assert prep.varlen == int(bool(varlen)) == int("sequence_desc" in view.tensors)
    if varlen:
        assert torch.equal(prep.tensors[9], view.tensors["sequence_desc"])
    k_row_batch, q_block_begin = prep.tensors[10].to(torch.int64), prep.tensors[11].to(torch.int64)
    assert k_row_batch.tolist() == [b for b in range(desc.shape[0]) for _ in range(int(desc[b, 5]))]
    assert prep.k_rows == int(desc[:, 5].sum()) == view.mask_block_cnt.shape[1]
    q_blocks = [math.ceil(int(n) / view.block_size[0]) for n in desc[:, 2]]
    assert q_blocks == desc[:, 6].tolist()
    assert q_block_begin[: desc.shape[0]].tolist() == [sum(q_blocks[:b]) for b in range(len(q_blocks))]
    # host bounds (geometry.ViewBounds): the workspace holds every sample's Q blocks
    assert prep.n_qblk >= sum(q_blocks) and prep.max_q_blocks >= max(q_blocks)
    if not varlen:
        assert (prep.n_qblk, prep.max_q_blocks) == (sum(q_blocks), max(q_blocks))


LAUNCH_MASKS = {
    "causal": (masks.causal(8192, batch=2), "pairs"),
    "sliding-1024": (masks.sliding_window(8192, window_left=1024, batch=2), "all"),
    "document": (masks.document([[3000, 2000, 1500, 1692], [5000, 3192]]), "all"),
    "random-5": (random_intervals(1, 5, torch.full((2 * 8192,), 8192), seed=3), "dense"),
}


@pytest.mark.parametrize("dim", [128, 256])
@pytest.mark.parametrize("name", LAUNCH_MASKS)
def test_launch_head_group_follows_the_k2q_row_fill(name, dim):
    """The kernels' launch-order rule (``consumer_k2q.view_row_fill``: entries over K rows x the
    Q blocks per sample, as the launch passes them) on the benchmark's masks, B=2 S=8192, on the
    D=128 kernel's 64 x 128 tiles and the (256, 256) kernel's 64 x 64: causal rows are half full
    (atomic mode takes ATOMIC_HEAD_GROUP heads at a time, deterministic mode at (256, 256)
    ``det_capped_heads``), sliding-window and document rows sparse (all heads at a time, but
    deterministic mode at (256, 256) caps sliding windows: ``test_staggered_row_ends``; the host's
    ``BwdViewArgs.sparse_rows``, from the same sizes, agrees, so atomic mode stores each Q block's
    first dQ there), random intervals dense (deterministic mode takes DENSE_HEAD_GROUP)."""
    ep, expected = LAUNCH_MASKS[name]
    q = torch.zeros(2, 8192, 1, dim, dtype=torch.bfloat16)
    view = plan_for(ep, q, q, q).view("backward")
    stats = view.stats()
    batch = view.sequence_desc().shape[0]
    prep = bwd_view_args(view, CPU)
    fill = k2q_row_fill(stats["partial"] + stats["full"], view.mask_block_cnt.numel(), prep.n_qblk / batch)
    sparse, dense = fill < SPARSE_ROW_FILL, fill >= Sm90BwdKernel.DENSE_ROW_FILL
    assert (sparse, dense) == (expected == "all", expected == "dense"), fill
    assert prep.sparse_rows == sparse


@pytest.mark.parametrize("dims", [(128, 128), (256, 256)], ids=str)
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
def test_run_backward_stores_the_first_dq_per_row_fill(deterministic, dims, monkeypatch):
    """``run_backward`` compiles the three kernels for the view's K2Q row fill: in atomic mode a
    sparse view (a 128-key sliding window over 2048) gets the first-dQ store (the preprocess does not
    zero the accumulator, the postprocess zeroes unvisited blocks), a causal one the zeroed
    accumulator; deterministic mode stores it on both. At (256, 256) deterministic mode's main
    kernel takes the mirrored order on the sparse view, and the launch its mirrored ranks; every
    other kernel the plan's order. The device work is stood in for."""
    import maskplan_kernels.consumer_launch as consumer_launch
    from flexattn_sm90.bwd_launch import COMPILER, run_backward

    compiled = []
    monkeypatch.setattr(
        type(COMPILER), "compile_backward", lambda self, config, **options: compiled.append(options) or {}
    )
    launched = []
    monkeypatch.setattr(consumer_launch, "launch_backward", lambda compiled, io, *args: launched.append(io))
    q = torch.zeros(2, 2048, 1, dims[0], dtype=torch.bfloat16)
    config = select_bwd_config(head_dim_qk=dims[0], head_dim_v=dims[1], dtype="bfloat16")
    sparse_and_dense = (masks.sliding_window(2048, window_left=128, batch=2), masks.causal(2048, batch=2))
    for ep, sparse in zip(sparse_and_dense, (True, False), strict=True):
        view = plan_for(ep, q, q, q).view("backward")
        prep = bwd_view_args(view, CPU)
        assert prep.sparse_rows == sparse
        io = consumer_launch.BackwardIO(view, prep, q, *[None] * 9)  # the tensors are not read
        monkeypatch.setattr(consumer_launch, "backward_io", lambda *args, io=io, **kwargs: io)
        run_backward(view, *[None] * 7, softmax_scale=0.1, deterministic=deterministic)
        keys = COMPILER.kernel_keys(config, **compiled[-1])
        stored = deterministic or sparse
        assert ("zero_dq_accum", not stored) in keys["pre"] and ("zero_unvisited", stored) in keys["post"]
        assert ("first_dq_stored", stored) in keys["main"]
        mirrored = deterministic and sparse and dims == (256, 256)
        assert ("mirrored", mirrored) in keys["main"]
        want = (mirrored_view_args if mirrored else bwd_view_args)(view, CPU)
        assert launched[-1].prep is want


@pytest.mark.parametrize("dims", SUPPORTED_HEAD_DIMS, ids=str)
def test_sparse_rows_head_cap_follows_the_q_block_size(dims):
    """Atomic mode takes all kv heads at a time on sparse K2Q rows only where a Q block's Q, dO and
    fp32 dQ take at most SPARSE_ALL_HEADS_BYTES (up to D = 128), SPARSE_HEAD_CAP heads above
    (``Sm90BwdKernel.launch_head_group``)."""
    kernel = Sm90BwdKernel(select_bwd_config(head_dim_qk=dims[0], head_dim_v=dims[1], dtype="bfloat16"))
    assert kernel.sparse_heads == (0 if max(dims) <= 128 else Sm90BwdKernel.SPARSE_HEAD_CAP)


@pytest.mark.parametrize("dims", SUPPORTED_HEAD_DIMS, ids=str)
def test_deterministic_head_cap_follows_the_q_block_size(dims):
    """Deterministic mode takes HALF_FULL_HEAD_CAP kv heads at a time on half-full K2Q rows
    (causal's: ``test_launch_head_group_follows_the_k2q_row_fill``) only where a Q block's Q, dO
    and fp32 dQ take DET_CAP_BYTES: the (256, 256) kernel's 64 x 256 blocks, 128 KB; and
    SPARSE_HEAD_CAP on sparse rows with staggered ends (``test_staggered_row_ends``) from
    STAGGER_CAP_BYTES: those and (192, 128)'s 88 KB blocks (``Sm90BwdKernel.launch_head_group``);
    elsewhere all heads."""
    config = select_bwd_config(head_dim_qk=dims[0], head_dim_v=dims[1], dtype="bfloat16")
    kernel = Sm90BwdKernel(config, deterministic=True)
    half_full, stagger = Sm90BwdKernel.HALF_FULL_HEAD_CAP, Sm90BwdKernel.SPARSE_HEAD_CAP
    assert kernel.det_capped_heads == (half_full if dims == (256, 256) else 0)
    assert kernel.det_stagger_heads == (stagger if dims in ((192, 128), (256, 256)) else 0)


def test_stagger_pairs_are_adjacent_rows_spread_over_the_view():
    """Every sampled pair lies in the view where it has two rows; from 21 rows the 16 pairs are
    distinct, and the last run starts in the view's last quarter."""
    for k_rows in (1, 2, 5, 6, 20, 21, 64, 256, 1000):
        rows = [stagger_pair_row(p, k_rows) for p in range(STAGGER_PAIRS)]
        starts = rows[::STAGGER_RUN]
        assert starts[0] == 0 and starts == sorted(starts)
        if k_rows >= STAGGER_RUN + 1:
            assert rows[-1] + 1 < k_rows
        if k_rows >= 21:
            assert len(set(rows)) == STAGGER_PAIRS and rows[-1] >= k_rows * 3 // 4 - STAGGER_RUN - 1


STAGGER_MASKS = {
    "sliding-1024": (masks.sliding_window(8192, window_left=1024, batch=2), True),
    "sliding-128": (masks.sliding_window(8192, window_left=128, batch=2), True),
    "document": (LAUNCH_MASKS["document"][0], False),
    "documents-256": (masks.document([[256] * 32] * 2), False),
    "causal": (LAUNCH_MASKS["causal"][0], False),
    # test_bwd_gpu's test_sparse_rows_capped_head_group
    "sliding-40-1000": (masks.sliding_window(1000, window_left=40, batch=2), True),
}


@pytest.mark.parametrize("name", STAGGER_MASKS)
def test_staggered_row_ends(name):
    """The (256, 256) kernel's 64 x 64 tiles: sliding windows' K rows end at staggered Q blocks, so
    deterministic mode caps them at ``det_stagger_heads``, documents' and causal's end together
    (documents keep all heads). The pairs are counted on the host (``launch_order_probe.host_stagger``;
    test_bwd_gpu's ``test_launch_order_as_the_kernel_decides`` checks the kernel against it)."""
    ep, expected = STAGGER_MASKS[name]
    seqlen = int(ep.shape[-1]) // 2
    q = torch.zeros(2, seqlen, 1, 256, dtype=torch.bfloat16)
    staggered, pairs = host_stagger(plan_for(ep, q, q, q).view("backward"))
    assert pairs >= STAGGER_PAIRS - 2  # at most two sampled pairs cross a sample's end
    assert (staggered * 2 > pairs) == expected, (staggered, pairs)


def dq_ranks(view, mirrored: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The partial and full entries' dQ ranks the main kernel gets, as ``run_backward`` passes them."""
    prep = (mirrored_view_args if mirrored else bwd_view_args)(view, CPU)
    nnz = view.dq_write_order.numel(), view.dq_write_order_full.numel()
    return prep.tensors[7][: nnz[0]], prep.tensors[8][: nnz[1]]  # an empty one is a 4-element dummy


@pytest.mark.parametrize("problem", PROBLEMS, ids=[p[0] for p in PROBLEMS])
@pytest.mark.parametrize("mirrored", [False, True], ids=["plan-order", "mirrored"])
def test_dq_write_order_is_a_complete_turnstile(problem, mirrored):
    _, ep, q, k, v, varlen = problem
    view = plan_for(ep, q, k, v, **varlen).view("backward")
    writers: dict[tuple[int, int, int], list[tuple[int, int]]] = {}
    for kind, order in zip(("partial", "full"), dq_ranks(view, mirrored), strict=True):
        e = view.entries(kind)
        for h, b, m, n, rank in zip(e.head, e.batch, e.q_block, e.k_block, order, strict=True):
            writers.setdefault((int(h), int(b), int(m)), []).append((int(n), int(rank)))
    assert writers
    for key, ws in writers.items():
        ranks = [rank for _, rank in sorted(ws, reverse=mirrored)]
        assert ranks == list(range(len(ws))), f"(head, sample, Q block) {key}: ranks by K block {ranks}"


def walk_row(view, h: int, r: int, descending: bool) -> list[tuple[str, int]]:
    """``(kind, entry)`` of K row ``r`` (mask head ``h``) in the kernel's order: the partial and full
    entries merged by descending (or ascending) Q block (``maskplan_kernels.consumer_k2q.walk_row``)."""
    steps = []
    for kind, pre in (("partial", "mask_block"), ("full", "full_block")):
        cnt, off = int(view.tensors[f"{pre}_cnt"][h, r]), int(view.tensors[f"{pre}_offset"][h, r])
        steps += [(int(view.tensors[f"{pre}_idx"][e]), kind, e) for e in range(off, off + cnt)]
    return [(kind, e) for _, kind, e in sorted(steps, reverse=descending)]


def emulate_backward(view, q, k, v, out, lse, dout, dlse, scale, *, mirrored=False, head_group=None):
    """The kernels' indexing in torch (fp32): preprocess, the main loop's items one after another in
    ticket order (``head_group`` kv heads at a time; default all), postprocess."""
    g, prep = view.geometry, bwd_view_args(view, CPU)
    ranks = dict(zip(("partial", "full"), dq_ranks(view, mirrored), strict=True))
    tm, tn = view.block_size
    desc = view.sequence_desc().to(torch.int64)
    k_row_batch, q_block_begin = prep.tensors[10].long(), prep.tensors[11].long()
    hq_n, hkv_n, group = g.num_heads_q, g.num_heads_kv, g.num_heads_q // g.num_heads_kv
    # preprocess: padded per-(head, global Q block) rows
    lse2 = torch.full((hq_n, prep.n_qblk * tm), math.inf)
    dsum = torch.zeros(hq_n, prep.n_qblk * tm)
    for b in range(desc.shape[0]):
        q_off, q_len = int(desc[b, 0]), int(desc[b, 2])
        first = int(q_block_begin[b]) * tm
        rows = slice(first, first + q_len)
        tok = slice(q_off, q_off + q_len)
        d = (dout[tok].float() * out[tok].float()).sum(-1).transpose(0, 1)
        dsum[:, rows] = d - (dlse[:, tok] if dlse is not None else 0)
        lse2[:, rows] = torch.where(torch.isinf(lse[:, tok]), math.inf, lse[:, tok] * math.log2(math.e))
    dq_acc = torch.zeros(hq_n, prep.n_qblk, tm, g.head_dim_qk)
    dq_log: dict[tuple[int, int], list[int]] = {}
    dk, dv = (
        torch.full_like(k, math.nan, dtype=torch.float32),
        torch.full_like(v, math.nan, dtype=torch.float32),
    )
    unpack = view.layout.unpack
    for ticket in range(prep.k_rows * hkv_n):
        r, hk = grouped_launch_slot(ticket, hkv_n, prep.k_rows, head_group or hkv_n, mirrored)
        b = int(k_row_batch[r])
        n = r - int(desc[b, 4])
        q_off, k_off, q_len, k_len = (int(x) for x in desc[b, :4])
        k_valid = min(k_len - n * tn, tn)
        k_tok = torch.arange(k_off + n * tn, k_off + n * tn + tn).clamp(max=g.total_k - 1)
        acc_dk = torch.zeros(tn, g.head_dim_qk)
        acc_dv = torch.zeros(tn, g.head_dim_v)
        kt, vt = k[k_tok, hk].float(), v[k_tok, hk].float()
        for gi in range(group):
            hq = hk * group + gi
            h = min(hq, g.mask_heads - 1)
            for kind, e in walk_row(view, h, r, descending=not mirrored):
                pre = "mask_block" if kind == "partial" else "full_block"
                m = int(view.tensors[f"{pre}_idx"][e])
                blk = int(q_block_begin[b]) + m
                rank = int(ranks[kind][e])
                q_tok = torch.arange(q_off + m * tm, q_off + m * tm + tm).clamp(max=g.total_q - 1)
                qt, dot = q[q_tok, hq].float(), dout[q_tok, hq].float()
                st = kt @ qt.T  # S^T: (tile_n, tile_m)
                p = torch.exp2(st * scale * math.log2(math.e) - lse2[hq, blk * tm : blk * tm + tm])
                if kind == "partial":  # bit 0 -> P = 0 (after the exponential)
                    p = torch.where(unpack(view.mask_block_masks[e : e + 1])[0].T, p, 0.0)
                dpt = vt @ dot.T
                dst = p * (dpt - dsum[hq, blk * tm : blk * tm + tm])
                acc_dv += p @ dot
                acc_dk += dst @ qt
                assert len(dq_log.setdefault((hq, blk), [])) == rank, "turnstile order"
                dq_log[(hq, blk)].append(r)
                dq_acc[hq, blk] += dst.T @ kt
        rows = slice(k_off + n * tn, k_off + n * tn + k_valid)
        dk[rows, hk] = acc_dk[:k_valid] * scale
        dv[rows, hk] = acc_dv[:k_valid]
    dq = torch.full_like(q, math.nan, dtype=torch.float32)
    for b in range(desc.shape[0]):  # postprocess
        q_off, q_len = int(desc[b, 0]), int(desc[b, 2])
        for m in range(int(desc[b, 6])):
            rows = min(q_len - m * tm, tm)
            blk = int(q_block_begin[b]) + m
            dq[q_off + m * tm : q_off + m * tm + rows] = dq_acc[:, blk, :rows].transpose(0, 1) * scale
    return dq, dk, dv


ARRIVAL_MASKS = {
    "causal": masks.causal(1024),
    "document": masks.document([[300, 500, 100, 124]]),
    "sliding-200": masks.sliding_window(1024, window_left=200),
}


@pytest.mark.parametrize("dim", [128, 256])
@pytest.mark.parametrize("name", ARRIVAL_MASKS)
def test_mirrored_walks_reach_each_q_block_in_rank_order(name, dim):
    """Why the mirrored order: its walks (ascending, ``walk_row``) reach each Q block of a causal,
    document or sliding-window mask from its writers at steps that rise with their mirrored
    ranks, so CTAs started together do not queue on the block's turnstile; the plan's order's
    descending walks reach a document's Q blocks from all their writers at one step."""
    ep = ARRIVAL_MASKS[name]
    q = torch.zeros(1, 1024, 1, dim, dtype=torch.bfloat16)
    view = plan_for(ep, q, q, q).view("backward")
    for mirrored in (False, True):
        ranks = dict(zip(("partial", "full"), dq_ranks(view, mirrored), strict=True))
        arrivals: dict[int, list[tuple[int, int]]] = {}  # Q block -> (rank, step) of each writer
        for r in range(view.mask_block_cnt.shape[1]):
            for step, (kind, e) in enumerate(walk_row(view, 0, r, descending=not mirrored)):
                m = int(view.tensors["mask_block_idx" if kind == "partial" else "full_block_idx"][e])
                arrivals.setdefault(m, []).append((int(ranks[kind][e]), step))
        queued = 0
        for m, writers in arrivals.items():
            steps = [step for _, step in sorted(writers)]
            if mirrored:
                assert all(a < b for a, b in zip(steps, steps[1:], strict=False)), (m, steps)
            queued += len(steps) - len(set(steps))
        if name == "document" and not mirrored:
            assert queued > 0


@pytest.mark.parametrize("problem", PROBLEMS, ids=[p[0] for p in PROBLEMS])
@pytest.mark.parametrize("with_dlse", [False, True], ids=["no-dlse", "dlse"])
@pytest.mark.parametrize(
    "mirrored,head_group",
    [(False, None), (True, None), (True, 1)],
    ids=["plan-order", "mirrored", "mirrored-rows"],
)
def test_emulated_kernel_matches_reference(problem, with_dlse, mirrored, head_group):
    _, ep, q, k, v, varlen = problem
    plan = plan_for(ep, q, k, v, **varlen)
    q3, k3, v3 = (t.reshape(-1, *t.shape[-2:]) for t in (q, k, v))
    scale = 0.125
    out, lse, _ = attention_forward(plan.view("forward"), q3, k3, v3, softmax_scale=scale)
    gen = torch.Generator().manual_seed(3)
    dout = torch.randn(out.shape, generator=gen)
    dlse = torch.randn(lse.shape, generator=gen) if with_dlse else None
    view = plan.view("backward")
    got = emulate_backward(
        view, q3, k3, v3, out, lse, dout, dlse, scale, mirrored=mirrored, head_group=head_group
    )
    want = attention_backward(
        view, q3.float(), k3.float(), v3.float(), out, lse, dout, dlse, softmax_scale=scale
    )
    for name, a, b in zip(("dq", "dk", "dv"), got, want, strict=True):
        assert not torch.isnan(a).any(), f"{name}: elements the kernel indexing never writes"
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4, msg=name)


def test_forward_view_refused():
    _, ep, q, k, v, varlen = PROBLEMS[0]
    with pytest.raises(PlanSignatureMismatch, match="build_backward=True"):
        config_for_view(plan_for(ep, q, k, v, **varlen).view("forward"))
