"""The consumer's payload layout as DATA for the GPU packer (host side, pure torch, CPU-testable).

The GPU packer never spells a layout formula. It receives the inverse of the consumer's
``PayloadLayout.flat_bit_index`` (the one source of truth, derived from ``element_coords``) as an
int32 table, one entry per payload bit::

    table[word * 32 + bit] = bit address, in the packer's shared tile bitmap, of the score
                             element (m, n) that feeds payload bit `bit` of word `word`
                           = (row_base(m) + n // 32) * 32 + n % 32
                           = zero_address for padding bits (a shared word that is always 0)

The packer builds the tile's predicate as a row-major bitmap in shared memory, then lane ``b`` of a
warp reads ``table[word * 32 + b]`` and the warp's ballot IS payload word ``word``. Row ``m``
starts at ``row_base(m) = m * row_stride + m // 32``: ``row_stride`` words (odd, so rows 8 apart
fall in different banks) and one skew word every 32 rows, so rows 32 apart do too (the SM90
backward's payload words take rows m, m + 1, m + 8, ..., m + 57: 2-way bank conflicts without it).
:func:`pack_with_table` is the pure-torch twin of that device loop; ``tests/test_payload_table.py``
checks it against ``layout.pack`` for every layout the consumers ship.
"""

from __future__ import annotations

import threading

import torch

from maskplan_core.payload import WORD_BITS, PayloadLayout


def row_words(tile_n: int) -> int:
    """uint32 words holding one tile row of the bitmap."""
    return -(-tile_n // WORD_BITS)


def bitmap_row_stride(tile_n: int) -> int:
    """Words between consecutive tile rows of the shared bitmap: odd (bank-conflict padding)."""
    return row_words(tile_n) | 1


def bitmap_row_base(m, tile_n: int):
    """Word offset of tile row ``m`` in the shared bitmap (an int, a tensor or a device Int32)."""
    return m * bitmap_row_stride(tile_n) + m // WORD_BITS


def bitmap_words(tile_m: int, tile_n: int) -> int:
    """Shared bitmap size in words: the rows plus one always-zero word at the end."""
    return bitmap_row_base(tile_m, tile_n) + 1


def zero_address(tile_m: int, tile_n: int) -> int:
    """Bit address of bit 0 of the always-zero word (target of every padding bit)."""
    return bitmap_row_base(tile_m, tile_n) * WORD_BITS


def payload_source_table(layout: PayloadLayout) -> torch.Tensor:
    """int32 CPU ``[words_per_tile * 32]``: the bitmap bit address feeding each payload bit."""
    tm, tn = layout.tile_m, layout.tile_n
    flat = layout.flat_bit_index.reshape(-1).to(torch.int64)  # [tm * tn] payload bit of element (m, n)
    n_bits = layout.words_per_tile * WORD_BITS
    if flat.numel() != tm * tn or int(flat.min()) < 0 or int(flat.max()) >= n_bits:
        raise ValueError(f"{layout!r}: flat_bit_index must map the {tm}x{tn} tile into {n_bits} payload bits")
    m = torch.arange(tm, dtype=torch.int64, device="cpu").unsqueeze(1)
    n = torch.arange(tn, dtype=torch.int64, device="cpu").unsqueeze(0)
    address = ((bitmap_row_base(m, tn) + n // WORD_BITS) * WORD_BITS + n % WORD_BITS).reshape(-1)
    table = torch.full((n_bits,), zero_address(tm, tn), dtype=torch.int64, device="cpu")
    table[flat] = address
    return table.to(torch.int32)


def tile_bitmaps(tiles: torch.Tensor) -> torch.Tensor:
    """bool ``[n, tm, tn]`` -> int32 ``[n, bitmap_words]``: the shared bitmap the packer builds."""
    n, tm, tn = tiles.shape
    rw = row_words(tn)
    bits = torch.nn.functional.pad(tiles.to(torch.int64), (0, rw * WORD_BITS - tn))
    shifts = torch.arange(WORD_BITS, device=tiles.device)
    words = (bits.reshape(n, tm, rw, WORD_BITS) << shifts).sum(-1)  # [n, tm, rw]
    out = torch.zeros(n, bitmap_words(tm, tn), dtype=torch.int64, device=tiles.device)
    rows = torch.arange(tm, device=tiles.device).unsqueeze(1)
    index = bitmap_row_base(rows, tn) + torch.arange(rw, device=tiles.device)  # [tm, rw]
    out[:, index.reshape(-1)] = words.reshape(n, tm * rw)
    return torch.where(out >= 2**31, out - 2**32, out).to(torch.int32)


def pack_with_table(tiles: torch.Tensor, layout: PayloadLayout) -> torch.Tensor:
    """Pure-torch twin of the GPU packer: bitmap, then word ``w`` bit ``b`` = bitmap bit ``table[32w + b]``.

    bool ``[n, tile_m, tile_n]`` -> int32 ``[n, subtiles, groups, words_per_group]`` (equals
    ``layout.pack(tiles)`` for every valid layout).
    """
    n = tiles.shape[0]
    bitmap = tile_bitmaps(tiles.cpu()).to(torch.int64) & 0xFFFFFFFF
    table = payload_source_table(layout).to(torch.int64)
    bits = (bitmap[:, table // WORD_BITS] >> (table % WORD_BITS)) & 1  # [n, words * 32]
    shifts = torch.arange(WORD_BITS, device="cpu")
    words = (bits.reshape(n, layout.words_per_tile, WORD_BITS) << shifts).sum(-1)
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    return words.reshape(n, layout.subtiles, layout.groups, layout.words_per_group)


# ------------------------------------------------------------------------------------------------
# device copies, one per (layout identity, device)

_DEVICE_TABLES: dict[tuple, torch.Tensor] = {}
_LOCK = threading.Lock()


def layout_key(layout: PayloadLayout) -> tuple:
    """Identity of a layout's bit map: its ``layout_id`` and ``bit_order`` digest (two orders
    under one id never share a table) plus the shape fields, so two shapes never share one."""
    return (
        layout.layout_id,
        layout.bit_order,
        layout.tile_m,
        layout.tile_n,
        layout.subtiles,
        layout.groups,
        layout.words_per_group,
    )


def device_source_table(layout: PayloadLayout, device: torch.device) -> torch.Tensor:
    """The table on ``device``, built and uploaded once per process (the first upload waits for
    the copy, so later builds on any stream read a complete table)."""
    key = (*layout_key(layout), str(device))
    table = _DEVICE_TABLES.get(key)
    if table is None:
        with _LOCK:
            table = _DEVICE_TABLES.get(key)
            if table is None:
                table = payload_source_table(layout).to(device)
                if table.is_cuda:
                    torch.cuda.synchronize(device)  # once per layout and device, never per build
                _DEVICE_TABLES[key] = table
    return table
