"""Config selection for the SM90 kernels: problem -> :class:`Sm90FwdConfig` / :class:`Sm90BwdConfig`.

The tile is chosen by head dims only (so one plan serves every sequence length). With
``pack_gqa`` the forward tile's 128 rows hold ``G = Hq / Hkv`` heads x ``128 / G`` positions
(``G`` must divide 128), and the plan's Q block is ``128 / G`` positions:

==============  ============  ==========================  ====================================
(Dqk, Dv)       forward tile  backward tile (Q x K)       why
==============  ============  ==========================  ====================================
(32, 32)        128 x 128     128 x 128                   two consumer warpgroups x m64n128
(64, 64)        128 x 128     128 x 128                   S^T m64n128 per warpgroup, dQ split
                                                          by rows (m64n64): see bwd_tile
(80, 80)        128 x 128     64 x 128                    dQ split by head dim (m64n40); on the
                                                          (96, 96) kernels fwd+bwd ran 4-7% slower
(96, 96)        128 x 128     64 x 128
(128, 128)      128 x 128     64 x 128
(192, 128)      128 x 128     64 x 96, S (not S^T)        see bwd_tile
(256, 256)      128 x 64      64 x 64                     N64 leaves SMEM for the 2-stage mask
                                                          pipeline (spec 6.2)
==============  ============  ==========================  ====================================

Backward: the tile is ``tile_m`` Q rows x ``tile_n`` K columns; the kernel's two consumer
warpgroups compute ``S^T`` (K rows x Q columns): for 128x128 and 64x128 each takes 64 K rows, for
64x64 they split the 64 Q columns (32 each) and dK / dV's head dim. At (192, 128) they compute
``S`` (Q rows x K columns), 48 K columns each, and dK^T / dV^T (``bwd_kernel.py``).
"""

from __future__ import annotations

from maskplan_core.consumer import require_pack_gqa_ratio, require_supported
from maskplan_core.head_dim_padding import holding_head_dims

from .config import Sm90BwdConfig, Sm90FwdConfig

#: the head dims the kernels are built for; any other pair runs on the cheapest of them that holds
#: it (:func:`kernel_head_dims`), its tensors' columns past their head dims read as zeros
SUPPORTED_HEAD_DIMS: tuple[tuple[int, int], ...] = (
    (32, 32), (64, 64), (80, 80), (96, 96), (128, 128), (192, 128), (256, 256)
)  # fmt: skip
SUPPORTED_DTYPES: tuple[str, ...] = ("float16", "bfloat16")


def check_dtype(dtype: str) -> None:
    require_supported("dtype", dtype, SUPPORTED_DTYPES, "flexattn-sm90")


def kernel_head_dims(head_dim_qk: int, head_dim_v: int) -> tuple[int, int]:
    """The kernels' head dims that run ``(head_dim_qk, head_dim_v)``
    (:func:`maskplan_core.head_dim_padding.holding_head_dims`: ``(72, 72)`` on ``(80, 80)``,
    ``(160, 128)`` on ``(192, 128)``). The kernels read the tensors at their own head dims
    (:func:`io_head_dims`): TMA fills the columns past them with zeros and the stores leave those
    out."""
    return holding_head_dims(head_dim_qk, head_dim_v, SUPPORTED_HEAD_DIMS, "flexattn-sm90")


def check_head_dims(head_dim_qk: int, head_dim_v: int) -> None:
    kernel_head_dims(head_dim_qk, head_dim_v)


def io_head_dims(head_dim_qk: int, head_dim_v: int) -> tuple[int, int]:
    """The head dims of the tensors the kernels take for a problem's: each rounded up to a multiple
    of 8 (a 16-byte aligned row, as TMA needs); only head dims that are not take a zero-padded copy
    of the tensors (:mod:`maskplan_core.head_dim_padding`)."""
    return -(-head_dim_qk // 8) * 8, -(-head_dim_v // 8) * 8


def _io_fields(head_dim_qk: int, head_dim_v: int, kernel: tuple[int, int]) -> dict:
    """A config's ``io_head_dim_qk`` / ``io_head_dim_v``: None where the tensors' head dim is the kernel's."""
    io = io_head_dims(head_dim_qk, head_dim_v)
    fields = zip(("io_head_dim_qk", "io_head_dim_v"), io, kernel, strict=True)
    return {name: None if d == k else d for name, d, k in fields}


def fwd_tile(head_dim_qk: int, head_dim_v: int) -> tuple[int, int]:
    """Forward ``(tile_m, tile_n)``."""
    check_head_dims(head_dim_qk, head_dim_v)
    return (128, 64) if head_dim_qk > 192 else (128, 128)


def bwd_tile(head_dim_qk: int, head_dim_v: int) -> tuple[int, int, bool]:
    """Backward ``(tile_m, tile_n, transposed_scores)``: (Q rows, K columns) of the score tile and
    whether the kernel computes it as S^T (K rows on WGMMA M). Up to D = 64 a step
    takes 128 Q rows: its S^T / dP^T GEMMs are m64n128 rather than m64n64 and dQ's are m64n64
    rather than m64n32 (whose operands need more SMEM bandwidth than the tensor cores' rate
    leaves), and the step's fixed costs (barriers, the dQ hand-over) spread over twice the FLOPs;
    the registers still fit (no spills at 232 per MMA thread).

    From (192, 128) on, S^T's 64 K rows per warpgroup would leave a whole-D dK and dV over the
    registers, so the K block is 64 rows and each step moves a Q block's Q, dO and fp32 dQ through
    L2 for only 64 K rows: L2-bound, 0.83-0.91x cuDNN fwd+bwd at (192, 128) (benchmarks/RESULTS.md,
    session 21). Computing S instead (Q rows on M) lets the two warpgroups split a 96-row K block
    (m64n48 each) with dK^T and dV^T as their accumulators (72 + 48 registers), 1.5x the K rows per
    step. (256, 256) keeps 64 x 64: a 96-row K and V (96 KB) leave no SMEM for two Q stages."""
    check_head_dims(head_dim_qk, head_dim_v)
    d = max(head_dim_qk, head_dim_v)
    if d <= 128:
        return (128, 128, True) if d <= 64 else (64, 128, True)
    return (64, 96, False) if head_dim_qk + head_dim_v <= 320 else (64, 64, True)


def bwd_stages(head_dim_qk: int, head_dim_v: int) -> tuple[int, int]:
    """``(q_stages, do_stages)`` of the backward: at (256, 256) two Q stages and one dO stage
    (64 + 32 KB) next to K, V and two stages of P and dS fill the 227 KB of SMEM; two dO stages do
    not fit. dQ goes through SMEM there one warpgroup chunk at a time (bwd_kernel.py). At (192, 128)
    the 96-row K / V tile leaves room for either a second dO stage or a dQ chunk per warpgroup: one
    dO stage with two chunks measured 4-6% faster fwd+bwd on every mask than two dO stages with a
    shared chunk (benchmarks/RESULTS.md, session 23)."""
    return (2, 1) if head_dim_qk + head_dim_v > 256 else (2, 2)


#: the smallest group ``Hq / Hkv`` whose forward packs where ``pack_gqa`` is left None: on an H100
#: (B=2, S=8192, Hq=32, D=128; benchmarks/RESULTS.md, session 58) packing took the forward's device
#: time down 5-6% on documents at G = 4, 8 and 32 and 9% on random-5 at G = 32, within 1% either
#: way elsewhere (random-5 +1% at G = 8), and fwd+bwd within -1% .. +2%; at G = 4, D = 64 and 256:
#: documents -7% / -8%, random-5 +3% / +1%; a warm plan build cost up to 0.2 ms more at G = 32.
#: The largest default group is 64 (Q blocks of 2 positions), which the GPU tests train packed
#: (tests/test_gpu_end_to_end.py's mqa-g32 and mqa-g64); at G = 32, D = 128 (session 59, one H100 run)
#: packing took the forward's device time down 6% on documents and 9% on random-5, within 1%
#: either way on causal and sliding-1024, and fwd+bwd within 2%. At G = 64 (Q blocks of 2
#: positions, mqa-g64; session 60, one H100 run, Hq = 64) packing took the forward's device time
#: down 6% on documents and 24% on random-5 (unpacked, random-5 ran at 0.73x cuDNN), within 0.3%
#: on causal and sliding-1024; fwd+bwd within 0.4% there, documents -1%, random-5 -6%.
PACK_GQA_MIN_GROUP, PACK_GQA_MAX_GROUP = 4, 64


def packs_by_default(head_dim_qk: int, head_dim_v: int, group: int, mask_heads: int) -> bool:
    """``pack_gqa=None``'s choice: pack a shared mask's (Hmask = 1) group of
    :data:`PACK_GQA_MIN_GROUP` .. :data:`PACK_GQA_MAX_GROUP` q heads where the forward tile takes
    it (``G`` divides its rows)."""
    tile_m = fwd_tile(*kernel_head_dims(head_dim_qk, head_dim_v))[0]
    return mask_heads == 1 and PACK_GQA_MIN_GROUP <= group <= PACK_GQA_MAX_GROUP and tile_m % group == 0


def select_fwd_config(
    *,
    head_dim_qk: int,
    head_dim_v: int,
    dtype: str,
    pack_gqa: bool = False,
    qhead_per_kvhead: int = 1,
    varlen: bool = False,
) -> Sm90FwdConfig:
    """The forward config of a problem; head dims without a kernel get the one that holds them."""
    check_dtype(dtype)
    kernel = kernel_head_dims(head_dim_qk, head_dim_v)
    io = _io_fields(head_dim_qk, head_dim_v, kernel)
    head_dim_qk, head_dim_v = kernel
    tile_m, tile_n = fwd_tile(head_dim_qk, head_dim_v)
    if pack_gqa:
        require_pack_gqa_ratio(qhead_per_kvhead, tile_m)
    # with one Q buffer the next Q load waited for this task's last S GEMM, and its first K / V
    # block behind it, so a short task's consumers waited for both (ncu, D=128 sliding-1024: 4.8%
    # of samples); two buffers took the forward's device time up 3-4% (D=128) and 7-8% (D=64) on
    # sliding-1024 and documents, causal and random-5 unchanged (benchmarks/RESULTS.md, session
    # 20). From (192, 128) on the second buffer leaves no SMEM.
    q_buffers = 2 if max(head_dim_qk, head_dim_v) <= 128 else 1
    return Sm90FwdConfig(
        head_dim_qk=head_dim_qk,
        head_dim_v=head_dim_v,
        dtype=dtype,
        tile_m=tile_m,
        tile_n=tile_n,
        num_consumer_warpgroups=tile_m // 64,
        pack_gqa=pack_gqa,
        qhead_per_kvhead=qhead_per_kvhead,
        varlen=varlen,
        q_buffers=q_buffers,
        # where one Q buffer remains, loading the first K / V block first measured +1-3% on
        # (192, 128) (causal, sliding-1024, document) and -2% on (256, 256)'s sliding-1024 and
        # documents (RESULTS.md, session 21)
        q_after_first_kv=q_buffers == 1 and tile_n == 128,
        **io,
    )


def select_bwd_config(
    *, head_dim_qk: int, head_dim_v: int, dtype: str, qhead_per_kvhead: int = 1, varlen: bool = False
) -> Sm90BwdConfig:
    """The backward config of a problem; head dims without a kernel get the one that holds them."""
    check_dtype(dtype)
    kernel = kernel_head_dims(head_dim_qk, head_dim_v)
    io = _io_fields(head_dim_qk, head_dim_v, kernel)
    head_dim_qk, head_dim_v = kernel
    tile_m, tile_n, transposed_scores = bwd_tile(head_dim_qk, head_dim_v)
    q_stages, do_stages = bwd_stages(head_dim_qk, head_dim_v)
    return Sm90BwdConfig(
        head_dim_qk=head_dim_qk,
        head_dim_v=head_dim_v,
        dtype=dtype,
        tile_m=tile_m,
        tile_n=tile_n,
        num_consumer_warpgroups=2,
        qhead_per_kvhead=qhead_per_kvhead,
        varlen=varlen,
        q_stages=q_stages,
        do_stages=do_stages,
        transposed_scores=transposed_scores,
        **io,
    )
