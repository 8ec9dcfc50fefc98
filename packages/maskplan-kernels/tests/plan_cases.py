"""Problem generators and plan comparison shared by the emulated (CPU) and GPU builder tests."""

from __future__ import annotations

import torch

from maskplan_core.consumer import ViewConfig
from maskplan_core.geometry import PlanGeometry
from maskplan_core.payload import PayloadLayout, RowMajorLayout
from maskplan_core.plan import VIEW_TENSORS, MaskPlan
from maskplan_core.schema import PlanSignature, Topology

KINDS = ("random", "causal", "window", "document", "adjacent", "full", "empty")


def make_geometry(
    q_lens,
    k_lens,
    *,
    hq=2,
    hkv=1,
    hmask=1,
    nfunc=3,
    varlen=True,
    device="cpu",
    dtype=torch.bfloat16,
    head_dim=64,
    max_q=None,
    max_k=None,
) -> PlanGeometry:
    cu_q = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    cu_k = torch.tensor([0, *torch.tensor(k_lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    return PlanGeometry(
        batch=len(q_lens),
        varlen=varlen,
        max_seqlen_q=max_q if max_q is not None else max(max(q_lens), 1),
        max_seqlen_k=max_k if max_k is not None else max(max(k_lens), 1),
        total_q=int(cu_q[-1]),
        total_k=int(cu_k[-1]),
        num_heads_q=hq,
        num_heads_kv=hkv,
        head_dim_qk=head_dim,
        head_dim_v=head_dim,
        mask_heads=hmask,
        nfunc=nfunc,
        dtype=dtype,
        device=torch.device(device),
        cu_seqlens_q=cu_q,
        cu_seqlens_k=cu_k,
    )


def sample_endpoints(kind: str, q_len: int, k_len: int, nfunc: int, gen: torch.Generator) -> torch.Tensor:
    """int64 [nfunc, q_len], sorted, in [0, k_len]."""
    i = torch.arange(q_len)
    diag = i + k_len - q_len
    vals = torch.full((nfunc, q_len), k_len, dtype=torch.int64)
    if kind == "random":
        vals = torch.randint(0, k_len + 1, (nfunc, q_len), generator=gen)
    elif kind == "causal" or (kind == "window" and nfunc == 1):
        vals[0] = (diag + 1).clamp(0, k_len)
    elif kind == "window":
        w = int(torch.randint(1, 300, (1,), generator=gen))
        vals[0] = 0
        vals[1] = (diag - w + 1).clamp(0, k_len)
        vals[2] = (diag + 1).clamp(0, k_len)
    elif kind == "document":
        bounds = torch.randint(0, k_len + 1, (8,), generator=gen).sort().values
        bounds[0] = 0
        pos = diag.clamp(0, max(k_len - 1, 0))
        end = (diag + 1).clamp(0, k_len)
        start = torch.minimum(bounds[torch.searchsorted(bounds, pos, right=True) - 1], end)
        if nfunc >= 3:
            vals[0], vals[1], vals[2] = 0, start, end
        else:
            vals[0] = end
    elif kind == "adjacent":
        step = int(torch.randint(1, 5, (1,), generator=gen)) * 16
        vals = (torch.randint(0, k_len // step + 2, (nfunc, 1), generator=gen) * step).clamp(0, k_len)
        vals = vals.sort(0).values
        join = torch.rand((nfunc,), generator=gen) < 0.5
        for j in range(1, nfunc, 2):
            if join[j]:
                vals[j] = vals[j - 1]
        vals = vals.expand(nfunc, q_len)
    elif kind == "empty":
        vals.zero_()
    return vals.sort(0).values


def make_mask(q_lens, k_lens, hmask: int, nfunc: int, seed: int, kinds=KINDS, device="cpu") -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    heads = []
    for _ in range(hmask):
        per_sample = []
        for ql, kl in zip(q_lens, k_lens, strict=True):
            kind = kinds[int(torch.randint(0, len(kinds), (1,), generator=gen))]
            per_sample.append(sample_endpoints(kind, ql, kl, nfunc, gen))
        heads.append(torch.cat(per_sample, 1) if per_sample else torch.zeros(nfunc, 0, dtype=torch.int64))
    return torch.stack(heads).to(torch.int32).contiguous().to(device)


def view_config(layout: PayloadLayout, direction: str, *, pack_gqa: bool = False, qpk: int = 1) -> ViewConfig:
    signature = PlanSignature(
        arch_family="test",
        direction=direction,
        kernel_family="planner-test",
        topology=Topology(
            tile_m=layout.tile_m, tile_n=layout.tile_n, pack_gqa=pack_gqa, qhead_per_kvhead=qpk
        ),
        mma_layout="none",
        payload=layout.spec,
        scheduler_layout="k-major" if direction == "backward" else "plan-fwd-work-desc-v1",
        dq_order_format="rank_int32" if direction == "backward" else "none",
    )
    return ViewConfig(signature, layout)


def row_major(tile_m: int, tile_n: int) -> PayloadLayout:
    return RowMajorLayout(tile_m, tile_n)


def assert_plans_equal(ref: MaskPlan, got: MaskPlan) -> None:
    """Every tensor of every view (dtype, shape, values), its recorded longest row and the
    allocation header."""
    assert got.metadata["allocation_header"] == ref.metadata["allocation_header"]
    assert got.roles == ref.roles
    for role in ref.roles:
        rv, gv = ref.view(role), got.view(role)
        assert gv.longest_row == rv.longest_row, f"{role}: longest_row {gv.longest_row} vs {rv.longest_row}"
        for name in VIEW_TENSORS:
            a, b = rv.tensors.get(name), gv.tensors.get(name)
            if a is None or b is None:
                assert a is None and b is None, f"{role}.{name}: present in only one plan"
                continue
            assert a.dtype == b.dtype, f"{role}.{name}: dtype {a.dtype} vs {b.dtype}"
            assert tuple(a.shape) == tuple(b.shape), (
                f"{role}.{name}: shape {tuple(a.shape)} vs {tuple(b.shape)}"
            )
            b = b.to(a.device)
            if not torch.equal(a, b):
                where = (a != b).nonzero()[:5]
                raise AssertionError(
                    f"{role}.{name} differs at {where.tolist()}: ref {a[tuple(where.T)].tolist()}, "
                    f"got {b[tuple(where.T)].tolist()}"
                )
