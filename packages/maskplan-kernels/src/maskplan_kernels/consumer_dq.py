"""dQ accumulation of the backward main kernels (CuTe DSL): the bulk copies the DSL has no op for
(:func:`bulk_reduce_add_f32`: ``cp.reduce.async.bulk`` fp32 add; :func:`bulk_store`) and the
per-(q head, Q block) turnstile (:func:`turnstile_wait` / :func:`turnstile_advance`) that makes
deterministic mode add in the plan's ``dq_write_order``, and SM90's atomic mode on sparse K2Q rows
wait for each block's first contribution, which it stores.
"""

import cutlass.cute as cute
from cutlass import Int32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import dsl_user_op


def _bulk_to_global(instruction: str, smem_src: cute.Pointer, gmem_dst: cute.Pointer, num_bytes: int, loc, ip):  # noqa: E501
    llvm.inline_asm(
        None,
        [
            gmem_dst.toint(loc=loc, ip=ip).ir_value(),
            smem_src.toint(loc=loc, ip=ip).ir_value(),
            Int32(num_bytes).ir_value(loc=loc, ip=ip),
        ],
        f"{instruction} [$0], [$1], $2;",
        "l,r,r",
        has_side_effects=True,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    )


@dsl_user_op
def bulk_reduce_add_f32(smem_src: cute.Pointer, gmem_dst: cute.Pointer, num_bytes: int, *, loc=None, ip=None):
    """``gmem[i] += smem[i]`` for ``num_bytes / 4`` fp32 values, by the bulk copy engine
    (``cp.reduce.async.bulk``, completion through the issuing thread's bulk async-group)."""
    _bulk_to_global(
        "cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32", smem_src, gmem_dst, num_bytes, loc, ip
    )


@dsl_user_op
def bulk_store(smem_src: cute.Pointer, gmem_dst: cute.Pointer, num_bytes: int, *, loc=None, ip=None):
    """``gmem[i] = smem[i]`` for ``num_bytes`` bytes, by the bulk copy engine (``cp.async.bulk``;
    completion as for :func:`bulk_reduce_add_f32`)."""
    _bulk_to_global("cp.async.bulk.global.shared::cta.bulk_group", smem_src, gmem_dst, num_bytes, loc, ip)


@cute.jit
def turnstile_wait(counter: cute.Pointer, ticket: Int32, leader: Int32):
    """Spin (the thread whose ``leader`` index is 0) until ``*counter == ticket`` with acquire
    semantics, then order the bulk reductions that follow (async proxy) after the acquire.
    Called by whole warps (``leader`` is the lane, or the thread index in a group of warps that
    then meets at a barrier)."""
    if leader == 0:
        seen = cute.arch.load(counter, Int32, sem="acquire", scope="gpu")
        while seen != ticket:
            seen = cute.arch.load(counter, Int32, sem="acquire", scope="gpu")
    cute.arch.sync_warp()
    cute.arch.fence_proxy("async.global")


@cute.jit
def turnstile_advance(counter: cute.Pointer, leader: Int32):
    """After the calling threads' bulk reductions completed (``cp.async.bulk.wait_group 0``): make
    them visible, then (the thread whose ``leader`` index is 0) pass the turn on (release).
    Called by whole warps, like :func:`turnstile_wait`."""
    cute.arch.fence_proxy("async.global")
    if leader == 0:
        cute.arch.red(counter, Int32(1), op="add", dtype="s32", sem="release", scope="gpu")
    cute.arch.sync_warp()


__all__ = [
    "bulk_reduce_add_f32",
    "bulk_store",
    "turnstile_advance",
    "turnstile_wait",
]
