"""GPU tests of the SM90 backward (H200) against the fp32 reference on the same plan.

Plans carry the SM90 consumer's own forward and backward ViewConfigs (what
``flexattn.create_mask_plan(..., build_backward=True)`` builds on an SM90 device); most are built
by the reference planner on CUDA tensors, ``test_gpu_planner_plan`` uses the GPU planner. O and
LSE come from the fp32 reference forward (O rounded to the input dtype, as the kernel would see
it), so only the backward is under test. Before every run the outputs are filled with NaN and the
CUDA caching allocator is handed a NaN-filled block (the workspace then starts as NaN): an element
the kernels do not write, or a workspace value they read before initialising it, fails the test.

Tolerance, per gradient, against the fp32 reference: relative L2 error <= 2e-2 (bf16) / 5e-3
(fp16) and max abs error <= 4e-2 (bf16) / 1e-2 (fp16) times the reference's max magnitude; rows
of queries without a visible key, and keys no query sees, must be exactly 0.

The check (:func:`maskplan_core.testing.check_backward`) and the cases this suite shares with the
SM100 one (:class:`maskplan_core.testing.BackwardCases`) live in ``maskplan_core.testing``.

    python -m pytest packages/flexattn-sm90/tests/test_bwd_gpu.py -m gpu -q
"""

import dataclasses

import pytest
import torch

pytestmark = pytest.mark.gpu

from maskplan_core import testing  # noqa: E402

if testing.cuda_arch_major() != 9:
    pytest.skip("needs an SM90 (Hopper) GPU", allow_module_level=True)

from launch_order_probe import host_stagger, probe_launch_order  # noqa: E402

from flexattn_sm90 import SUPPORTED_HEAD_DIMS, Sm90Consumer  # noqa: E402
from flexattn_sm90.bwd_kernel import Sm90BwdKernel  # noqa: E402
from flexattn_sm90.bwd_launch import COMPILER, config_for_view, run_backward  # noqa: E402
from flexattn_sm90.heuristics import select_bwd_config  # noqa: E402
from maskplan_core import masks, validate_plan_inputs  # noqa: E402
from maskplan_core.reference import build_plan  # noqa: E402
from maskplan_core.testing import (  # noqa: E402
    STRIDED_CASES,
    VARLEN_CU_K,
    VARLEN_CU_Q,
    BackwardCases,
    check_backward,
    resolve_view,
    varlen_args,
)
from maskplan_kernels.consumer_inputs import qkv_operands  # noqa: E402
from maskplan_kernels.consumer_k2q import ATOMIC_HEAD_GROUP, SPARSE_ROW_FILL, k2q_row_fill  # noqa: E402
from maskplan_kernels.consumer_launch import bwd_view_args  # noqa: E402
from maskplan_kernels.kv_head_split import kv_head_split  # noqa: E402

DEV = torch.device("cuda")
DTYPES = [torch.bfloat16, torch.float16]


def sm90_plan(mask_func, q, k, v, *, gpu_planner=False, **varlen):
    """A plan with the SM90 consumer's forward and backward views."""
    g = validate_plan_inputs(mask_func, q, k, v, **varlen)
    consumer = Sm90Consumer()

    def view(direction):
        return resolve_view(consumer, g, direction)

    if gpu_planner:
        return consumer.build_plan(mask_func, g, view("forward"), view("backward"))
    return build_plan(mask_func, g, view("forward"), view("backward"), consumer.name)


def row_fill(view, seqlen: int) -> float:
    """The backward view's K2Q row fill (``consumer_k2q.k2q_row_fill``) on fixed-length samples."""
    stats = view.stats()
    q_blocks = -(-seqlen // view.block_size[0])  # per sample
    return k2q_row_fill(stats["partial"] + stats["full"], view.mask_block_cnt.numel(), q_blocks)


def check(mask_func, q, k, v, *, varlen=None, gpu_planner=False, **options):
    """The plan for the problem, then :func:`maskplan_core.testing.check_backward` with ``options``
    (scale, deterministic, with_dlse, repeats, seed); returns ``(plan, runs)``."""
    plan = sm90_plan(mask_func, q, k, v, gpu_planner=gpu_planner, **(varlen or {}))
    return plan, check_backward(run_backward, plan, q, k, v, **options)


#: the cases shared with the SM100 suite (maskplan_core.testing), on this consumer's check
CASES = BackwardCases(check, run_backward, DEV)


# -- masks, fixed length --------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
def test_causal(dtype, deterministic):
    CASES.causal(dtype, deterministic)


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
def test_sliding_window(dtype):
    B, S, H, D = 2, 777, 2, 128
    q, k, v = CASES.qkv((B, S, H), (B, S, H), D, D, dtype, seed=1)
    check(masks.sliding_window(S, window_left=200, batch=B, device=DEV), q, k, v)


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
def test_document(dtype):
    docs = [[100, 300, 13, 611], [1024]]
    q, k, v = CASES.qkv((2, 1024, 3), (2, 1024, 3), 128, 128, dtype, seed=2)
    check(masks.document(docs, causal=True, device=DEV), q, k, v)


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
def test_random_multi_interval_per_head(dtype):
    CASES.random_multi_interval_per_head(dtype)


def test_all_empty_rows():
    CASES.all_empty_rows(q_block=64)  # the SM90 backward's Q block


def test_all_full():
    CASES.all_full()


@pytest.mark.parametrize("sq,sk", [(300, 1000), (1000, 300), (129, 127)])
def test_sq_ne_sk(sq, sk):
    CASES.sq_ne_sk(sq, sk)


@pytest.mark.parametrize("hq,hkv,hmask", [(8, 2, 1), (8, 2, 8), (6, 1, 1)])
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
def test_gqa(hq, hkv, hmask, deterministic):
    CASES.gqa(hq, hkv, hmask, deterministic)


@pytest.mark.parametrize("dqk,dv", SUPPORTED_HEAD_DIMS)
def test_kv_head_split(dqk, dv):
    """Each kv head's q heads split over 1, 2 and 8 items (``kv_head_split``; the default here is 8):
    :meth:`maskplan_core.testing.BackwardCases.kv_head_splits`."""
    forced = {
        s: dataclasses.replace(COMPILER, kv_head_split=lambda *_, s=s: s).run_backward for s in (1, 2, 8)
    }
    plan = CASES.kv_head_splits(dqk, dv, forced)
    sms = torch.cuda.get_device_properties(DEV).multi_processor_count
    assert kv_head_split(bwd_view_args(plan.view("backward"), DEV).k_rows, 8, sms) == 8


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
def test_dlse_and_scale(dtype):
    """The forward's LSE received a gradient (dlse), with a non-default and a negative scale."""
    CASES.dlse_and_scale(dtype)


# -- varlen ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("kind", ["causal", "random"])
def test_varlen_with_empty_samples(dtype, kind):
    CASES.varlen_with_empty_samples(kind, dtype)


# -- other head dims ------------------------------------------------------------------------------
#: head dims without a kernel of their own, run by the next kernel up on the tensors as they are
#: (heuristics.io_head_dims): on the 64 x 128 tile, the 128 x 128 one, Dqk alone, and the 64 x 96 one
NARROWER = [(72, 72), (48, 48), (64, 128), (160, 128)]


#: the kernels' own head dims but (128, 128), which the default cases run
OWN = [d for d in SUPPORTED_HEAD_DIMS if d != (128, 128)]


@pytest.mark.parametrize("dqk,dv", [*OWN, *NARROWER])
@pytest.mark.parametrize("kind", ["causal", "random"])
def test_head_dims(dqk, dv, kind):
    CASES.head_dims(dqk, dv, kind)


@pytest.mark.parametrize("dqk,dv", NARROWER)
@pytest.mark.parametrize("kind", ["causal", "random"])
def test_narrower_head_dims_varlen_with_empty_samples(dqk, dv, kind):
    CASES.varlen_with_empty_samples(kind, dims=(dqk, dv))


#: the head dims of the other backward tiles than the 64 x 128 one the default D = 128 cases run:
#: 128 x 128 (D = 64: 128 Q rows, dQ split by rows), 64 x 96 as S ((192, 128): the warpgroups split
#: S's K columns, dK^T / dV^T) and 64 x 64 (D = 256: the warpgroups split S^T's Q columns and dK /
#: dV's head dim); and 64 x 128 at D = 80, whose dQ halves are 40 columns (m64n40)
OTHER_TILES = [(64, 64), (80, 80), (192, 128), (256, 256)]


@pytest.mark.parametrize("dqk,dv", OTHER_TILES)
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
def test_other_tiles_fp16_and_deterministic(dqk, dv, deterministic):
    CASES.head_dims(dqk, dv, "random", torch.float16, deterministic=deterministic, with_dlse=True)


@pytest.mark.parametrize("dqk,dv", OTHER_TILES)
def test_other_tiles_gqa_per_head_masks(dqk, dv):
    CASES.gqa(8, 2, 8, deterministic=False, dims=(dqk, dv))


@pytest.mark.parametrize("dqk,dv", OTHER_TILES)
@pytest.mark.parametrize("kind", ["causal", "random"])
def test_other_tiles_varlen_with_empty_samples(dqk, dv, kind):
    CASES.varlen_with_empty_samples(kind, dims=(dqk, dv))


# -- deterministic mode ---------------------------------------------------------------------------
@pytest.mark.parametrize("layout,varlen", STRIDED_CASES.values(), ids=list(STRIDED_CASES))
def test_strided_inputs(layout, varlen):
    """q, k, v as slices of a packed QKV tensor or transposed BHSD tensors, read in place."""
    CASES.strided_inputs(layout, varlen)


@pytest.mark.parametrize("seqlen,d", [(768, 128), (768, 64), (768, 256), (700, 128)])
def test_bshd_views_of_bhsd(seqlen, d):
    """q, k, v of 2 samples transposed from ``[B, H, S, D]``: no THD view, so read per sample where S
    is a multiple of the main kernel's granule (768), else copied (700)."""
    view, q, k, v = CASES.per_sample_inputs(seqlen, d)
    granule = config_for_view(view).row_granule
    assert qkv_operands(view, q, k, v, row_granule=granule)[3] == (seqlen % granule == 0)


@pytest.mark.parametrize("d", [64, 256])
def test_strided_inputs_head_dims(d):
    """Packed QKV slices on the other backward tiles (128 x 128 at 64, 64 x 64 at 256)."""
    CASES.strided_inputs("packed", d=d)


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
def test_deterministic_bit_identical(dtype):
    """Three runs of deterministic mode give bit-identical dq/dk/dv (varlen, GQA, per-head masks,
    partial and full blocks, a long sample so many K blocks race for each Q block)."""
    CASES.deterministic_bit_identical(dtype)


@pytest.mark.parametrize("dqk,dv", [(64, 64), (128, 128), (192, 128)])
@pytest.mark.parametrize("kind", ["full", "random"])
def test_deterministic_grouped_launch_order(dqk, dv, kind):
    """Dense K2Q rows and 5 kv heads: the deterministic launch order takes DENSE_HEAD_GROUP (2) kv
    heads at a time, then the remaining 1 (``Sm90BwdKernel.launch_head_group``); three runs are
    bit-identical and match the reference."""
    B, S, H = 2, 1000, 5
    q, k, v = CASES.qkv((B, S, H), (B, S, H), dqk, dv, torch.bfloat16, seed=15)
    if kind == "full":
        ep = torch.full((1, 1, B * S), S, dtype=torch.int32, device=DEV)
    else:
        ep = CASES.random_intervals(1, 3, torch.full((B * S,), S), seed=15)
    plan = sm90_plan(ep, q, k, v)
    assert row_fill(plan.view("backward"), S) >= Sm90BwdKernel.DENSE_ROW_FILL
    assert H > Sm90BwdKernel.DENSE_HEAD_GROUP and H % Sm90BwdKernel.DENSE_HEAD_GROUP
    check_backward(run_backward, plan, q, k, v, deterministic=True, repeats=3)


@pytest.mark.parametrize("dqk,dv", [(192, 128), (256, 256)])
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
def test_sparse_rows_capped_head_group(dqk, dv, deterministic):
    """Sparse K2Q rows (a sliding window) and 6 kv heads on the tiles whose Q blocks are large in
    L2: the atomic launch order takes SPARSE_HEAD_CAP (4) kv heads at a time, then the remaining
    2 (``Sm90BwdKernel.launch_head_group``); deterministic mode the same, as the window's K rows
    end staggered (``consumer_k2q.staggered_row_ends``; test_bwd_plan_contract's
    ``test_staggered_row_ends`` has this mask). Matches the reference, and deterministic runs are
    bit-identical."""
    B, S, H = 2, 1000, 6
    q, k, v = CASES.qkv((B, S, H), (B, S, H), dqk, dv, torch.bfloat16, seed=16)
    plan = sm90_plan(masks.sliding_window(S, window_left=40, batch=B, device=DEV), q, k, v)
    assert bwd_view_args(plan.view("backward"), DEV).sparse_rows
    kernel = Sm90BwdKernel(
        select_bwd_config(head_dim_qk=dqk, head_dim_v=dv, dtype="bfloat16"), deterministic=deterministic
    )
    assert 0 < (kernel.det_stagger_heads if deterministic else kernel.sparse_heads) < H
    repeats = 3 if deterministic else 1
    check_backward(run_backward, plan, q, k, v, deterministic=deterministic, repeats=repeats)


def test_half_full_rows_capped_head_group():
    """Half-full K2Q rows (causal) and 10 kv heads at (256, 256): deterministic mode takes
    ``det_capped_heads`` (8) kv heads at a time, then the remaining 2
    (``Sm90BwdKernel.launch_head_group``). Matches the reference; three runs are bit-identical."""
    B, S, H = 2, 1000, 10
    q, k, v = CASES.qkv((B, S, H), (B, S, H), 256, 256, torch.bfloat16, seed=18)
    plan = sm90_plan(masks.causal(S, batch=B, device=DEV), q, k, v)
    view = plan.view("backward")
    fill = row_fill(view, S)
    assert not bwd_view_args(view, DEV).sparse_rows and fill < Sm90BwdKernel.DENSE_ROW_FILL, fill
    kernel = Sm90BwdKernel(
        select_bwd_config(head_dim_qk=256, head_dim_v=256, dtype="bfloat16"), deterministic=True
    )
    assert 0 < kernel.det_capped_heads < H
    check_backward(run_backward, plan, q, k, v, deterministic=True, repeats=3)


@pytest.mark.parametrize("dqk,dv", [(192, 128), (256, 256)])
def test_half_full_staggered_rows_take_the_stagger_cap(dqk, dv):
    """Half-full K2Q rows with staggered ends (a window of about a third of the sample) and 6 kv
    heads: deterministic mode takes ``det_stagger_heads`` (4) kv heads at a time, then the
    remaining 2, also at (256, 256) where half-full rows otherwise take ``det_capped_heads``
    (``Sm90BwdKernel.launch_head_group``; the kernel's own choice, read by the probe). Matches the
    reference; three runs are bit-identical."""
    B, S, H = 2, 1000, 6
    q, k, v = CASES.qkv((B, S, H), (B, S, H), dqk, dv, torch.bfloat16, seed=19)
    plan = sm90_plan(masks.sliding_window(S, window_left=300, batch=B, device=DEV), q, k, v)
    view = plan.view("backward")
    assert SPARSE_ROW_FILL <= row_fill(view, S) < Sm90BwdKernel.DENSE_ROW_FILL
    staggered, pairs = host_stagger(view)
    assert staggered * 2 > pairs
    kernel = Sm90BwdKernel(
        select_bwd_config(head_dim_qk=dqk, head_dim_v=dv, dtype="bfloat16"), deterministic=True
    )
    assert 0 < kernel.det_stagger_heads < H
    assert probe_launch_order(view, deterministic=True, device=DEV) == (kernel.det_stagger_heads, 1)
    check_backward(run_backward, plan, q, k, v, deterministic=True, repeats=3)


#: kv heads the launch order takes at a time, H = 10 kv heads, B=2 S=8192 (the benchmark's masks):
#: {(dim, deterministic): (causal, sliding-1024, document, random-5, sliding-4096)}, dim 192 with
#: Dv = 128. Causal's K2Q rows are half full, sliding-1024's and documents' sparse, random-5's
#: dense, sliding-4096's half full; sliding windows' ends are staggered
LAUNCH_GROUPS = {
    (128, False): (ATOMIC_HEAD_GROUP, 10, 10, ATOMIC_HEAD_GROUP, ATOMIC_HEAD_GROUP),  # sparse: all heads
    (192, False): (ATOMIC_HEAD_GROUP, 4, 4, ATOMIC_HEAD_GROUP, ATOMIC_HEAD_GROUP),  # sparse: SPARSE_HEAD_CAP
    (256, False): (ATOMIC_HEAD_GROUP, 4, 4, ATOMIC_HEAD_GROUP, ATOMIC_HEAD_GROUP),
    (128, True): (10, 10, 10, 2, 10),  # dense rows: DENSE_HEAD_GROUP
    (192, True): (10, 4, 4, 2, 4),  # sparse rows: mirrored, atomic's; half-full staggered: det_stagger_heads
    (256, True): (8, 4, 4, 2, 4),  # and half-full rows: det_capped_heads, unless staggered
}


@pytest.mark.parametrize("dim,deterministic", LAUNCH_GROUPS, ids=lambda x: str(x))
def test_launch_order_as_the_kernel_decides(dim, deterministic):
    """Every launch order gives the same bits, so a one-warp probe (``launch_order_probe``) runs the
    main kernel's own ``launch_head_group`` and ``staggered_row_ends`` on the benchmark's masks:
    the kv heads at a time are LAUNCH_GROUPS', and the staggered flag is the host's count of the
    sampled pairs (``host_stagger``)."""
    B, S, H = 2, 8192, 10
    q = torch.zeros(B, S, H, dim, dtype=torch.bfloat16, device=DEV)
    v = q if dim != 192 else torch.zeros(B, S, H, 128, dtype=torch.bfloat16, device=DEV)
    eps = (
        masks.causal(S, batch=B, device=DEV),
        masks.sliding_window(S, window_left=1024, batch=B, device=DEV),
        masks.document([[3000, 2000, 1500, 1692], [5000, 3192]], device=DEV),
        CASES.random_intervals(1, 5, torch.full((B * S,), S), seed=3),
        masks.sliding_window(S, window_left=4096, batch=B, device=DEV),
    )
    for ep, group in zip(eps, LAUNCH_GROUPS[dim, deterministic], strict=True):
        view = sm90_plan(ep, q, q, v).view("backward")
        staggered, pairs = host_stagger(view)
        assert probe_launch_order(view, deterministic=deterministic, device=DEV) == (
            group, int(staggered * 2 > pairs)
        )  # fmt: skip


def test_launch_order_probe_on_small_and_varlen_views():
    """The staggered-ends sample on views of 1-5 K rows (pairs repeat or are missing) and on a
    varlen view whose pairs cross samples: the kernel's flag equals the host's count."""
    cases = [(masks.sliding_window(n, window_left=16, batch=1, device=DEV), n) for n in (40, 100, 200, 320)]
    cu = torch.tensor([0, 700, 900, 2900, 3000], dtype=torch.int32, device=DEV)
    cases.append((masks.sliding_window(window_left=64, cu_seqlens_q=cu, cu_seqlens_k=cu), None))
    for ep, seqlen in cases:
        if seqlen is None:
            q = torch.zeros(int(cu[-1]), 2, 256, dtype=torch.bfloat16, device=DEV)
            view = sm90_plan(ep, q, q, q, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=2000,
                             max_seqlen_k=2000).view("backward")  # fmt: skip
        else:
            q = torch.zeros(1, seqlen, 2, 256, dtype=torch.bfloat16, device=DEV)
            view = sm90_plan(ep, q, q, q).view("backward")
        staggered, pairs = host_stagger(view)
        assert probe_launch_order(view, deterministic=True, device=DEV)[1] == int(staggered * 2 > pairs)


@pytest.mark.parametrize("dqk,dv", SUPPORTED_HEAD_DIMS)
def test_atomic_sparse_rows_store_the_first_dq(dqk, dv):
    """Atomic mode on sparse K2Q rows (a 300-key sliding window, GQA 4/2) stores each Q block's
    first dQ contribution and leaves the accumulator unzeroed (``BackwardCompiler.first_dq_stored``;
    the workspace starts as NaN); the other contributions (ranks 1-3 at D <= 128, up to 5 at
    (256, 256)) wait for it, then add. dQ matches the reference, and is 0 on the 300 queries blanked
    in sample 0, whose Q blocks no K block visits (the postprocess's ``zero_unvisited``;
    ``check_backward`` asserts those zeros)."""
    B, S = 2, 2048
    q, k, v = CASES.qkv((B, S, 4), (B, S, 2), dqk, dv, torch.bfloat16, seed=17)
    ep = masks.sliding_window(S, window_left=300, batch=B, device=DEV)
    ep[..., 500:800] = 0  # [0, 0) U [0, 0): no visible key
    plan = sm90_plan(ep, q, k, v)
    view = plan.view("backward")
    assert bwd_view_args(view, DEV).sparse_rows
    assert int(view.dq_write_order.max()) >= 3
    check_backward(run_backward, plan, q, k, v)


@pytest.mark.parametrize("dqk,dv", SUPPORTED_HEAD_DIMS)
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
def test_mirrored_order_on_documents(dqk, dv, deterministic):
    """Packed documents (sparse K2Q rows whose ends align) take the mirrored order in deterministic
    mode from (192, 128) on (K rows launched descending, walks ascending, ``mirrored_view_args``'
    ranks), the plan's elsewhere: within tolerance of the reference with GQA 4/2, as it comes and
    with each kv head's q heads split over 2 items (``kv_head_split``), and deterministic runs
    bit-identical. A launch whose order disagreed with its ranks would wait forever on a
    turnstile, or add dQ out of rank order."""
    docs = [[40, 300, 13, 211, 60, 400], [64] * 16]
    q, k, v = CASES.qkv((2, 1024, 4), (2, 1024, 2), dqk, dv, torch.bfloat16, seed=19)
    plan = sm90_plan(masks.document(docs, causal=True, device=DEV), q, k, v)
    view = plan.view("backward")
    assert bwd_view_args(view, DEV).sparse_rows
    large = (dqk, dv) in ((192, 128), (256, 256))
    assert COMPILER.mirrored(config_for_view(view), deterministic, True) == (deterministic and large)
    repeats = 3 if deterministic else 1
    split = dataclasses.replace(COMPILER, kv_head_split=lambda *_: 2).run_backward
    for run in (run_backward, split):
        check_backward(run, plan, q, k, v, deterministic=deterministic, repeats=repeats)


@pytest.mark.parametrize("dqk,dv", [(64, 64), (128, 128), (192, 128)])
def test_gpu_planner_plan(dqk, dv):
    """The production path: the plan built by the GPU planner kernels (build_plan_gpu), on the
    128 x 128, the 64 x 128 and the S-oriented 64 x 96 backward tile."""
    H, Hkv = 4, 2
    q, k, v = CASES.qkv((VARLEN_CU_Q[-1], H), (VARLEN_CU_K[-1], Hkv), dqk, dv, torch.bfloat16, seed=13)
    ep = CASES.varlen_mask("random", seed=13)
    check(ep, q, k, v, varlen=varlen_args(DEV), gpu_planner=True)
    check(ep, q, k, v, varlen=varlen_args(DEV), gpu_planner=True, deterministic=True, repeats=2)


@pytest.mark.parametrize("dqk,dv", [(64, 64), (128, 128), (192, 128), (256, 256)])
def test_small_for_sanitizer(dqk, dv):
    """A small case for ``compute-sanitizer --tool memcheck|racecheck|synccheck`` (select with -k small)
    on each backward tile (128 x 128, 64 x 128, 64 x 96 as S at (192, 128) and 64 x 64 at (256, 256),
    the last two with P / dS through SMEM, the last with one shared dQ chunk). racecheck reports the D=256
    kernels' dQ chunk stores (the chunk the two warpgroups fill in turn, handed over through the dQ
    writer's named barriers): it does not take ``bar.arrive`` as ordering the arriving warps' writes
    (``benchmarks/sanitizer/barrier_chain.cu``)."""
    CASES.small_for_sanitizer((dqk, dv))
