"""Packed predicate payload: the one mechanism every consumer layout plugs into.

A consumer describes its layout by ONE function, :meth:`PayloadLayout.element_coords`, that maps
each score element ``(m, n)`` of a ``tile_m x tile_n`` tile (m = query row in the tile, n = key
column in the tile) to ``(subtile, group, word, bit)``. Packing (CPU reference and GPU
materialiser), :meth:`PlanView.to_dense` and the attention kernel's bit-select all derive from
it. A partial block's payload is::

    mask_block_masks[entry, subtile, group, word]   # uint32 bit patterns stored as int32
    keep(m, n) = (mask_block_masks[entry, s, g, w] >> b) & 1    with (s, g, w, b) = coords(m, n)

Bit 1 keeps the score, bit 0 replaces it with -inf. Bits no element maps to are padding (0).
"""

from __future__ import annotations

import hashlib
import struct
from abc import ABC, abstractmethod
from collections.abc import Sequence
from functools import cached_property

import torch

from .errors import InputTypeError, InputValueError
from .schema import PayloadLayoutSpec

WORD_BITS = 32
_BYTE_SHIFTS = torch.arange(8, dtype=torch.uint8, device="cpu")


class PayloadLayout(ABC):
    """Element -> (subtile, group, word, bit) map of one consumer's partial-block payload."""

    layout_id: str
    tile_m: int
    tile_n: int
    subtiles: int
    groups: int
    words_per_group: int

    @abstractmethod
    def element_coords(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(subtile, group, word, bit)``, each an int64 tensor ``[tile_m, tile_n]``."""

    @property
    def spec(self) -> PayloadLayoutSpec:
        return PayloadLayoutSpec(
            layout_id=self.layout_id,
            bit_order=self.bit_order,
            physical_subtiles=self.subtiles,
            payload_groups=self.groups,
            words_per_group=self.words_per_group,
        )

    @property
    def words_per_tile(self) -> int:
        return self.subtiles * self.groups * self.words_per_group

    @cached_property
    def flat_bit_index(self) -> torch.Tensor:
        """int64 ``[tile_m, tile_n]``: position of each element's bit in the tile's flat bit string."""
        coords = self.element_coords()
        names = ("subtile", "group", "word", "bit")
        if not isinstance(coords, (tuple, list)) or len(coords) != len(names):
            got = f"{len(coords)} values" if isinstance(coords, (tuple, list)) else type(coords).__name__
            raise InputTypeError(
                f"payload layout {self.layout_id}: element_coords must return 4 tensors "
                f"(subtile, group, word, bit), got {got}"
            )
        for name, c in zip(names, coords, strict=True):
            if not isinstance(c, torch.Tensor) or c.dtype.is_floating_point or c.dtype.is_complex or (
                c.dtype == torch.bool
            ):
                got = c.dtype if isinstance(c, torch.Tensor) else type(c).__name__
                raise InputTypeError(
                    f"payload layout {self.layout_id}: element_coords' {name} must be an integer tensor "
                    f"[tile_m, tile_n], got {got}"
                )
        coords = tuple(c.to(torch.int64) for c in coords)
        extents = (self.subtiles, self.groups, self.words_per_group, WORD_BITS)
        for name, c, extent in zip(names, coords, extents, strict=True):
            if tuple(c.shape) != (self.tile_m, self.tile_n) or bool(((c < 0) | (c >= extent)).any()):
                raise InputValueError(
                    f"payload layout {self.layout_id}: element_coords' {name} must be [tile_m, tile_n] = "
                    f"[{self.tile_m}, {self.tile_n}] values in [0, {extent}), got shape {tuple(c.shape)}, "
                    f"range [{int(c.min())}, {int(c.max())}]"
                )
        s, g, w, b = coords
        word = (s * self.groups + g) * self.words_per_group + w
        flat = word * WORD_BITS + b
        if flat.unique().numel() != flat.numel():
            raise InputValueError(f"payload layout {self.layout_id} maps two elements to one bit")
        return flat

    @cached_property
    def bit_order(self) -> str:
        """Digest of the bit order (:func:`bit_order_digest`): the signature carries it beside
        ``layout_id``, so a plan packed in another order under the same id (a subclass overriding
        ``element_coords`` and keeping its parent's id, a layout changed without a new version)
        is refused by the consumer's signature check, in this process or any other."""
        return bit_order_digest(self.flat_bit_index)

    @cached_property
    def _bit_source(self) -> torch.Tensor:
        """int64 ``[words_per_tile * 32]``: the element feeding each bit (``tile_m * tile_n`` = padding)."""
        n_elem = self.tile_m * self.tile_n
        src = torch.full((self.words_per_tile * WORD_BITS,), n_elem, dtype=torch.int64, device="cpu")
        src[self.flat_bit_index.reshape(-1)] = torch.arange(n_elem, device="cpu")
        return src

    @cached_property
    def _has_padding_bits(self) -> bool:
        return bool((self._bit_source == self.tile_m * self.tile_n).any())

    @cached_property
    def _gather_units(self) -> tuple[torch.dtype, torch.Tensor]:
        """``(unit, index)``: the bit order as a gather of ``unit``-wide runs of elements. Where the
        bits take aligned runs of 8, 4 or 2 consecutive elements (row-major words take 8; the
        WGMMA fragment's register pairs 2), the flags are gathered a run at a time."""
        src = self._bit_source
        if not self._has_padding_bits:
            for width, unit in ((8, torch.int64), (4, torch.int32), (2, torch.int16)):
                runs = src.view(-1, width)
                consecutive = (runs == runs[:, :1] + torch.arange(width, device="cpu")).all()
                if bool(consecutive and (runs[:, 0] % width == 0).all()):
                    return unit, runs[:, 0] // width
        return torch.uint8, src

    def pack(self, tiles: torch.Tensor) -> torch.Tensor:
        """bool ``[n, tile_m, tile_n]`` -> int32 ``[n, subtiles, groups, words_per_group]``."""
        n = tiles.shape[0]
        flat = tiles.reshape(n, self.tile_m * self.tile_n).view(torch.uint8)
        if self._has_padding_bits:  # they read the element past the last: a 0
            flat = torch.nn.functional.pad(flat, (0, 1))
        unit, index = self._gather_units
        if flat.storage_offset() % unit.itemsize:  # a view as wider units starts on a unit
            flat = flat.clone()
        bits = flat.view(unit)[:, index.to(tiles.device)].view(torch.uint8)  # [n, words * 32] of 0 / 1
        # little-endian bytes: byte k of a word holds bits 8k..8k+7. Eight 0/1 bytes read as one
        # int64 x = sum b_j << 8j; x * sum_j 2^(56 - 7j) puts b_j at bit 56 + j, and no other
        # product term reaches bits 56..63 below the overflow (the usual pack-8-flags multiply)
        byte = ((bits.view(torch.int64) * 0x0102040810204080) >> 56).to(torch.uint8)
        return byte.view(torch.int32).reshape(n, self.subtiles, self.groups, self.words_per_group)

    def unpack(self, words: torch.Tensor) -> torch.Tensor:
        """int32 ``[n, subtiles, groups, words_per_group]`` -> bool ``[n, tile_m, tile_n]``."""
        n = words.shape[0]
        byte = words.contiguous().reshape(n, self.words_per_tile).view(torch.uint8)
        bits = ((byte.unsqueeze(-1) >> _BYTE_SHIFTS.to(words.device)) & 1).reshape(
            n, self.words_per_tile * 32
        )
        return (
            bits[:, self.flat_bit_index.to(words.device).reshape(-1)]
            .reshape(n, self.tile_m, self.tile_n)
            .bool()
        )

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}({self.layout_id}: tile {self.tile_m}x{self.tile_n}, "
            f"{self.subtiles} subtile(s) x {self.groups} groups x {self.words_per_group} words)"
        )


def bit_order_digest(flat_bit_index: torch.Tensor) -> str:
    """``"sha256:"`` and the first 16 hex digits of the SHA-256 of ``tile_m``, ``tile_n`` and then
    every element's flat bit index (``((subtile * groups + group) * words_per_group + word) * 32
    + bit``) in row-major ``(m, n)`` order, all as little-endian int64: the schema's
    ``PayloadLayoutSpec.bit_order``, reproducible in any language from the layout's map."""
    tile_m, tile_n = flat_bit_index.shape
    values = [tile_m, tile_n, *flat_bit_index.reshape(-1).tolist()]
    return "sha256:" + hashlib.sha256(struct.pack(f"<{len(values)}q", *values)).hexdigest()[:16]


def fragment_inverse(
    layout: PayloadLayout, m: torch.Tensor, n: torch.Tensor, coords: Sequence[torch.Tensor], holders: int = 1
) -> tuple[torch.Tensor, ...]:
    """:meth:`PayloadLayout.element_coords` of a layout given by its consumer's register fragment:
    the ``coords`` (subtile, group, word, bit) of the registers that hold score elements ``(m, n)``
    (tensors of one shape), scattered into ``[tile_m, tile_n]`` tensors. Checks that every element
    is held by exactly ``holders`` registers and that all of them read the same bit."""
    tile_m, tile_n, layout_id = layout.tile_m, layout.tile_n, layout.layout_id
    flat = (m * tile_n + n).reshape(-1)
    hits = torch.bincount(flat, minlength=tile_m * tile_n)
    if hits.numel() != tile_m * tile_n or not bool((hits == holders).all()):
        raise AssertionError(
            f"{layout_id}: the fragment does not hold every element of the {tile_m}x{tile_n} tile "
            f"exactly {holders} time(s)"
        )
    out = []
    for value in coords:
        dense = torch.empty(tile_m * tile_n, dtype=torch.int64, device="cpu")
        dense[flat] = value.reshape(-1)
        if not bool((dense[flat] == value.reshape(-1)).all()):
            raise AssertionError(f"{layout_id}: two holders of one element read different bits")
        out.append(dense.reshape(tile_m, tile_n))
    return tuple(out)


class RowMajorLayout(PayloadLayout):
    """The reference consumer's layout: one group per tile row, bits in column order.

    ::

        group = m          word = n // 32          bit = n % 32
    """

    def __init__(self, tile_m: int = 128, tile_n: int = 128) -> None:
        self.tile_m, self.tile_n = tile_m, tile_n
        self.subtiles = 1
        self.groups = tile_m
        self.words_per_group = -(-tile_n // WORD_BITS)
        self.layout_id = f"rowmajor-v1-{tile_m}x{tile_n}"

    def element_coords(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        m = torch.arange(self.tile_m, device="cpu").unsqueeze(1).expand(self.tile_m, self.tile_n)
        n = torch.arange(self.tile_n, device="cpu").unsqueeze(0).expand(self.tile_m, self.tile_n)
        return torch.zeros_like(m), m, n // WORD_BITS, n % WORD_BITS
