"""Problem geometry a plan binds (spec section 8), derived once by host validation."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PlanGeometry:
    """Everything a plan is bound to except tensor identity.

    For fixed-length input ``cu_seqlens_q/k`` are synthesised (``arange(B+1) * S``, one pair per
    shape and device, shared by its plans and never written) so every later stage sees one sample
    partition; ``varlen`` says which layout Q/K/V use. Varlen prefixes are owned clones: later
    in-place edits of the caller's tensors change nothing.
    """

    batch: int
    varlen: bool
    max_seqlen_q: int
    max_seqlen_k: int
    total_q: int
    total_k: int
    num_heads_q: int
    num_heads_kv: int
    head_dim_qk: int
    head_dim_v: int
    mask_heads: int
    nfunc: int
    dtype: torch.dtype
    device: torch.device
    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor

    @property
    def qhead_per_kvhead(self) -> int:
        return self.num_heads_q // self.num_heads_kv

    def describe(self) -> str:
        layout = (
            f"varlen THD, B={self.batch}, total_q={self.total_q}, total_k={self.total_k}, "
            f"max_seqlen_q={self.max_seqlen_q}, max_seqlen_k={self.max_seqlen_k}"
            if self.varlen
            else f"fixed BSHD, B={self.batch}, Sq={self.max_seqlen_q}, Sk={self.max_seqlen_k}"
        )
        return (
            f"{layout}, Hq={self.num_heads_q}, Hkv={self.num_heads_kv}, Dqk={self.head_dim_qk}, "
            f"Dv={self.head_dim_v}, Hmask={self.mask_heads}, nfunc={self.nfunc}, "
            f"{str(self.dtype).removeprefix('torch.')}, {self.device}"
        )
