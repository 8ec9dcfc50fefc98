"""Filling a pipeline stage in SMEM, shared by the consumers' load roles: TMA tiles and bulk copies
on the stage's full barrier, and the zeroing fill of a tile that holds rows past its sample.

A sample's last K block (and, in the backward, its last Q block) also holds the next sample's first
rows. Those rows meet zero probabilities, and 0 * inf = nan, so a nan / inf in one sample would
reach its neighbour through them: such a tile lands on a barrier of the loading warp's own, which
zeroes the rows past the sample before the consumers see the stage (:func:`land_zeroing_tail`).
"""

import cutlass
import cutlass.cute as cute
from cutlass import Int32, const_expr


def row_view(s_stage: cute.Tensor, rows: int, cols: int, swizzle_bits: int) -> cute.Tensor:
    """The SMEM of one operand stage seen as the ``(rows, cols)`` tile :func:`zero_rows` takes: rows
    of ``w`` contiguous elements, ``cols / w`` blocks of ``rows`` such rows one after the other,
    ``w`` being the row of the stage's swizzle atom (``16 << swizzle_bits`` bytes). That is how
    SM100's UMMA-canonical layouts lay out an operand whose rows are sequence positions (K, V, Q,
    dO as K-major operands, V^T as the MN-major one: ``tile_to_mma_shape`` stacks the atoms along
    the sequence first), which the SM100 tests check against CuTe for every tile the kernels zero."""
    w = (16 << swizzle_bits) * 8 // s_stage.element_type.width
    assert cols % w == 0
    layout = cute.make_layout((rows, (w, cols // w)), stride=(w, (1, rows * w)))
    return cute.make_tensor(s_stage.iterator, layout)


@cute.jit
def zero_rows(s_tile: cute.Tensor, first_row: Int32, tidx: Int32, threads: cutlass.Constexpr[int]):
    r"""Zero rows ``first_row`` (0 <= first_row <= rows) and after of the swizzled SMEM tile ``s_tile``
    (rows, cols) by ``threads`` threads, ``tidx`` of them. The tile is laid out in swizzle atoms of
    8 rows x ``w`` columns stacked rows first (SM90's row-major operand tiles; an SM100 operand
    seen through :func:`row_view`), and the swizzle moves 16-byte pieces only within their row, so
    each ``w``-column block is ``rows`` runs of ``w`` contiguous elements and the rows to zero are
    one run per block::

        column block 0                      column block 1
        [ row 0 | ... | row first_row | ... ][ row 0 | ... | row first_row | ... ]
                        \__ zeroed ________/                 \__ zeroed ________/

    The threads store those runs in 16-byte pieces in turn, through a plain pointer at the tile's raw
    address (``toint`` of its swizzled pointer): no per-thread swizzle or row arithmetic, which
    would cost the MMA warpgroups registers they hold nothing spare for. The run formula (restated
    there) is checked against CuTe's layouts on the CPU (``test_sm90_cute_crosscheck.py``,
    ``test_sm100_cute_crosscheck.py``); the kernels' zeroed tails, by the GPU suites."""
    rows, cols = cute.size(s_tile, mode=[0]), cute.size(s_tile, mode=[1])
    w = cute.crd2idx((1, 0), s_tile.layout)  # a row's elements: the atom's width
    assert cols % w == 0 and (cols == w or cute.crd2idx((0, w), s_tile.layout) == rows * w)
    row_pieces = w * s_tile.element_type.width // 8 // 16
    zero = cute.make_rmem_tensor(cute.make_layout(4), Int32)
    zero.fill(0)
    pieces = (rows - first_row) * row_pieces
    for c in cutlass.range_constexpr(cols // w):
        run = (s_tile.iterator + (c * rows + first_row) * w).toint()
        for p in cutlass.range(tidx, pieces, threads, unroll=1):
            piece = cute.make_ptr(Int32, run + 16 * p, cute.AddressSpace.smem, assumed_align=16)
            cute.autovec_copy(zero, cute.make_tensor(piece, cute.make_layout(4)))


def issue_copies(bar: cute.Pointer, tma_copies, bulk_copies=(), **tma_kwargs):
    """Start a pipeline stage's copies on the barrier ``bar``: ``(atom, src, dst)`` each, TMA tiles
    (they elect their issuing lane; ``tma_kwargs``, e.g. a multicast mask, go to each), then bulk
    copies (issued by one lane)."""
    for atom, src, dst in tma_copies:
        cute.copy(atom, src, dst, tma_bar_ptr=bar, **tma_kwargs)
    for atom, src, dst in bulk_copies:
        with cute.arch.elect_one():
            cute.copy(atom, src, dst, mbar_ptr=bar)


def land_zeroing_tail(
    pipe, state, mbar_tail: cute.Pointer, tma_copies, bulk_copies, tiles, valid_rows: Int32
):
    """Fill stage ``state`` of the TMA pipeline ``pipe`` like ``producer_acquire`` and
    :func:`issue_copies` (the pipeline's transaction bytes in all), but with rows ``valid_rows``
    and after of each SMEM tile in ``tiles`` (rows, cols) zeroed before the consumers see the
    stage. Those rows belong to the next sample, and the consumers weigh them by zero
    (0 * inf = nan). The copies land on ``mbar_tail`` (the calling warp's own barrier, count 1),
    the warp zeroes the rows, then arrives on the stage's full barrier with no transaction bytes.
    Called by one whole warp, which alone uses ``mbar_tail``: idle between calls, its current
    phase's parity is 1 exactly when the phase of parity 0 tests complete, so no parity has to be
    carried in registers (SM90's producer warps have 24)."""
    phase = Int32(cute.arch.mbarrier_test_wait(mbar_tail, 0))
    pipe.sync_object_empty.wait(state.index, state.phase)
    with cute.arch.elect_one():
        cute.arch.mbarrier_arrive_and_expect_tx(mbar_tail, pipe.sync_object_full.tx_count)
    issue_copies(mbar_tail, tma_copies, bulk_copies)
    cute.arch.mbarrier_wait(mbar_tail, phase)
    for tile in tiles:
        zero_rows(tile, valid_rows, cute.arch.lane_idx(), 32)
    # generic-proxy zeros, read by the consumers' MMAs (wgmma, tcgen05.mma) through the async proxy
    cute.arch.fence_proxy("async.shared", space="cta")
    cute.arch.sync_warp()
    with cute.arch.elect_one():
        cute.arch.mbarrier_arrive(pipe.producer_get_barrier(state))


def _fill_plain(pipe, state, tma_copies, bulk_copies, **tma_kwargs):
    pipe.producer_acquire(state)
    issue_copies(pipe.producer_get_barrier(state), tma_copies, bulk_copies, **tma_kwargs)


@cute.jit
def fill_stage(pipe, state, tma_copies, bulk_copies=(), tail=None, **tma_kwargs):
    """Fill stage ``state`` of the TMA pipeline ``pipe`` with ``tma_copies`` and ``bulk_copies``:
    plainly (``producer_acquire`` and :func:`issue_copies`), or through :func:`land_zeroing_tail`
    where the tile may hold rows past its sample. ``tail`` is None for a tile that never does, else
    ``(valid_rows, tiles, mbar_tail)``: the zeroing fill runs when fewer than the tiles' rows
    (``tiles``: the SMEM tiles as (rows, cols), :func:`zero_rows`'s) belong to the sample."""
    if const_expr(tail is None):
        _fill_plain(pipe, state, tma_copies, bulk_copies, **tma_kwargs)
    else:
        valid_rows, tiles, mbar_tail = tail
        if valid_rows < cute.size(tiles[0], mode=[0]):
            land_zeroing_tail(pipe, state, mbar_tail, tma_copies, bulk_copies, tiles, valid_rows)
        else:
            _fill_plain(pipe, state, tma_copies, bulk_copies, **tma_kwargs)
