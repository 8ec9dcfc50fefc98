"""Settle the CPU kernel that torch's float unary ops run before they run on several threads.

torch computes a contiguous float ``exp``, ``log``, ``cos``, ``sin``, ... on the CPU through MKL's
vector maths (VML), one chunk per intra-op thread, and MKL picks each function's kernel on its
first call. Where that first call runs on several threads at once (a fresh process's first sizable
op), one thread can run the low-accuracy kernel on its whole chunk: errors of about 1e-4 relative
(thousands of ulp), on that call only (pytorch/pytorch#188792; oneMKL 2024.2, which torch 2.13's
wheels bundle). The reference attention is every GPU kernel's oracle, and a 1e-4 error in one
process's first ``exp`` fails a comparison at fp32 tolerance at random.

One call on a one-element tensor runs on the calling thread alone and settles the kernel for the
rest of the process. This module can go once torch bundles oneMKL 2025.0 or later (where the race
is gone) or warms VML itself (pytorch/pytorch#188791).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

_DTYPES = (torch.float32, torch.float64)
_settled: set[tuple[Callable, torch.dtype]] = set()


def settle(*ops: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """Call each of ``ops`` (``torch.exp``, ``torch.cos``, ...) once on one float32 and one float64
    element on the CPU, unless this process has already; cheap after the first time. A call that
    computes nothing (under a ``FakeTensorMode``) leaves the op to be settled later."""
    for op in ops:
        for dtype in _DTYPES:
            if (op, dtype) in _settled:
                continue
            if type(op(torch.ones(1, dtype=dtype, device="cpu"))) is torch.Tensor:  # not a fake's
                _settled.add((op, dtype))
