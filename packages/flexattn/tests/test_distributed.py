"""Distributed training on the CPU reference, two processes on gloo.

Data parallelism: each rank plans its own batch (its own documents) and passes the plan to its
replica, as ``examples/train_packed_documents.py`` does; DDP (plan as an argument, checkpointed
blocks) and FSDP2 (plan on a module attribute) average the gradients. Both must give what one
process computes from the two batches.

Context parallelism (the README's recipe): each rank holds some query positions of one long batch
and attends to every key, gathered from all ranks, with a plan for its rows of the batch's mask;
outputs and gradients must be one process's at those positions."""

from __future__ import annotations

import datetime
import os
import re
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import flexattn
from flexattn import masks

B, S, H, D = 2, 48, 2, 8
WORLD = 2
#: each rank's documents (one list per sample): the ranks' plans differ
DOCS = ([[20, 28], [48]], [[5, 30, 13], [16, 32]])

pytestmark = [
    pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo"),
    pytest.mark.slow,  # two processes that import torch: about 5-8 s
]


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = torch.nn.Linear(H * D, 3 * H * D, dtype=torch.float64)
        self.out = torch.nn.Linear(H * D, H * D, dtype=torch.float64)
        self.plan = None  # set per batch where the model holds its plan

    def forward(self, x: torch.Tensor, plan: flexattn.MaskPlan | None = None) -> torch.Tensor:
        q, k, v = self.qkv(x).view(B, S, 3 * H, D).chunk(3, dim=2)
        o = flexattn.flex_attn_func(q, k, v, mask_plan=plan if plan is not None else self.plan)
        return x + self.out(o.reshape(B, S, H * D))


class Model(torch.nn.Module):
    def __init__(self, checkpointed: bool = False):
        super().__init__()
        with torch.random.fork_rng():  # the same weights in every process, the caller's RNG untouched
            torch.manual_seed(0)
            self.blocks = torch.nn.ModuleList([Block(), Block()])
        self.checkpointed = checkpointed

    def forward(self, x: torch.Tensor, plan: flexattn.MaskPlan | None = None) -> torch.Tensor:
        for block in self.blocks:
            x = checkpoint(block, x, plan, use_reentrant=False) if self.checkpointed else block(x, plan)
        return x


def _batch(rank: int) -> tuple[torch.Tensor, torch.Tensor, flexattn.MaskPlan]:
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(B, S, H * D, dtype=torch.float64, generator=gen)
    target = torch.randn(B, S, H * D, dtype=torch.float64, generator=gen)
    like = torch.empty(B, S, H, D, dtype=torch.float64, requires_grad=True)
    plan = flexattn.create_mask_plan(masks.document(DOCS[rank], causal=True), like, like, like)
    return x, target, plan


def _loss(model, x, target, plan, *, on_attribute=False):
    if on_attribute:
        for block in model.blocks:
            block.plan = plan
    return F.mse_loss(model(x) if on_attribute else model(x, plan), target)


def _on_ranks(work, tmp_path, out) -> None:
    """``work(rank, out)`` on ``WORLD`` gloo processes."""
    mp.spawn(_rank, args=(work, f"file://{tmp_path / 'store'}", str(out)), nprocs=WORLD, join=True)


def _rank(rank: int, work, init: str, out: str) -> None:
    dist.init_process_group(
        "gloo", init_method=init, rank=rank, world_size=WORLD, timeout=datetime.timedelta(seconds=60)
    )
    try:
        work(rank, out)
    finally:
        dist.destroy_process_group()
    # a rank that succeeded (its results on disk) leaves without the interpreter's finalization:
    # there gloo's worker threads may still hold tensors whose release aborts the process
    # ("terminate called without an active exception", seen under load in CI), torch's teardown
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _data_parallel(rank: int, out: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    x, target, plan = _batch(rank)
    ddp = DistributedDataParallel(Model(checkpointed=True))
    _loss(ddp, x, target, plan).backward()
    fsdp = Model()
    # a CPU mesh: without one FSDP2 shards onto CUDA where a GPU is present, away from the plan's device
    mesh = init_device_mesh("cpu", (WORLD,))
    for block in fsdp.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(fsdp, mesh=mesh)
    _loss(fsdp, x, target, plan, on_attribute=True).backward()
    grads = {
        "ddp": [p.grad for p in ddp.module.parameters()],
        "fsdp": [p.grad.full_tensor() for p in fsdp.parameters()],
    }
    if rank == 0:
        torch.save(grads, out)


def test_ddp_and_fsdp2_average_what_one_process_computes(tmp_path):
    out = tmp_path / "grads.pt"
    _on_ranks(_data_parallel, tmp_path, out)
    model = Model()
    for rank in range(WORLD):
        x, target, plan = _batch(rank)
        (_loss(model, x, target, plan) / WORLD).backward()
    expected = [p.grad for p in model.parameters()]
    got = torch.load(out)
    for name in ("ddp", "fsdp"):
        assert len(got[name]) == len(expected)
        for g, e in zip(got[name], expected, strict=True):
            torch.testing.assert_close(g, e, rtol=1e-12, atol=1e-12, msg=lambda m, n=name: f"{n}: {m}")


README = Path(__file__).resolve().parents[1] / "README.md"
#: the one batch that context parallelism splits over the ranks' positions
CP_DOCS = [[20, 28], [48]]


def balanced_positions(rank: int, world: int, seqlen: int) -> torch.Tensor:
    """Rank ``rank``'s query positions: chunks ``rank`` and ``2 world - 1 - rank`` of ``2 world``, so
    under a causal mask every rank has about as many visible keys."""
    chunk = seqlen // (2 * world)
    first, last = rank * chunk, (2 * world - 1 - rank) * chunk
    return torch.cat([torch.arange(first, first + chunk), torch.arange(last, last + chunk)])


def _readme_recipe(name: str = "context-parallel") -> str:
    """The README's ``name`` block, as written there."""
    block = re.search(rf"```python {name}\n(.*?)```", README.read_text(), re.S)
    assert block, f"{README} lost its {name} recipe"
    return textwrap.dedent(block.group(1))


def _cp_batch() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(5)
    return [torch.randn(B, S, H, D, dtype=torch.float64, generator=gen) for _ in range(4)]  # q, k, v, dout


def _gather(t: torch.Tensor) -> torch.Tensor:
    """The recipe's ``gather``, as its README names it: every rank's ``[B, n, ...]`` along dim 1,
    in rank order; the backward sums the ranks' gradients of this rank's part."""
    from torch.distributed.nn.functional import all_gather

    return torch.cat(all_gather(t), dim=1)


def _context_parallel(rank: int, out: str) -> None:
    q, k, v, dout = _cp_batch()
    positions = [balanced_positions(r, WORLD, S) for r in range(WORLD)]
    mine = positions[rank]
    q, k, v = (t[:, mine].requires_grad_() for t in (q, k, v))
    scope = dict(
        positions=positions, rank=rank, mask=masks.document(CP_DOCS, causal=True), B=B, S=S,
        q_mine=q, k_mine=k, v_mine=v, gather=_gather, torch=torch, flexattn=flexattn,
    )  # fmt: skip
    exec(compile(_readme_recipe(), str(README), "exec"), scope)
    o = scope["out_mine"]
    o.backward(dout[:, mine])
    torch.save({"o": o.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}, f"{out}.{rank}")


def test_context_parallel_ranks_give_one_process_at_their_positions(tmp_path):
    out = tmp_path / "cp"
    _on_ranks(_context_parallel, tmp_path, out)
    q, k, v, dout = (t.requires_grad_() for t in _cp_batch())
    plan = flexattn.create_mask_plan(masks.document(CP_DOCS, causal=True), q, k, v)
    o = flexattn.flex_attn_func(q, k, v, mask_plan=plan)
    o.backward(dout.detach())
    expected = {"o": o.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}
    for rank in range(WORLD):
        got, mine = torch.load(f"{out}.{rank}"), balanced_positions(rank, WORLD, S)
        for name, want in expected.items():
            label = f"rank {rank} {name}"
            torch.testing.assert_close(
                got[name], want[:, mine], rtol=1e-12, atol=1e-12, msg=lambda m, w=label: f"{w}: {m}"
            )


def test_ring_attention_steps_merge_to_one_call():
    """The README's ring-attention block for every rank of one process: each rank's q positions
    attend the k / v shard of every rank's positions in turn (rows of no key in a step, or in
    every step: padding), merged by LSE; outputs and gradients (the shards' dK / dV summed over
    the steps that used them) must be one call's."""
    world = 3
    ids = torch.tensor([[1] * 20 + [2] * 20 + [-1] * 8, [3] * 48])  # sample 0 ends in padding
    mask = masks.document_ids(ids, causal=True, window_left=12, pad_id=-1)
    *qkv, dout = _cp_batch()
    q, k, v = (t.requires_grad_() for t in qkv)
    positions = [balanced_positions(r, world, S) for r in range(world)]
    rings = []
    for rank in range(world):
        mine = positions[rank]
        scope = dict(
            positions=positions, rank=rank, mask=mask, B=B, S=S, q_mine=q[:, mine],
            k_mine=k[:, mine], v_mine=v[:, mine], gather=lambda t: t, torch=torch, flexattn=flexattn,
        )  # fmt: skip
        exec(compile(_readme_recipe().split("in_order")[0], str(README), "exec"), scope)  # rows
        scope.update(k_shards=[k[:, p] for p in positions], v_shards=[v[:, p] for p in positions])
        exec(compile(_readme_recipe("ring-attention"), str(README), "exec"), scope)
        rings.append(scope["out_mine"])
        (scope["out_mine"] * dout[:, mine]).sum().backward()
    got = {"o": torch.cat(rings, 1), "dq": q.grad, "dk": k.grad, "dv": v.grad}
    order = torch.cat(positions)
    got["o"] = got["o"][:, torch.argsort(order)]
    q2, k2, v2 = (t.detach().clone().requires_grad_() for t in (q, k, v))
    o = flexattn.flex_attn_func(q2, k2, v2, mask_plan=flexattn.create_mask_plan(mask, q2, k2, v2))
    (o * dout).sum().backward()
    assert (o[0, 40:] == 0).all()  # the padding's rows: no key in any step
    for name, want in {"o": o, "dq": q2.grad, "dk": k2.grad, "dv": v2.grad}.items():
        torch.testing.assert_close(got[name], want, rtol=1e-12, atol=1e-12, msg=lambda m, n=name: f"{n}: {m}")
