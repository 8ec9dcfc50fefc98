"""A plan view's tensors checked against the ABI of :mod:`maskplan_core.plan`.

Two depths, because a kernel trusts what it reads (an index past its sample is a read of another
sample's keys, or out of bounds):

- :func:`check_structure` runs whenever a :class:`~maskplan_core.plan.PlanView` is made: which
  tensors, their dtype, device and shapes against each other, the geometry and the payload layout.
  Host metadata only: no device read, so a plan build pays a few microseconds.
- :func:`check_values` (:meth:`PlanView.validate`) reads the tensors: offsets, index ranges and
  order, partial and full lists disjoint, payload bits and full tiles within their sample, the
  varlen descriptor, the forward task queue and the backward dQ ranks. ``to_dense`` runs it first,
  ``block_map`` all of it but the payload bits. A planner of one's own (or a loader of stored
  tensors) calls it once per plan.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, NamedTuple

import torch

from .consumer import same_device
from .errors import InputValueError

if TYPE_CHECKING:
    from .plan import BlockEntries, PlanView

CSR_TENSORS = (
    "mask_block_cnt",
    "mask_block_offset",
    "mask_block_idx",
    "mask_block_masks",
    "full_block_cnt",
    "full_block_offset",
    "full_block_idx",
)
ROLE_TENSORS = {"forward": ("fwd_work_desc",), "backward": ("dq_write_order", "dq_write_order_full")}
#: tile elements decoded at a time (each becomes a few bool / int64 temporaries)
TILE_CHUNK_ELEMENTS = 1 << 22


def _refuse(view: PlanView, what: str) -> InputValueError:
    return InputValueError(f"the {view.role} view's {what}")


def fixed_blocks(seqlen_q: int, seqlen_k: int, block: tuple[int, int], outer: str) -> tuple[int, int]:
    """``(outer, inner)`` blocks of every sample of a fixed-length view: ``(Q, K)`` blocks of a
    Q-major view (``outer="q"``), ``(K, Q)`` of a K2Q one."""
    q_blocks, k_blocks = -(-seqlen_q // block[0]), -(-seqlen_k // block[1])
    return (q_blocks, k_blocks) if outer == "q" else (k_blocks, q_blocks)


def check_structure(view: PlanView) -> None:
    """Raise :class:`InputValueError`, naming the view and tensor, unless ``view`` holds exactly the
    tensors of its role (``sequence_desc`` iff varlen), contiguous int32 on the geometry's device,
    shaped as the ABI says for its geometry and payload layout."""
    g = view.geometry
    present = {name: t for name, t in view.tensors.items() if t is not None}
    expected = (*CSR_TENSORS, *ROLE_TENSORS[view.role], *(("sequence_desc",) if g.varlen else ()))
    missing = [name for name in expected if name not in present]
    if missing:
        raise _refuse(view, f"tensors lack {', '.join(missing)}")
    extra = sorted(set(present) - set(expected))
    if extra:
        why = (
            " (a fixed-length view's descriptor is derived, never stored)"
            if extra == ["sequence_desc"]
            else ""
        )
        raise _refuse(
            view, f"tensors include {', '.join(extra)}, which a {view.role} view does not hold{why}"
        )
    for name, t in present.items():
        if not isinstance(t, torch.Tensor) or t.dtype != torch.int32 or not same_device(t.device, g.device):
            got = f"{t.dtype} on {t.device}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise _refuse(view, f"{name} is {got}; the ABI holds int32 tensors on the plan's {g.device}")

    def shaped(name: str, shape: tuple[int, ...]) -> None:
        if tuple(present[name].shape) != shape:
            raise _refuse(view, f"{name} has shape {tuple(present[name].shape)}, expected {shape}")

    cnt = present["mask_block_cnt"]
    if cnt.dim() != 2 or cnt.shape[0] != g.mask_heads:
        raise _refuse(
            view, f"mask_block_cnt has shape {tuple(cnt.shape)}, expected [Hmask={g.mask_heads}, rows]"
        )
    rows = cnt.shape[1]
    if not g.varlen:
        outer_blocks, _ = fixed_blocks(g.max_seqlen_q, g.max_seqlen_k, view.block_size, view.outer)
        if rows != g.batch * outer_blocks:
            raise _refuse(
                view, f"CSR rows are {rows}; B x {view.outer.upper()} blocks is {g.batch * outer_blocks}"
            )
    for name in ("mask_block_offset", "full_block_cnt", "full_block_offset"):
        shaped(name, (g.mask_heads, rows))
    for name in ("mask_block_idx", "full_block_idx"):
        if present[name].dim() != 1:
            raise _refuse(view, f"{name} has shape {tuple(present[name].shape)}; it is one-dimensional")
    layout = view.layout
    nnz = present["mask_block_idx"].numel()
    shaped("mask_block_masks", (nnz, layout.subtiles, layout.groups, layout.words_per_group))
    if g.varlen:
        shaped("sequence_desc", (g.batch, 8))
    if view.role == "forward":
        work = present["fwd_work_desc"]
        if work.dim() != 2 or work.shape[1] != 4:
            raise _refuse(view, f"fwd_work_desc has shape {tuple(work.shape)}, expected [tasks, 4]")
    else:
        shaped("dq_write_order", (nnz,))
        shaped("dq_write_order_full", (present["full_block_idx"].numel(),))
    for name, t in present.items():
        if not t.is_contiguous():  # kernels read the tensors through their base address alone
            raise _refuse(
                view, f"{name} has strides {t.stride()}; the ABI holds contiguous tensors (.contiguous())"
            )


def check_values(view: PlanView, *, payloads: bool = True) -> None:
    """Raise :class:`InputValueError`, naming what is wrong, unless the view's tensors hold what the
    ABI says (:mod:`maskplan_core.plan`); reads every tensor (a device sync on CUDA). ``payloads``
    False leaves the partial tiles' bits unchecked: what reads only the lists (a block map) skips
    decoding every payload, most of the work on a plan of many partial tiles."""
    from .reference.block_geometry import block_geometry
    from .reference.csr import exclusive_offsets

    g, t = view.geometry, view.tensors
    _check_geometry(view)
    geom = block_geometry(g, *view.block_size)
    expected_desc = geom.sequence_desc(view.outer)
    if g.varlen and not torch.equal(view.sequence_desc(), expected_desc):
        raise _refuse(view, "sequence_desc is not its geometry's (cu_seqlens_q/k and the view's block)")
    n_rows = geom.n_q_rows if view.outer == "q" else geom.n_k_rows
    if t["mask_block_cnt"].shape[1] != n_rows:
        raise _refuse(view, f"CSR rows are {t['mask_block_cnt'].shape[1]}; its samples have {n_rows}")
    keys, entries = {}, {}
    for kind, prefix in (("partial", "mask_block"), ("full", "full_block")):
        cnt, offset, idx = (t[f"{prefix}_{name}"].to(torch.int64) for name in ("cnt", "offset", "idx"))
        if bool((cnt < 0).any()):
            raise _refuse(view, f"{prefix}_cnt has a negative count")
        if int(cnt.sum()) != idx.numel():
            raise _refuse(
                view, f"{prefix}_cnt sums to {int(cnt.sum())}; {prefix}_idx has {idx.numel()} entries"
            )
        if not torch.equal(offset, exclusive_offsets(cnt).to(torch.int64)):
            raise _refuse(
                view, f"{prefix}_offset is not the exclusive scan of {prefix}_cnt in (head, row) order"
            )
        e = entries[kind] = view.entries(kind)
        if bool(((idx < 0) | (idx >= expected_desc[e.batch, 6])).any()):
            inner = "K" if view.outer == "q" else "Q"
            raise _refuse(view, f"{prefix}_idx has a block index outside its sample's {inner} blocks")
        flat = cnt.reshape(-1)
        row = torch.repeat_interleave(
            torch.arange(flat.numel(), device=flat.device), flat, output_size=idx.numel()
        )
        if bool(((row[1:] == row[:-1]) & (idx[1:] <= idx[:-1])).any()):
            raise _refuse(view, f"{prefix}_idx is not ascending within a row")
        keys[kind] = row * (geom.max_q_blocks + geom.max_k_blocks + 1) + idx
        if kind == "full":  # a full tile lies wholly inside its sample
            tm, tn = view.block_size
            inside = ((e.q_block + 1) * tm <= geom.q_lens[e.batch]) & (
                (e.k_block + 1) * tn <= geom.k_lens[e.batch]
            )
            if not bool(inside.all()):
                raise _refuse(view, "full_block_idx lists a tile reaching past its sample's q_len / k_len")
            continue
        if not payloads:
            continue
        layout_bits = view.layout.pack(torch.ones(1, *view.block_size, dtype=torch.bool, device=idx.device))
        if bool((t["mask_block_masks"] & ~layout_bits).any()):
            raise _refuse(view, "mask_block_masks sets a padding bit (one no tile element maps to)")
        for chunk in entry_tiles(view, e):
            if bool((chunk.tiles & ~chunk.in_bounds).any()):
                raise _refuse(view, "mask_block_masks sets a bit past its sample's q_len / k_len")
            # spec 4.3: a partial tile has a visible element and is not a full one (the classes are
            # disjoint, and a kernel's partial path costs a payload load and a bit-select)
            bits = chunk.tiles.flatten(1)
            if not bool(bits.any(1).all()):
                raise _refuse(
                    view, "mask_block_masks has an entry with no bit set (an empty tile is in neither list)"
                )
            if bool(bits.all(1).any()):
                raise _refuse(
                    view, "mask_block_masks has an in-bounds entry with every bit set (a full tile belongs "
                    "in the full list)"
                )  # fmt: skip
    if torch.isin(keys["partial"], keys["full"]).any():
        raise _refuse(view, "partial and full lists share a tile")
    if view.longest_row is not None:
        longest = int((t["mask_block_cnt"].to(torch.int64) + t["full_block_cnt"]).max()) if n_rows else 0
        if longest != view.longest_row:
            raise _refuse(view, f"longest_row is {view.longest_row}; its longest CSR row has {longest}")
    if view.role == "forward":
        _check_work(view, geom)
    else:
        _check_dq_ranks(view, geom, entries.values())


def _check_geometry(view: PlanView) -> None:
    """The view's geometry agrees with itself: varlen prefixes start at 0, end at ``total_q/k``,
    do not decrease and stay within ``max_seqlen_q/k`` (a kernel sizes its workspace by them);
    fixed-length ones are ``b * S`` with ``total = B * S``."""
    from .error_flags import SEQLEN_FLAGS, raise_for_error_flags
    from .reference.block_geometry import geometry_error_flags

    g = view.geometry
    for name, cu in (("cu_seqlens_q", g.cu_seqlens_q), ("cu_seqlens_k", g.cu_seqlens_k)):
        shape_ok = cu.dtype == torch.int32 and tuple(cu.shape) == (g.batch + 1,)
        if not shape_ok or not same_device(cu.device, g.device):
            raise _refuse(
                view, f"geometry's {name} is {cu.dtype} {tuple(cu.shape)} on {cu.device}, not int32 "
                f"[B + 1 = {g.batch + 1}] on {g.device}"
            )  # fmt: skip
    if g.varlen:
        raise_for_error_flags(geometry_error_flags(g) & SEQLEN_FLAGS, None, g)
        return
    steps = torch.arange(g.batch + 1, dtype=torch.int32, device=g.cu_seqlens_q.device)
    fixed = (
        g.total_q == g.batch * g.max_seqlen_q
        and g.total_k == g.batch * g.max_seqlen_k
        and torch.equal(g.cu_seqlens_q, steps * g.max_seqlen_q)
        and torch.equal(g.cu_seqlens_k, steps * g.max_seqlen_k)
    )
    if not fixed:
        raise _refuse(view, f"fixed-length geometry is not B samples of S rows ({g.describe()})")


class TileChunk(NamedTuple):
    """A chunk of a view's entries (:func:`entry_tiles`)."""

    entries: slice  # of the BlockEntries
    q_local: torch.Tensor  # [n, tile_m]: each tile row's sample-local query position
    k_local: torch.Tensor  # [n, tile_n]: each tile column's sample-local key position
    tiles: torch.Tensor  # bool [n, tile_m, tile_n]: the payloads (a full entry's: in_bounds)
    in_bounds: torch.Tensor  # bool [n, tile_m, tile_n]: the element lies within its sample


def entry_tiles(view: PlanView, e: BlockEntries) -> Iterator[TileChunk]:
    """``e``'s tiles a chunk at a time (about ``TILE_CHUNK_ELEMENTS`` elements)."""
    tm, tn = view.block_size
    desc = view.sequence_desc().to(torch.int64)
    t, u = torch.arange(tm, device=desc.device), torch.arange(tn, device=desc.device)
    step = max(1, TILE_CHUNK_ELEMENTS // (tm * tn))
    for c in range(0, e.head.numel(), step):
        sl = slice(c, c + step)
        b = e.batch[sl]
        q_local, k_local = e.q_block[sl, None] * tm + t, e.k_block[sl, None] * tn + u
        in_bounds = (q_local < desc[b, 2, None])[:, :, None] & (k_local < desc[b, 3, None])[:, None, :]
        tiles = in_bounds if e.payload is None else view.layout.unpack(e.payload[sl])
        yield TileChunk(sl, q_local, k_local, tiles, in_bounds)


def _check_work(view: PlanView, geom) -> None:
    """``fwd_work_desc`` holds each ``(m_block, head, batch, q_valid_rows)`` task once."""
    g, tm = view.geometry, view.block_size[0]
    heads = g.num_heads_kv if view.signature.topology.pack_gqa else g.num_heads_q
    row_b, row_m = geom.q_row_owner()
    head = torch.arange(heads, device=row_b.device).repeat_interleave(row_b.numel())
    b, m = row_b.repeat(heads), row_m.repeat(heads)
    valid = (geom.q_lens[b] - m * tm).clamp(max=tm)
    expected = torch.stack([m, head, b, valid], 1)
    work = view.tensors["fwd_work_desc"].to(torch.int64)
    if work.shape[0] != expected.shape[0] or not torch.equal(_sorted_rows(work), _sorted_rows(expected)):
        raise _refuse(
            view, "fwd_work_desc is not one (m_block, head, batch, q_valid_rows) task per Q block of a "
            "sample and scheduled head"
        )  # fmt: skip


def _sorted_rows(x: torch.Tensor) -> torch.Tensor:
    for col in reversed(range(x.shape[1])):  # stable sorts, last key first
        x = x[torch.argsort(x[:, col], stable=True)]
    return x


def _check_dq_ranks(view: PlanView, geom, parts: Iterable[BlockEntries]) -> None:
    """``dq_write_order(_full)``: each entry's K block rank among the K blocks reaching its Q block
    (``parts``: the view's partial then full entries)."""
    parts = list(parts)
    head, batch, q_block, k_block = (
        torch.cat([getattr(e, f) for e in parts]) for f in ("head", "batch", "q_block", "k_block")
    )
    group = (head * geom.batch + batch) * (geom.max_q_blocks + 1) + q_block
    key = group * (geom.max_k_blocks + 1) + k_block
    order = torch.argsort(key, stable=True)
    sorted_group = group[order]
    position = torch.arange(order.numel(), device=order.device)
    first = torch.ones_like(sorted_group, dtype=torch.bool)
    first[1:] = sorted_group[1:] != sorted_group[:-1]
    start = torch.cummax(torch.where(first, position, 0), 0).values
    rank = torch.empty_like(order)
    rank[order] = position - start
    stored = torch.cat([view.tensors["dq_write_order"], view.tensors["dq_write_order_full"]]).to(torch.int64)
    if not torch.equal(stored, rank):
        raise _refuse(
            view, "dq_write_order(_full) is not each entry's K block rank among those reaching its Q block"
        )
