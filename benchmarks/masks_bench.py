"""The benchmark masks (B=2 style problems), as endpoints and as torch FlexAttention mask_mods.

Shared by the GPU benchmarks so every system sees the same mask.
"""

from __future__ import annotations

import torch

from flexattn import masks


def document_lengths(batch: int, seqlen: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(batch):
        lens, left = [], seqlen
        while left > 0:
            n = min(left, int(torch.randint(256, 2049, (1,), generator=g)))
            lens.append(n)
            left -= n
        out.append(lens)
    return out


def random_endpoints(batch: int, seqlen: int, nfunc: int = 5, seed: int = 0, device="cuda") -> torch.Tensor:
    g = torch.Generator(device=device).manual_seed(seed)
    u = torch.rand(1, nfunc, batch * seqlen, device=device, generator=g)
    return torch.floor(u * (seqlen + 1)).clamp(max=seqlen).to(torch.int32).sort(dim=1).values.contiguous()


#: the masks endpoint_mask builds, by the name the benchmarks' ``--masks`` take
MASK_NAMES = ("causal", "sliding-1024", "document", "random-5")


def endpoint_mask(name: str, batch: int, seqlen: int, device="cuda") -> torch.Tensor:
    if name == "causal":
        return masks.causal(seqlen, batch=batch, device=device)
    if name == "sliding-1024":
        return masks.sliding_window(seqlen, window_left=1024, batch=batch, device=device)
    if name == "document":
        return masks.document(document_lengths(batch, seqlen), causal=True, device=device)
    if name == "random-5":
        return random_endpoints(batch, seqlen, device=device)
    raise ValueError(f"unknown mask {name!r}; masks: {', '.join(MASK_NAMES)}")


def mask_mod_from_endpoints(endpoints: torch.Tensor, seqlen: int):
    """A FlexAttention mask_mod equivalent to Hmask=1 fixed-length endpoints (key visible iff an
    odd number of [0, F0, F1, ...] are <= it)."""
    ends = endpoints[0]  # [nfunc, B*S]

    def mask_mod(b, h, q_idx, kv_idx):
        row = b * seqlen + q_idx
        count = (kv_idx >= 0).to(torch.int32)
        for f in range(ends.shape[0]):
            count = count + (ends[f, row] <= kv_idx).to(torch.int32)
        return (count % 2) == 1

    return mask_mod


def visible_pairs(endpoints: torch.Tensor) -> int:
    """Visible (query, key) pairs per mask head, summed over mask heads' rows."""
    e = endpoints.long()
    n = e[:, 0].clone()
    for j in range(1, e.shape[1], 2):
        n += e[:, j + 1] - e[:, j]
    return int(n.sum())
