"""``PlanView`` (one consumer's view) and ``MaskPlan`` (the immutable owner of views), spec 4.6-4.8, 8.

Sparse format of one view, for mask head ``h`` and outer plan row ``r`` (a Q block for the
``"forward"`` view, a K block for the K2Q ``"backward"`` view) of sample ``b``::

    sequence_desc[b] = (q_offset, k_offset, q_len, k_len, row_begin, row_count, inner_blocks, 0)
    partial entries: mask_block_idx[mask_block_offset[h, r] + i],  i < mask_block_cnt[h, r]
                     with payload mask_block_masks[mask_block_offset[h, r] + i]
    full entries:    full_block_idx[full_block_offset[h, r] + i],  i < full_block_cnt[h, r]

Every tensor is contiguous int32 on the plan's device (uint32 bit patterns stored as int32 in the
payload)::

    mask_block_cnt / _offset, full_block_cnt / _offset   [Hmask, rows]   rows: the view's outer blocks
    mask_block_idx, full_block_idx                       [nnz]           of every sample, in order
    mask_block_masks        [partial nnz, subtiles, groups, words_per_group]   (the view's layout)
    sequence_desc           [B, 8]          varlen views only
    fwd_work_desc           [tasks, 4]      forward view only
    dq_write_order(_full)   [partial (full) nnz]                               backward view only

``maskplan_core.view_check`` checks them: their structure whenever a view is made, their values
in :meth:`PlanView.validate`.

Offsets are exclusive scans of the counts over ``(h, r)``, shaped like them (``[Hmask, rows]``):
unlike spec 4.5's ``offset[i + 1] = offset[i] + count[i]`` there is no closing total, so a row's
range ends at ``offset + count``, never at the next row's offset (a kernel written for cuDNN's
``Hmask * rows + 1`` offsets reads one past the end on the last row).

The reconstruction loop below is the spec of the format (``to_dense`` runs it vectorised)::

    for h, r:                                     # outer block o = r - row_begin[b]
        for e in partial range of (h, r):         # inner block x = mask_block_idx[e]
            tile = layout.unpack(mask_block_masks[e])
            dense[h, q rows of (o or x), k cols of (x or o)] = tile
        for e in full range of (h, r):
            dense[h, q rows, k cols] = True       # a full tile is entirely in bounds

``sequence_desc`` (int32 ``[B, 8]``) is retained by varlen views only (spec 4.8); a fixed-length
view's descriptor is affine in ``b`` and follows from the geometry and the view's block, by the
formula of :func:`fixed_sequence_desc`. ``PlanView.sequence_desc()`` returns either.

What a kernel may rely on besides the loop above (the ABI a consumer's kernels read):

- Within a row's range, ``*_block_idx`` are sample-local inner block indices (K blocks of the
  forward view, Q blocks of the backward view), ascending.
- A payload's bits are 0 for every element past its sample's ``q_len`` / ``k_len``: inside a
  partial tile the predicate masks those scores. Their operands are still another sample's rows
  (or past ``total_q`` / ``total_k`` for the last sample): a kernel zeroes (or never loads) the
  K / V rows past ``k_len`` and the Q / dO rows past ``q_len`` it reads, so that a non-finite
  value there cannot reach this sample through a zero probability (0 x nan), and never stores
  rows past ``q_len`` / ``k_len``.
- ``fwd_work_desc`` (forward view), int32 ``[tasks, 4]``: one task ``(m_block, head, batch,
  q_valid_rows)`` per Q block of a sample and scheduled head, with or without visible blocks
  (those write ``O = 0``, ``LSE = -inf``). ``m_block`` is sample-local; ``head`` is the q head, or
  with ``pack_gqa`` the kv head whose q heads share the tile; ``q_valid_rows`` is the block's
  positions inside the sample (at most the view's ``tile_m``). A task reads plan row ``r =
  row_begin[batch] + m_block`` of mask head ``h = head`` where ``Hmask > 1``, else ``0`` (always
  with ``pack_gqa``), and K/V of kv head ``head // (Hq / Hkv)`` (``head`` with ``pack_gqa``).
  Kernels take tasks in queue order, which the reference fixes (``reference/schedule.py``: by L2
  section and cost, empty rows last).
- ``dq_write_order`` / ``dq_write_order_full`` (backward view), int32, one per partial / full
  entry ``e`` (K block ``j`` -> Q block ``i``): ``j``'s rank among all K blocks, partial or full,
  that reach Q block ``i``, ascending in ``j``. Deterministic dQ accumulation adds Q block ``i``'s
  contributions in rank order, so every run gives the same bits.
- The backward view has no work queue: a K-major worker takes a (K block row ``r``, kv head
  ``hk``) pair, reads K / V of ``hk`` once and walks the row for each of its ``G = Hq / Hkv`` q
  heads ``hq`` (their Q, dO, LSE), reading mask head ``h = hq`` where ``Hmask > 1``, else ``0``; so
  the ranks above order the adds into q head ``hq``'s dQ block ``i``: of one mask head, sample and
  Q block.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import os
import secrets
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from types import MappingProxyType

import torch

from .consumer import check_signature_fits, require_layout_tiles, same_device
from .errors import (
    InputTypeError,
    InputValueError,
    MissingBackwardViewError,
    PlanBindingError,
    PlanDtypeError,
    UnsupportedCallError,
    warn_caller,
)
from .geometry import PlanGeometry
from .payload import PayloadLayout
from .schema import HEADER_FIELDS, PlanSignature
from .validation import autocast_region_dtype, head_dim_contiguous, require_int, require_strided, write_count
from .view_check import CSR_TENSORS, ROLE_TENSORS, check_structure, check_values, entry_tiles, fixed_blocks

VIEW_TENSORS = (*CSR_TENSORS, "sequence_desc", *ROLE_TENSORS["forward"], *ROLE_TENSORS["backward"])
#: a to_dense() of this many bytes or more warns before it allocates them
DENSE_WARN_BYTES = 1 << 30


def fixed_sequence_desc(
    batch: int, seqlen_q: int, seqlen_k: int, block: tuple[int, int], outer: str, device=None
) -> torch.Tensor:
    """The ``sequence_desc`` int32 ``[B, 8]`` of a fixed-length view, which the plan does not retain.

    ``Sq, Sk`` are the common sequence lengths, ``(block_m, block_n)`` the view's block
    (``signature.topology.tile_m/tile_n``: with PackGQA ``tile_m`` counts Q positions). With
    ``q_blocks = ceil(Sq / block_m)``, ``k_blocks = ceil(Sk / block_n)`` and ``(outer, inner)`` =
    ``(q_blocks, k_blocks)`` for a Q-major view (``outer="q"``), ``(k_blocks, q_blocks)`` for a K2Q
    view (``outer="k"``)::

        sequence_desc[b] = (b * Sq, b * Sk, Sq, Sk, b * outer, outer, inner, 0)

    The attention kernels derive the same columns on the device
    (``maskplan_kernels.consumer_plan.desc_field``).
    """
    outer_blocks, inner_blocks = fixed_blocks(seqlen_q, seqlen_k, block, outer)
    b = torch.arange(batch, dtype=torch.int32, device=device)
    same = functools.partial(torch.full_like, b)  # one value for every sample
    cols = [b * seqlen_q, b * seqlen_k, same(seqlen_q), same(seqlen_k)]
    cols += [b * outer_blocks, same(outer_blocks), same(inner_blocks), same(0)]
    return torch.stack(cols, dim=1)


@dataclass(frozen=True)
class BlockEntries:
    """Decoded block list of one view: int64 ``head, batch, q_block, k_block`` per entry."""

    head: torch.Tensor
    batch: torch.Tensor
    q_block: torch.Tensor
    k_block: torch.Tensor
    payload: torch.Tensor | None  # int32 [n, subtiles, groups, words] for partial entries


@dataclass(frozen=True, eq=False)
class PlanView:
    """One consumer's tensors and the signature that says which consumer may read them."""

    role: str
    signature: PlanSignature
    layout: PayloadLayout
    geometry: PlanGeometry
    tensors: MappingProxyType = field(repr=False)  # read-only mapping; the tensors are plan storage
    #: entries (partial + full) of the longest CSR row over mask heads, as the planner read it back
    #: with its header (None: not recorded): a launch hint, derived from the tensors (``validate``)
    longest_row: int | None = None

    def __post_init__(self):
        # a consumer's view config must describe the view it makes: the runtime dispatches on the
        # signature alone, so a wrong direction or payload spec would let a kernel misread the tensors
        check_signature_fits(self.role, self.signature, self.geometry)
        if self.signature.payload != self.layout.spec:
            raise InputValueError(
                f"the {self.role} view's signature.payload ({self.signature.payload}) does not describe "
                f"the layout it is packed with ({self.layout.spec})"
            )
        require_layout_tiles(self.layout, self.signature.topology, f"the {self.role} view")
        if self.longest_row is not None and (type(self.longest_row) is not int or self.longest_row < 0):
            raise InputValueError(f"the {self.role} view's longest_row must be an int >= 0 or None")
        object.__setattr__(self, "tensors", MappingProxyType(dict(self.tensors)))
        check_structure(self)

    def validate(self) -> PlanView:
        """Read every tensor and raise :class:`InputValueError` unless they hold what the ABI says
        (:func:`maskplan_core.view_check.check_values`: offsets, index ranges and order, disjoint
        partial and full lists, payload bits within the sample, the varlen descriptor, the forward
        task queue, the dQ ranks, ``longest_row`` where recorded). Making a view checks only its
        tensors' structure; a planner or loader of one's own calls this once per plan. Returns the
        view."""
        check_values(self)
        return self

    def __reduce__(self):  # the read-only mapping does not pickle; the view is its six fields
        fields = (self.role, self.signature, self.layout, self.geometry, dict(self.tensors))
        return type(self), (*fields, self.longest_row)

    # Read-only, so a copy is the view itself (as a MaskPlan's): a consumer on another stream then
    # still waits for the plan's build (maskplan_core.plan_ready keeps the event per view)
    def __copy__(self):
        return self

    def __deepcopy__(self, memo):
        return self

    def __getattr__(self, name: str):
        if name in VIEW_TENSORS:
            return self.__dict__["tensors"].get(name)
        raise AttributeError(name)

    @property
    def block_size(self) -> tuple[int, int]:
        """(tile_m, tile_n): Q rows and K columns of one block."""
        t = self.signature.topology
        return t.tile_m, t.tile_n

    @property
    def outer(self) -> str:
        """Which axis the CSR rows run over: ``"q"`` (forward, Q2K) or ``"k"`` (backward, K2Q)."""
        return "q" if self.role == "forward" else "k"

    def sequence_desc(self) -> torch.Tensor:
        """int32 ``[B, 8]`` per-sample descriptor (module docstring): the retained tensor of a
        varlen view, :func:`fixed_sequence_desc` of a fixed-length one."""
        g = self.geometry
        if g.varlen:
            return self.tensors["sequence_desc"]
        return fixed_sequence_desc(
            g.batch, g.max_seqlen_q, g.max_seqlen_k, self.block_size, self.outer, g.device
        )

    def entries(self, kind: str) -> BlockEntries:
        """Decode the ``"partial"`` or ``"full"`` CSR into per-entry block coordinates."""
        if kind not in ("partial", "full"):
            raise InputValueError(f"kind must be 'partial' or 'full', got {kind!r}")
        prefix = "mask_block" if kind == "partial" else "full_block"
        cnt, idx = self.tensors[f"{prefix}_cnt"], self.tensors[f"{prefix}_idx"].to(torch.int64)
        hmask, rows = cnt.shape
        flat_row = torch.repeat_interleave(
            torch.arange(hmask * rows, device=cnt.device),
            cnt.reshape(-1).to(torch.int64),
            output_size=idx.numel(),
        )
        head, row = flat_row // rows, flat_row % rows
        desc = self.sequence_desc().to(torch.int64)
        batch = torch.searchsorted(desc[:, 4] + desc[:, 5], row, right=True)
        outer_block = row - desc[batch, 4]
        q_block, k_block = (outer_block, idx) if self.outer == "q" else (idx, outer_block)
        payload = self.tensors["mask_block_masks"] if kind == "partial" else None
        return BlockEntries(head, batch, q_block, k_block, payload)

    def block_map(self, sample: int = 0, head: int = 0) -> torch.Tensor:
        """The blocks of one batch sample and mask head as the planner classified them: int8
        ``[q_blocks, k_blocks]`` (Q block rows, whichever the view's major order), 0 empty,
        1 partial (a payload), 2 full. :meth:`block_map_text` draws it. Checks the view first, as
        :meth:`validate` does but for the payloads' bits, which it does not read."""
        check_values(self, payloads=False)
        g = self.geometry
        sample, head = require_int("sample", sample), require_int("head", head)
        if sample >= g.batch:
            raise InputValueError(f"sample={sample} is out of range for a batch of {g.batch}")
        if head >= g.mask_heads:
            raise InputValueError(f"head={head} is out of range for Hmask={g.mask_heads}")
        desc = self.sequence_desc()[sample].tolist()
        outer, inner = desc[5], desc[6]
        q_blocks, k_blocks = (outer, inner) if self.outer == "q" else (inner, outer)
        out = torch.zeros(q_blocks, k_blocks, dtype=torch.int8, device=g.device)
        for code, kind in ((1, "partial"), (2, "full")):
            e = self.entries(kind)
            mine = (e.batch == sample) & (e.head == head)
            out[e.q_block[mine], e.k_block[mine]] = code
        return out

    def block_map_text(
        self, sample: int = 0, head: int = 0, width: int | None = None, legend: bool = False
    ) -> str:
        """:meth:`block_map` as text, a line per Q block: ``#`` full, ``+`` partial, ``.`` empty. A
        full tile lies wholly inside its sample, so one reaching past the sample's end is ``+``
        even where every element inside the sample is visible.

        ``width`` (characters a line at most; None: a character per block, per ``tile_n / tile_m``
        Q blocks on a PackGQA view as below) draws a long sequence
        coarser: a character then stands for ``f x f`` blocks (``f`` the smallest factor that fits
        the K blocks in ``width``), ``#`` where all of them are full, ``.`` where all are empty,
        ``+`` otherwise. A PackGQA view's Q block is ``tile_m`` positions of every packed head: a
        character then stands for ``tile_n / tile_m`` times as many Q blocks, as many positions as
        keys, so a square of the mask stays square. A sample of no query rows or no keys gives one
        line saying so.

        ``legend=True`` puts lines first that say what is drawn: the view, sample and mask head and
        the map's blocks (:meth:`packing` on a PackGQA view), then what a character stands for
        (blocks and positions) and the symbols."""
        if not isinstance(legend, bool):
            raise InputTypeError(f"legend must be a bool, got {type(legend).__name__}")
        blocks = self.block_map(sample, head)
        if blocks.numel() == 0:  # a varlen sample without query rows or keys: nothing to draw
            return f"(sample {sample}: {blocks.shape[0]} Q blocks x {blocks.shape[1]} K blocks)"
        f = 1 if width is None else -(-blocks.shape[1] // require_int("width", width, minimum=1))
        tm, tn = self.block_size
        fq = f * max(1, tn // tm) if self.signature.topology.pack_gqa else f
        shape = blocks.shape
        if f > 1 or fq > 1:
            rows, cols = -(-blocks.shape[0] // fq) * fq, -(-blocks.shape[1] // f) * f
            cells = torch.full((rows, cols), -1, dtype=blocks.dtype, device=blocks.device)
            cells[: blocks.shape[0], : blocks.shape[1]] = blocks  # -1: past the map, neither
            cells = cells.view(rows // fq, fq, cols // f, f).transpose(1, 2).flatten(2)
            full, empty = (((cells == c) | (cells < 0)).all(-1) for c in (2, 0))
            blocks = torch.where(full, 2, torch.where(empty, 0, 1))
        drawn = ["".join(".+#"[c] for c in row) for row in blocks.tolist()]
        if not legend:
            return "\n".join(drawn)
        cover = "a block" if f == fq == 1 else f"{fq} x {f} blocks, {fq * tm} x {f * tn} positions"
        lines = [
            f"{self.role} view, sample {sample}, mask head {head}: {shape[0]} x {shape[1]} blocks (Q x K) "
            f"of {tm} x {tn}",
            self.packing(),
            f"a character: {cover}; # full, + partial, . empty",
        ]
        return "\n".join([line for line in lines if line] + drawn)

    def packing(self) -> str:
        """``""``, or what a PackGQA view's block is (its ``block`` counts positions)."""
        t = self.signature.topology
        if not t.pack_gqa:
            return ""
        positions = "position" if t.tile_m == 1 else "positions"
        return f"PackGQA: a block is {t.tile_m} {positions} x {t.qhead_per_kvhead} q heads"

    def to_dense(self) -> torch.Tensor:
        """bool ``[Hmask, total_q, Sk]``; varlen: ``Sk`` is the longest sample's k_len (not the
        declared ``max_seqlen_k``, which may be a loose bound), False past each sample's k_len.
        Runs :meth:`validate` first: a view that breaks the ABI is refused, not decoded. A tensor of
        ``DENSE_WARN_BYTES`` (1 GiB: S = 32768) or more warns before it is allocated."""
        g = self.validate().geometry
        desc = self.sequence_desc().to(torch.int64)
        sk = int(desc[:, 3].max()) if g.varlen else g.max_seqlen_k
        size = g.mask_heads * g.total_q * sk
        if size >= DENSE_WARN_BYTES:
            warn_caller(
                f"to_dense() allocates a bool [{g.mask_heads}, {g.total_q}, {sk}] tensor ({size / 2**30:.1f} "
                "GiB); block_map() / block_map_text() show the view's blocks without it"
            )
        dense = torch.zeros(g.mask_heads, g.total_q, sk, dtype=torch.bool, device=g.device)
        for kind in ("partial", "full"):
            e = self.entries(kind)
            for chunk in entry_tiles(self, e):
                head, rows = e.head[chunk.entries], desc[e.batch[chunk.entries], 0, None] + chunk.q_local
                # tiles are disjoint, so one inside its sample is written whole (6x faster than a
                # scatter of its set elements on causal masks); one reaching past its sample's end
                # would write there, into the next sample's rows: only its set elements are
                whole = chunk.in_bounds.flatten(1).all(1)
                dense[head[whole, None, None], rows[whole, :, None], chunk.k_local[whole, None, :]] = (
                    chunk.tiles[whole]
                )
                n, r, k = chunk.tiles[~whole].nonzero(as_tuple=True)
                dense[head[~whole][n], rows[~whole][n, r], chunk.k_local[~whole][n, k]] = True
        return dense

    def nbytes(self) -> int:
        """Bytes the view's tensors hold."""
        return sum(t.numel() * t.element_size() for t in self.tensors.values() if t is not None)

    def stats(self) -> dict:
        """The view's blocks: ``rows``, its plan rows per mask head (Q blocks of every sample in a
        forward view, K blocks in a backward one); ``block`` (tile_m, tile_n); ``partial``, ``full``
        and ``empty``, blocks summed over every sample and mask head; ``density``, the share a
        kernel visits ((partial + full) / all); ``visible``, the share of the elements of every
        sample and mask head the mask shows (against ``density``: how much of the visited tiles'
        work is masked out); ``bytes``, the view's tensors."""
        g = self.geometry
        desc = self.sequence_desc().to(torch.int64)
        pairs = int((desc[:, 5] * desc[:, 6]).sum()) * g.mask_heads
        partial = int(self.tensors["mask_block_idx"].numel())
        full = int(self.tensors["full_block_idx"].numel())
        q_lens, k_lens = (torch.diff(cu.to(torch.int64)) for cu in (g.cu_seqlens_q, g.cu_seqlens_k))
        elements = int((q_lens * k_lens).sum()) * g.mask_heads
        # a full block is whole inside its sample; a partial one's bits past its sample are 0 (ABI)
        shown = _popcount(self.tensors["mask_block_masks"]) + full * self.block_size[0] * self.block_size[1]
        return {
            "rows": int(self.tensors["mask_block_cnt"].shape[1]),
            "block": self.block_size,
            "partial": partial,
            "full": full,
            "empty": pairs - partial - full,
            "density": (partial + full) / pairs if pairs else 0.0,
            "visible": shown / elements if elements else 0.0,
            "bytes": self.nbytes(),
        }

    def __repr__(self) -> str:
        s, packing = self.stats(), self.packing()
        return (
            f"PlanView({self.role}, {self.signature.arch_family}/{self.signature.kernel_family}, "
            f"block {s['block'][0]}x{s['block'][1]}, {self.outer.upper()} rows={s['rows']}, "
            f"partial={s['partial']}, "
            f"full={s['full']}, empty={s['empty']}, density={s['density']:.3f}, "
            f"visible={s['visible']:.3f}, {s['bytes']} bytes"
            f"{', ' + packing if packing else ''})"
        )


#: payload words counted at a time (their int64 copies: 128 MiB)
_POPCOUNT_WORDS = 1 << 24


def _popcount(words: torch.Tensor) -> int:
    """Set bits of the 32-bit ``words`` (SWAR in int64: torch has no popcount), a block at a time."""
    flat, total = words.reshape(-1), 0
    for start in range(0, flat.numel(), _POPCOUNT_WORDS):
        x = flat[start : start + _POPCOUNT_WORDS].to(torch.int64) & 0xFFFFFFFF
        x = x - ((x >> 1) & 0x55555555)
        x = (x & 0x33333333) + ((x >> 2) & 0x33333333)
        x = (x + (x >> 4)) & 0x0F0F0F0F
        total += int((((x * 0x01010101) & 0xFFFFFFFF) >> 24).sum())
    return total


#: handle -> live plan. Weak values: the registry never keeps a plan alive.
_LIVE_PLANS: weakref.WeakValueDictionary[int, MaskPlan] = weakref.WeakValueDictionary()


def _handle_counter() -> Iterator[int]:
    """Handles of this process: a random 31-bit prefix above a count. A handle that reaches another
    process (a ``torch.export``ed graph holds it as a constant) then names no plan there, and is
    refused (:func:`plan_for_handle`), rather than the other process's plan of the same count."""
    return itertools.count((secrets.randbits(31) << 32) + 1)


_NEXT_HANDLE = _handle_counter()


def _new_handles_after_fork() -> None:  # a forked child must not repeat its parent's handles
    global _NEXT_HANDLE
    _NEXT_HANDLE = _handle_counter()


os.register_at_fork(after_in_child=_new_handles_after_fork)


def plan_for_handle(handle: int) -> MaskPlan:
    """The live plan whose :attr:`MaskPlan.handle` is ``handle`` (custom ops carry it, not the plan)."""
    plan = _LIVE_PLANS.get(int(handle))
    if plan is None:
        raise InputValueError(
            f"no live MaskPlan has handle {handle}: the plan was garbage-collected (or built in another "
            "process). A torch.compile'd call carries only the plan's handle: keep a reference to the "
            "plan while compiled calls use it. A training forward keeps its plan for the backward with "
            "the LSE it saves, unless a saved-tensor hook (e.g. torch.autograd.graph.save_on_cpu) "
            "replaces that LSE, or activation checkpointing inside the compiled code "
            "(torch.utils.checkpoint) recomputes the forward in the backward: then keep the reference "
            "until the backward has run (selective checkpointing around compiled code that builds its "
            "plan: build the plan outside and pass it in)"
        )
    return plan


def _plan_storage(
    handle: torch.Tensor, g: PlanGeometry, views: dict[str, PlanView]
) -> tuple[tuple[str, torch.Tensor], ...]:
    """``(name, tensor)`` of every tensor a plan hands out read-only: its handle tensor, its sample
    prefixes and each view's tensors (spec 8: versioned binding)."""
    return (
        ("handle_tensor", handle),
        ("geometry.cu_seqlens_q", g.cu_seqlens_q),
        ("geometry.cu_seqlens_k", g.cu_seqlens_k),
        *(
            (f"view({role!r}).{name}", t)
            for role, v in views.items()
            for name, t in v.tensors.items()
            if t is not None
        ),
    )


def _content_hash(g: PlanGeometry, views: dict[str, PlanView], header: tuple[int, ...], consumer: str) -> int:
    """:attr:`MaskPlan.fingerprint`: host values alone (no device read). Not the endpoint count: one
    mask given with more endpoints per row than it needs (``from_mask_mod`` pads every row to the
    longest's) is planned to the same tensors."""
    skipped = ("cu_seqlens_q", "cu_seqlens_k", "nfunc")
    scalars = tuple(getattr(g, f.name) for f in dataclasses.fields(g) if f.name not in skipped)
    return hash((consumer, header, scalars, tuple((role, v.signature) for role, v in views.items())))


def _check_header(header: tuple[int, ...], views: dict[str, PlanView]) -> None:
    """The planner's allocation header (``HEADER_FIELDS``): counts, no error flag (a builder raises
    the flags' error before it makes a plan), and the sizes of the views' tensors (zeros for a
    missing backward view); a varlen backward view's Q blocks are left unchecked (its samples'
    lengths are on the device)."""
    header = tuple(header)
    if len(header) != len(HEADER_FIELDS) or any(type(v) is not int or v < 0 for v in header):
        raise InputValueError(
            f"a MaskPlan's header holds {len(HEADER_FIELDS)} counts ({', '.join(HEADER_FIELDS)}), "
            f"got {header!r}"
        )
    if header[-1] != 0:
        raise InputValueError(
            f"a MaskPlan's header has error_flags 0x{header[-1]:x}: the planner refused the mask"
        )
    sizes = dict.fromkeys(HEADER_FIELDS[:-1], 0)
    for role, view in views.items():
        t = view.tensors
        sizes[f"{role}_partial_nnz"] = t["mask_block_idx"].numel()
        sizes[f"{role}_full_nnz"] = t["full_block_idx"].numel()
        sizes[f"{role}_{view.outer}_rows"] = t["mask_block_cnt"].shape[1]
    if "backward" in views:
        g, block = views["backward"].geometry, views["backward"].block_size
        if g.varlen:
            del sizes["backward_q_rows"]  # unchecked
        else:
            sizes["backward_q_rows"] = g.batch * fixed_blocks(g.max_seqlen_q, g.max_seqlen_k, block, "q")[0]
    wrong = [
        f"{name}={got} (its views: {sizes[name]})"
        for name, got in zip(HEADER_FIELDS, header, strict=True)
        if name in sizes and got != sizes[name]
    ]
    if wrong:
        raise InputValueError(f"a MaskPlan's header does not match its views: {', '.join(wrong)}")


def _check_views(geometry: PlanGeometry, views: dict[str, PlanView]) -> None:
    """A plan holds a forward view, and a backward one at most, each under its own role and bound
    to the plan's geometry (a consumer reads the plan's geometry with either view's tensors)."""
    if "forward" not in views:
        raise InputValueError(f"a MaskPlan needs a forward view; it was given {list(views)}")
    for role, view in views.items():
        if role not in ("forward", "backward") or view.role != role:
            raise InputValueError(
                f"a MaskPlan's views are 'forward' and 'backward'; {role!r} holds a {view.role} view"
            )
        if not _same_geometry(view.geometry, geometry):
            raise InputValueError(
                f"the {role} view was built for {view.geometry.describe()}, not for the plan's "
                f"{geometry.describe()}"
            )


def _same_geometry(a: PlanGeometry, b: PlanGeometry) -> bool:
    if a is b:
        return True

    def same(x, y) -> bool:
        if isinstance(x, torch.Tensor):
            return same_device(x.device, y.device) and torch.equal(x, y)
        return same_device(x, y) if isinstance(x, torch.device) else x == y

    return all(same(getattr(a, f.name), getattr(b, f.name)) for f in dataclasses.fields(a))


def _write_counts(storage: tuple[tuple[str, torch.Tensor], ...]) -> tuple[int, ...]:
    return tuple(write_count(t) for _, t in storage)


class PlanMetadata(dict):
    """:attr:`MaskPlan.metadata`: a dict (``consumer``, ``geometry``, ``allocation_header``,
    ``signatures``) whose attributes are the fields of ``cudnn.flex_attention``'s plan metadata
    (``mode`` ``"fixed"`` / ``"varlen"``, ``arch`` (the CUDA device's compute capability as
    ``10 * major + minor``, None off CUDA), ``device``, ``dtype``, ``batch_size``, ``total_q``,
    ``total_k``, ``max_seqlen_q``, ``max_seqlen_k``, ``num_q_heads``, ``num_kv_heads``, ``head_dim``,
    ``head_dim_v``, ``hmask``, ``nfunc``, ``pack_gqa``, ``has_backward``), so code written for cuDNN
    reads them unchanged. Each access builds a new one: writing to it changes nothing."""

    __slots__ = ("_fields",)

    def __init__(self, items: dict, fields: dict):
        super().__init__(items)
        self._fields = fields

    def __getattr__(self, name: str):
        fields = object.__getattribute__(self, "_fields")
        if name in fields:
            return fields[name]
        raise AttributeError(f"plan metadata has no field {name!r}; its fields are {', '.join(fields)}")

    def __dir__(self):
        return [*super().__dir__(), *self._fields]

    def __reduce__(self):  # every pickle protocol (the default one would drop the fields below 2)
        return PlanMetadata, (dict(self), self._fields)


class MaskPlan:
    """Opaque, read-only owner of a mask's plan views and the geometry they are bound to.

    Build with ``flexattn.create_mask_plan``, or with maskplan-core alone through a consumer's
    :meth:`~maskplan_core.Consumer.build_plan` (the views its ``resolve`` gives; the package README
    shows one). Q/K/V identity is not bound: new tensors of the
    same geometry, dtype and device reuse the plan. :attr:`handle` is a process-unique int that
    names the plan where only plain values may travel (``torch.library`` custom ops).
    """

    __slots__ = (
        "_geometry", "_views", "_header", "_handle", "_handle_tensor", "_fingerprint", "_storage",
        "_write_counts", "_consumer", "__weakref__",
    )  # fmt: skip

    def __init__(
        self, geometry: PlanGeometry, views: dict[str, PlanView], header: tuple[int, ...], consumer: str
    ):
        _check_views(geometry, views)
        _check_header(header, views)
        init = object.__setattr__  # __setattr__ refuses every write once _consumer is set
        init(self, "_geometry", geometry)
        init(self, "_views", dict(views))
        init(self, "_header", tuple(header))
        init(self, "_handle", next(_NEXT_HANDLE))
        with torch.inference_mode(False):  # a training step saves them for its backward: normal tensors
            init(self, "_handle_tensor", torch.tensor(self._handle, dtype=torch.int64, device="cpu"))
        init(self, "_fingerprint", None)  # made on first use: only same_mask_as reads it
        init(self, "_storage", _plan_storage(self._handle_tensor, geometry, self._views))
        init(self, "_write_counts", _write_counts(self._storage))
        init(self, "_consumer", consumer)
        _LIVE_PLANS[self._handle] = self

    def __setattr__(self, name, value):
        if hasattr(self, "_consumer"):
            raise AttributeError("MaskPlan is read-only; build a new plan instead")
        object.__setattr__(self, name, value)

    def __delattr__(self, name):
        raise AttributeError("MaskPlan is read-only; build a new plan instead")

    # Read-only, so a copy is the plan itself: copy.deepcopy of a model holding one (an EMA copy)
    # shares it. Pickling has no meaning: the views are device tensors named by a process-local handle.
    def __copy__(self):
        return self

    def __deepcopy__(self, memo):
        return self

    def __reduce_ex__(self, protocol):
        raise TypeError(
            "a MaskPlan cannot be pickled (torch.save, multiprocessing): it holds device tensors and "
            "a process-local handle; save the mask endpoints and rebuild it with create_mask_plan "
            "(flexattn) or a consumer's build_plan (maskplan-core)"
        )

    @property
    def geometry(self) -> PlanGeometry:
        """The problem the plan was built for (batch, lengths, heads, head dims, dtype, device)."""
        return self._geometry

    @property
    def consumer(self) -> str:
        """The name of the consumer whose kernels the views are laid out for (``"sm90"``, ...)."""
        return self._consumer

    @property
    def handle(self) -> int:
        """Process-unique id of this plan; :func:`plan_for_handle` maps it back while the plan lives."""
        return self._handle

    @property
    def handle_tensor(self) -> torch.Tensor:
        """:attr:`handle` as a 0-d int64 CPU tensor: how the plan crosses a ``torch.library`` custom
        op. A compiled graph takes it as an input, so one graph serves every plan of a geometry (an
        int would be a constant of the graph). Read-only by contract, like the plan."""
        return self._handle_tensor

    @property
    def fingerprint(self) -> int:
        """A hash of the plan's consumer, geometry (its ``nfunc`` aside), view signatures and block
        counts (this process's: never store it). Two masks of the same block counts share it:
        :meth:`same_mask_as` then compares their tensors."""
        if self._fingerprint is None:
            content = _content_hash(self._geometry, self._views, self._header, self._consumer)
            object.__setattr__(self, "_fingerprint", content)
        return self._fingerprint

    def same_mask_as(self, other: MaskPlan) -> bool:
        """Whether ``other`` can stand in for this plan: the same fingerprint (consumer, geometry,
        view signatures, block counts: :attr:`fingerprint`) and equal sample prefixes and view
        tensors, compared on their device with one read back (planners write every element, so
        equal masks give equal tensors). Plans of one mask with other views (no backward view, or
        PackGQA) differ. A backward told a recomputed forward ran with another plan asks this."""
        if other is self:
            return True
        if not isinstance(other, MaskPlan):
            raise InputTypeError(f"other must be a MaskPlan, got {type(other).__name__}")
        if self.fingerprint != other.fingerprint:
            return False
        mine, theirs = self._storage[1:], other._storage[1:]  # the handle tensors aside
        if [(name, t.shape) for name, t in mine] != [(name, t.shape) for name, t in theirs]:
            return False
        same = [(a == b).all() for (_, a), (_, b) in zip(mine, theirs, strict=True)]
        return bool(torch.stack(same).all())

    @property
    def has_backward(self) -> bool:
        """Whether the plan has a backward view (``build_backward=True``), so it can train."""
        return "backward" in self._views

    @property
    def roles(self) -> tuple[str, ...]:
        """The roles of the plan's views: ``("forward",)`` or ``("forward", "backward")``."""
        return tuple(self._views)

    def to(self, *args, **kwargs) -> MaskPlan:
        """The plan itself where ``to``'s device and dtype (``Tensor.to``'s arguments) are its own, as
        a batch mover (accelerate's ``send_to_device``, Lightning's) asks of everything with a
        ``to``; any other is refused: a plan's views are laid out for its device's consumer (a CPU
        plan is the reference consumer's, whose tiles a GPU kernel does not take), so it never moves."""
        device, dtype, _, _ = torch._C._nn._parse_to(*args, **kwargs)
        g = self._geometry
        if (device is None or same_device(device, g.device)) and dtype in (None, g.dtype):
            return self
        raise UnsupportedCallError(
            f"a MaskPlan does not move between devices or dtypes (this one is for {g.dtype} on "
            f"{g.device}): build the mask (the builders' device=q.device) and the plan with "
            "create_mask_plan from the tensors it will run on"
        )

    def view(self, role: str) -> PlanView:
        """The :class:`PlanView` of ``role`` (one of :attr:`roles`)."""
        if not isinstance(role, str):
            raise InputTypeError(f"role must be a view role name (one of {list(self._views)}), got {role!r}")
        if role not in self._views:
            if role == "backward":
                raise MissingBackwardViewError(
                    "this plan has no backward view; "
                    "rebuild it with create_mask_plan(..., build_backward=True) (flexattn), or with "
                    "Consumer.build_plan(..., backward=<the consumer's backward ViewConfig>) (maskplan-core)"
                )
            raise InputValueError(f"unknown view role {role!r}; this plan has {list(self._views)}")
        return self._views[role]

    @property
    def metadata(self) -> PlanMetadata:
        """The plan's facts as ``cudnn.flex_attention``'s plan metadata names them (:class:`PlanMetadata`)."""
        g = self._geometry
        items = {
            "consumer": self._consumer,
            "geometry": g.describe(),
            "allocation_header": dict(zip(HEADER_FIELDS, self._header, strict=True)),
            "signatures": {role: v.signature.model_dump() for role, v in self._views.items()},
        }
        arch = None
        if g.device.type == "cuda":
            major, minor = torch.cuda.get_device_capability(g.device)
            arch = 10 * major + minor
        fields = {
            "mode": "varlen" if g.varlen else "fixed",
            "arch": arch,
            "device": g.device,
            "dtype": g.dtype,
            "batch_size": g.batch,
            "total_q": g.total_q,
            "total_k": g.total_k,
            "max_seqlen_q": g.max_seqlen_q,
            "max_seqlen_k": g.max_seqlen_k,
            "num_q_heads": g.num_heads_q,
            "num_kv_heads": g.num_heads_kv,
            "head_dim": g.head_dim_qk,
            "head_dim_v": g.head_dim_v,
            "hmask": g.mask_heads,
            "nfunc": g.nfunc,
            "pack_gqa": self._views["forward"].signature.topology.pack_gqa,
            "has_backward": self.has_backward,
        }
        return PlanMetadata(items, fields)

    def debug_snapshot(self) -> dict[str, object]:
        """Clones (mutating them cannot affect the plan), under ``cudnn.flex_attention``'s keys:
        ``"metadata"`` (:attr:`metadata`); ``"forward"`` / ``"backward"``, a view's tensors by name
        (None for one the view lacks, ``cu_total_m_blocks`` always: this ABI has none), or None for
        a view the plan lacks; ``"dq"`` None (no dedicated dQ view); ``"cu_seqlens_q"`` /
        ``"cu_seqlens_k"``, a varlen plan's prefixes (None at fixed length, as cuDNN's). Besides,
        ``"geometry"``: both prefixes whatever the layout (a fixed-length plan's are ``b * S``)."""
        g = self._geometry

        def clones(view: PlanView | None) -> dict[str, torch.Tensor | None] | None:
            if view is None:
                return None
            tensors = {name: view.tensors.get(name) for name in VIEW_TENSORS}
            return {name: None if t is None else t.clone() for name, t in tensors.items()} | {
                "cu_total_m_blocks": None
            }

        return {
            "metadata": self.metadata,
            "forward": clones(self._views.get("forward")),
            "backward": clones(self._views.get("backward")),
            "dq": None,
            "cu_seqlens_q": g.cu_seqlens_q.clone() if g.varlen else None,
            "cu_seqlens_k": g.cu_seqlens_k.clone() if g.varlen else None,
            "geometry": {"cu_seqlens_q": g.cu_seqlens_q.clone(), "cu_seqlens_k": g.cu_seqlens_k.clone()},
        }

    def summary(self) -> str:
        """A line per view of :meth:`PlanView.stats` (``rows`` per mask head, labelled by what a row
        is: ``Q rows``, Q blocks, in the forward view; ``K rows``, K blocks, in the backward one;
        block counts over them all), under the plan's consumer and geometry."""
        lines = [f"MaskPlan for {self._consumer}: {self._geometry.describe()}"]
        for role, v in self._views.items():
            s, packing = v.stats(), v.packing()
            lines.append(
                f"  {role:<8} block {s['block'][0]}x{s['block'][1]}  {v.outer.upper()} rows {s['rows']:>6}  "
                f"partial {s['partial']:>7}  full {s['full']:>7}  empty {s['empty']:>7}  "
                f"density {s['density']:6.3f}  visible {s['visible']:6.3f}  {s['bytes'] / 1024:9.1f} KiB"
                + (f"  ({packing})" if packing else "")
            )
        return "\n".join(lines)

    def __repr__(self) -> str:
        return self.summary()

    def check_unwritten(self) -> None:
        """Raise ``PlanBindingError`` naming the tensor if one of the plan's own tensors (its handle
        tensor, ``geometry.cu_seqlens_q/k`` and its views' tensors) has been written in place since
        the plan was built (their version counters: about 0.2 us each, no device read). A consumer
        called directly runs it before its kernel reads the views (:meth:`check_binding` does, for
        the facade); ``PlanView.validate`` cannot see a write that leaves the tensors well formed.
        Writes under ``torch.inference_mode`` or through ``tensor.data`` go unseen."""
        counts = _write_counts(self._storage)
        if counts != self._write_counts:
            pairs = zip(self._storage, counts, self._write_counts, strict=True)
            name = next(n for (n, _), now, built in pairs if now != built)
            raise PlanBindingError(
                f"the plan's {name} was written in place after the plan was built; a plan is "
                "read-only: build a new one"
            )

    def check_binding(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, op_checks_sizes: bool = False
    ) -> None:
        """Raise ``PlanBindingError`` unless Q/K/V (tensors, else ``InputTypeError``) match the plan's
        geometry, dtype and device, and none of the plan's own tensors (its handle tensor,
        ``geometry.cu_seqlens_q/k`` and its views' tensors: plan storage, handed out read-only) has
        been written in place since it was built: such a write would move its samples, change its
        blocks or name another plan. The write check (:meth:`check_unwritten`) runs where the call
        is not traced (flexattn's op runs the whole check on each call's
        values; a compiled graph holding only the handle tensor does not see that tensor rewritten
        to name another plan). ``op_checks_sizes``: traced by ``torch.compile``, leave the sizes
        (not the rank) to the op the traced code calls, which checks them on each call's values
        (flexattn's ``flex_attn_func``: ``flexattn.ops``); compared here, each is a guard
        pinning q's sizes to those of a plan Dynamo holds as a constant (a module attribute, a
        global), a graph per shape. Tensors made under ``torch.inference_mode`` keep no counter,
        so a write there, under inference mode too, goes unseen; so does a write through
        ``tensor.data``, which torch does not count."""
        g = self._geometry
        compiling = torch.compiler.is_compiling()
        if not compiling:
            self.check_unwritten()
        if g.varlen:
            expect = {
                "q": (g.total_q, g.num_heads_q, g.head_dim_qk),
                "k": (g.total_k, g.num_heads_kv, g.head_dim_qk),
                "v": (g.total_k, g.num_heads_kv, g.head_dim_v),
            }
        else:
            bq, bk = (g.batch, g.max_seqlen_q), (g.batch, g.max_seqlen_k)
            expect = {
                "q": (*bq, g.num_heads_q, g.head_dim_qk),
                "k": (*bk, g.num_heads_kv, g.head_dim_qk),
                "v": (*bk, g.num_heads_kv, g.head_dim_v),
            }
        sizes = not (op_checks_sizes and compiling)
        for name, t in (("q", q), ("k", k), ("v", v)):
            require_strided(name, t)
            if t.dim() != len(expect[name]) or (sizes and tuple(t.shape) != expect[name]):
                if compiling:  # the sizes may be symbolic: no string can show them
                    raise PlanBindingError(
                        f"{name} has another shape than the plan was built for (an eager call shows both)"
                    )
                bhsd = not g.varlen and t.dim() == 4 and tuple(t.transpose(1, 2).shape) == expect[name]
                hint = (
                    f"; {name} looks like [B, H, S, D] (SDPA's layout): pass {name}.transpose(1, 2)"
                    if bhsd
                    else "; a plan is bound to its batch's shapes: build one for these tensors"
                )
                raise PlanBindingError(
                    f"{name} has shape {tuple(t.shape)} but the plan was built for {expect[name]} "
                    f"({g.describe()}){hint}"
                )
            if t.device != g.device:  # before the dtype: a CPU prototype's plan meets GPU tensors
                raise PlanBindingError(
                    f"{name} is on {t.device} but the plan was built on {g.device}: a plan does not move "
                    f"between devices; build the mask (the builders' device=) and the plan from tensors "
                    f"on {t.device}"
                )
            if t.dtype != g.dtype:
                dtypes = [getattr(x, "dtype", None) for x in (q, k, v)]
                # activations come out of autocast's casts (where it has any)
                autocast = autocast_region_dtype(t.device) is not None
                # a plan built inside an autocast region (flexattn plans for its dtype there)
                # used outside it, where float32 reaches attention
                half_plan = g.dtype in (torch.float16, torch.bfloat16)
                region = t.dtype == torch.float32 and half_plan
                inside = f", or call inside the torch.autocast region of {g.dtype} it was built in"
                inside = inside if region else ""
                hint = (
                    f" (a plan binds q, k, v's dtype: build one from tensors of {t.dtype}, as after "
                    f"model.half() / .to(dtype){inside})"
                )
                # under autocast an op outside its cast lists (RoPE with float32 tables) leaves q, k
                # or v in float32, which SDPA would cast down itself: the plan's dtype is the one to use
                cast = autocast and torch.float32 in dtypes and half_plan
                if cast:
                    hint = (
                        f" (torch.autocast is on, but q, k, v reach attention in "
                        f"{', '.join(map(str, dtypes))}: an op outside autocast's casts, such as RoPE with "
                        f"float32 tables, promoted them; cast them to {g.dtype}, as SDPA and "
                        f"flexattn.flex_attn_func do under autocast)"
                    )
                elif len(set(dtypes)) > 1:
                    hint = f" (q, k and v must share one dtype: they have {', '.join(map(str, dtypes))})"
                elif autocast:
                    hint = (
                        f" (torch.autocast is on: build the plan from q, k, v of the dtype that reaches "
                        f"attention, {t.dtype}; only their shapes, dtype and device are read)"
                    )
                raise PlanDtypeError(f"{name} has dtype {t.dtype} but the plan was built for {g.dtype}{hint}")
            if not head_dim_contiguous(t):
                raise PlanBindingError(
                    f"{name} must have a contiguous last (head) dimension ({name}.contiguous() copies it)"
                )
