"""Host-side checks of maskplan_kernels.consumer_launch that need no GPU."""

import pytest
import torch
from plan_cases import make_geometry, make_mask, row_major, view_config

pytest.importorskip("cutlass.cute")

from maskplan_core.reference import build_plan  # noqa: E402
from maskplan_kernels.consumer_launch import bwd_view_args, fwd_view_args  # noqa: E402
from maskplan_kernels.geometry import ViewBounds  # noqa: E402
from maskplan_kernels.schedule_scatter import ScheduleScatterConfig  # noqa: E402


@pytest.mark.parametrize("varlen", [False, True], ids=["fixed", "varlen"])
def test_launch_arguments_carry_the_descriptor_only_for_varlen(varlen):
    """A fixed-length view retains no sequence_desc: its launches pass varlen = 0 and the int32 dummy
    (never read; the kernels derive the columns), a varlen view's pass 1 and its retained table."""
    q_lens, k_lens = [70, 70], [90, 90]
    g = make_geometry(q_lens, k_lens, hq=2, hkv=1, hmask=1, nfunc=1, varlen=varlen)
    fwd, bwd = view_config(row_major(32, 16), "forward"), view_config(row_major(16, 32), "backward")
    plan = build_plan(make_mask(q_lens, k_lens, 1, 1, seed=3), g, fwd, bwd, "test")
    cpu = torch.device("cpu")
    fwd_args, bwd_args = fwd_view_args(plan.view("forward"), cpu), bwd_view_args(plan.view("backward"), cpu)
    assert fwd_args.sizes[-3:-1] == (2, plan.view("forward").fwd_work_desc.shape[0])  # B, tasks
    assert fwd_args.sizes[-1] == bwd_args.varlen == int(varlen)
    for role, passed in (("forward", fwd_args.tensors[7]), ("backward", bwd_args.tensors[9])):
        view = plan.view(role)
        assert ("sequence_desc" in view.tensors) == varlen
        expected = view.tensors["sequence_desc"] if varlen else torch.zeros(1, 8, dtype=torch.int32)
        assert torch.equal(passed, expected), role


@pytest.mark.parametrize(
    "q_lens,max_q,varlen",
    [
        ([70, 70], None, False),  # fixed: exact
        ([70, 0, 5, 129], None, True),  # an empty sample, a one-row sample, one just past a block
        ([40, 1, 1, 1, 1], None, True),  # short samples: the token bound is the tighter one
        ([64, 64, 64], 200, True),  # max_seqlen_q above every length: still an upper bound
    ],
)
def test_backward_q_block_bounds_cover_every_sample_without_reading_the_plan(q_lens, max_q, varlen):
    """The backward's workspace and pre/postprocess grid come from host geometry alone (no device
    read per new plan): at least the view's own Q blocks, exact for fixed length."""
    k_lens = [90] * len(q_lens)
    g = make_geometry(q_lens, k_lens, hq=2, hkv=1, hmask=1, nfunc=1, varlen=varlen, max_q=max_q)
    bwd = view_config(row_major(16, 32), "backward")
    plan = build_plan(
        make_mask(q_lens, k_lens, 1, 1, seed=5), g, view_config(row_major(32, 16), "forward"), bwd, "t"
    )
    view = plan.view("backward")
    q_blocks = view.sequence_desc()[:, 6].to(torch.int64)
    bounds = ViewBounds.of(g, *view.block_size)
    n_qblk, max_q_blocks = bounds.q_rows, bounds.max_q_blocks
    args = bwd_view_args(view, torch.device("cpu"))
    assert (args.n_qblk, args.max_q_blocks) == (n_qblk, max_q_blocks)
    assert n_qblk >= int(q_blocks.sum()) and max_q_blocks >= int(q_blocks.max())
    if not varlen:
        assert (n_qblk, max_q_blocks) == (int(q_blocks.sum()), int(q_blocks.max()))
    if q_lens[1:] == [1] * 4:
        assert n_qblk == 7 < 5 * max_q_blocks  # 3 + 4 x 1 blocks, not 5 x 3
    begin = args.tensors[11].to(torch.int64)
    assert torch.equal(begin, torch.cumsum(q_blocks, 0) - q_blocks)  # exact, from the device table
    assert torch.equal(
        args.tensors[10], torch.repeat_interleave(torch.arange(len(q_lens)), view.sequence_desc()[:, 5]).int()
    )


@pytest.mark.parametrize("tile", [(128, 128), (64, 96)])
def test_view_bounds_do_not_grow_with_a_generous_max_seqlen(tile):
    """FlashAttention callers often pass a model's context length as ``max_seqlen_*``: the planner's
    workspace (bitset words per row, per-sample block bounds, the schedule's histogram bins) stays
    what the tokens need, and still bounds every sample."""
    q_lens, k_lens = [64, 30, 100], [90, 10, 200]

    def bounds(max_len):
        return ViewBounds.of(make_geometry(q_lens, k_lens, max_q=max_len, max_k=max_len), *tile)

    loose = bounds(1 << 30)
    assert loose == bounds(4096)
    tm, tn = tile
    assert loose.max_q_blocks >= max(-(-n // tm) for n in q_lens)
    assert loose.max_k_blocks >= max(-(-n // tn) for n in k_lens)
    assert loose.k_words == 1
    assert ScheduleScatterConfig.for_max_k_blocks(loose.max_k_blocks).bins == 32
