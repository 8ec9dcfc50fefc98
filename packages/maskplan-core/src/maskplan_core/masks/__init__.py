"""Builders for interval-endpoint attention masks.

A mask is stored per query row as sorted interval endpoints: a contiguous ``int32`` tensor
``endpoints[Hmask, nfunc, total_q]`` with ``nfunc`` a positive odd integer.  For one query row
with endpoints ``F0 <= F1 <= ... <= F(nfunc-1)`` (each in ``[0, k_len]`` of the row's sample) the
visible keys are::

    [0, F0) U [F1, F2) U [F3, F4) U ...

Equal adjacent endpoints are an empty interval.  Endpoints are sample-local key positions.
``total_q`` is ``B * Sq`` for fixed-length batches (rows in batch-major order: ``row = b * Sq + q``)
or the total query token count for varlen batches (samples delimited by ``cu_seqlens_q``).

Every builder returns a contiguous ``int32`` tensor ``[Hmask, nfunc, total_q]``.

Build a mask for the key length its plan will see: ``seqlen_k`` defaults to ``seqlen_q``. A
builder records the query rows and keys of the samples it built for, and a plan for q or k of
other samples refuses its result, as torch refuses a block mask made for other lengths:
``causal(Sq)`` with ``Sk > Sq`` keys would hide the keys past ``Sq`` rather than be the
bottom-right causal mask ``causal(Sq, Sk)``. The endpoints themselves do not hold the lengths: a
tensor made from a builder's result (``.clone()``, ``torch.cat``, ``.to()``) is taken as it is.

Examples (``.tolist()`` drops the tensor wrapper):

``causal`` -- bottom-right aligned causal mask, ``nfunc = 1``:

>>> causal(3).tolist()
[[[1, 2, 3]]]
>>> causal(2, 4, batch=2).tolist()
[[[3, 4, 3, 4]]]
>>> causal(cu_seqlens_q=[0, 2, 5], cu_seqlens_k=[0, 3, 6]).tolist()  # varlen: per-sample alignment
[[[2, 3, 1, 2, 3]]]

``full`` -- no mask (every key of the row's sample), ``nfunc = 1``:

>>> full(2, 3, batch=2).tolist()
[[[3, 3, 3, 3]]]
>>> full(cu_seqlens_q=[0, 2, 3], cu_seqlens_k=[0, 1, 5]).tolist()
[[[1, 1, 4]]]

``sliding_window`` -- keys ``[d - window_left, d + window_right]`` with ``d = i + Sk - Sq``, ``nfunc = 3``:

>>> sliding_window(4, window_left=1).tolist()
[[[0, 0, 0, 0], [0, 0, 1, 2], [1, 2, 3, 4]]]

``document`` -- packed documents (self-attention within each document), ``nfunc = 3``:

>>> document([2, 3]).tolist()
[[[0, 0, 0, 0, 0], [0, 0, 2, 2, 2], [1, 2, 3, 4, 5]]]
>>> document([[2, 1], [1, 2]], causal=False).tolist()
[[[0, 0, 0, 0, 0, 0], [0, 0, 2, 0, 1, 1], [2, 2, 3, 1, 3, 3]]]

``document_ids`` -- the same from per-token document ids (runs of equal ids), on their device:

>>> document_ids(torch.tensor([7, 7, 3, 3, 3])).tolist()
[[[0, 0, 0, 0, 0], [0, 0, 2, 2, 2], [1, 2, 3, 4, 5]]]

``prefix_lm`` -- bidirectional prefix then causal, ``nfunc = 1``:

>>> prefix_lm(4, 2).tolist()
[[[2, 2, 3, 4]]]
>>> prefix_lm(3, [1, 3]).tolist()
[[[1, 2, 3, 3, 3, 3]]]

``chunked`` -- attention restricted to fixed-size chunks (Llama-4 style), ``nfunc = 3``:

>>> chunked(5, 2).tolist()
[[[0, 0, 0, 0, 0], [0, 0, 2, 2, 4], [1, 2, 3, 4, 5]]]

``intersect`` / ``union`` -- the keys every / any one of several masks shows a row (torch
FlexAttention's ``and_masks`` / ``or_masks``), with the fewest endpoints:

>>> intersect(causal(4), sliding_window(4, window_left=1)).tolist()
[[[1, 2, 0, 0], [1, 2, 1, 2], [1, 2, 3, 4]]]

``select_rows`` / ``select_keys`` -- some query positions of each sample (a context-parallel
rank's, a prefill chunk's; endpoints unchanged) / the mask over some keys (a ring step's shard):

>>> select_rows(causal(8), [2, 5, 6]).tolist()
[[[3, 6, 7]]]
>>> select_keys(causal(4), [1, 3]).tolist()
[[[0, 1, 1, 2]]]

``from_dense`` -- boolean ``[Hmask, total_q, Sk]`` mask to endpoints with the smallest odd ``nfunc``:

>>> m = torch.tensor([[[True, False, True, True], [False, True, False, False]]])
>>> from_dense(m).tolist()
[[[1, 0], [2, 1], [4, 2]]]

``from_mask_mod`` -- a FlexAttention-style ``mask_mod(b, h, q_idx, kv_idx)``:

>>> from_mask_mod(lambda b, h, q, kv: kv <= q, 1, None, 3, 3).tolist()
[[[1, 2, 3]]]
"""

from .builders import causal, chunked, document, document_ids, full, prefix_lm, sliding_window
from .combine import intersect, union
from .convert import from_block_mask, from_dense, from_mask_mod
from .select import select_keys, select_rows

__all__ = [
    "causal",
    "chunked",
    "document",
    "document_ids",
    "from_block_mask",
    "from_dense",
    "from_mask_mod",
    "full",
    "intersect",
    "prefix_lm",
    "select_keys",
    "select_rows",
    "sliding_window",
    "union",
]
