"""The benchmark masks (B=2 style problems), as endpoints and as torch FlexAttention mask_mods.

Shared by the GPU benchmarks so every system sees the same mask.
"""

from __future__ import annotations

import torch

from flexattn import masks


def document_lengths(
    batch: int, seqlen: int, seed: int = 0, shortest: int = 256, longest: int = 2048
) -> list[list[int]]:
    """Each sample cut into documents of uniform random lengths in ``[shortest, longest]`` (the last
    one shorter where the sample ends)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(batch):
        lens, left = [], seqlen
        while left > 0:
            n = min(left, int(torch.randint(shortest, longest + 1, (1,), generator=g)))
            lens.append(n)
            left -= n
        out.append(lens)
    return out


def random_endpoints(batch: int, seqlen: int, nfunc: int = 5, seed: int = 0, device="cuda") -> torch.Tensor:
    g = torch.Generator(device=device).manual_seed(seed)
    u = torch.rand(1, nfunc, batch * seqlen, device=device, generator=g)
    return torch.floor(u * (seqlen + 1)).clamp(max=seqlen).to(torch.int32).sort(dim=1).values.contiguous()


#: the benchmarks' default masks (``--masks``)
MASK_NAMES = ("causal", "sliding-1024", "document", "random-5")
#: every form ``endpoint_mask`` takes, for help and error texts
MASK_FORMS = (
    "causal", "sliding-<W> (causal, W keys to the left)", "document (causal, 256-2048 tokens)",
    "document-short (causal, 64-512 tokens)", "random-<N> (N random endpoints a row, N odd)",
    "prefix-lm (a bidirectional prefix of S/4, causal after)", "chunked-<C> (causal in chunks of C)",
)  # fmt: skip
_PARAMETRISED = ("sliding", "random", "chunked")  # each takes an integer >= 1


def _parse(name: str) -> tuple[str, int | None]:
    """``("sliding", 1024)`` for ``"sliding-1024"``, ``("causal", None)`` for ``"causal"``; ValueError
    naming the forms for any other name."""
    base, _, param = name.rpartition("-")
    if base in _PARAMETRISED and param.isdigit() and int(param) >= 1:
        if base != "random" or int(param) % 2:  # endpoints come in an odd count: F0, then pairs
            return base, int(param)
    if name in ("causal", "document", "document-short", "prefix-lm"):
        return name, None
    raise ValueError(f"unknown mask {name!r}; masks: {'; '.join(MASK_FORMS)}")


class _MaskNames:
    """What ``--masks`` takes: ``name in MASKS`` for a name of any form in ``MASK_FORMS``; iterating
    gives the forms (for help and error texts)."""

    def __contains__(self, name: object) -> bool:
        if not isinstance(name, str):
            return False
        try:
            _parse(name)
        except ValueError:
            return False
        return True

    def __iter__(self):
        return iter(MASK_FORMS)


MASKS = _MaskNames()


def documents_of(name: str, batch: int, seqlen: int) -> list[list[int]] | None:
    """The document lengths of each sample for the ``document`` masks (the samples of the varlen
    systems' THD batch), None for the others."""
    base, _ = _parse(name)
    if base == "document":
        return document_lengths(batch, seqlen)
    if base == "document-short":
        return document_lengths(batch, seqlen, shortest=64, longest=512)
    return None


def endpoint_mask(name: str, batch: int, seqlen: int, device="cuda") -> torch.Tensor:
    base, param = _parse(name)
    if (docs := documents_of(name, batch, seqlen)) is not None:
        return masks.document(docs, causal=True, device=device)
    if base == "causal":
        return masks.causal(seqlen, batch=batch, device=device)
    if base == "sliding":
        return masks.sliding_window(seqlen, window_left=param, batch=batch, device=device)
    if base == "random":
        return random_endpoints(batch, seqlen, nfunc=param, device=device)
    if base == "prefix-lm":
        return masks.prefix_lm(seqlen, seqlen // 4, batch=batch, device=device)
    return masks.chunked(seqlen, param, batch=batch, device=device)


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


#: the plan benchmarks' masks (bench_plan_cpu.py, bench_plan_gpu.py)
PLAN_MASKS = ("causal", "sliding-1024", "document", "random-5")


def plan_bench_mask(
    name: str, batch: int, seqlen: int, seed: int
) -> tuple[torch.Tensor, list[list[int]] | None]:
    """The plan benchmarks' mask ``name`` on the CPU, and for ``document`` its document lengths per
    sample (None for the others). Their documents (2 to 32 a sample, cut at random) and random
    endpoints (``randint``) are not the attention benchmarks' (:func:`endpoint_mask`): they came
    first, and the recorded plan-build figures are theirs."""
    gen = torch.Generator().manual_seed(seed)
    if name in ("causal", "sliding-1024"):  # the attention benchmarks' own
        return endpoint_mask(name, batch, seqlen, device="cpu"), None
    if name == "document":
        docs = []
        for _ in range(batch):  # 2..32 documents per sample, random lengths summing to S
            n = int(torch.randint(2, 33, (1,), generator=gen))
            cuts = torch.randperm(seqlen - 1, generator=gen)[: n - 1].add(1).sort().values.tolist()
            bounds = [0, *cuts, seqlen]
            docs.append([b - a for a, b in zip(bounds[:-1], bounds[1:], strict=True)])
        return masks.document(docs), docs
    if name == "random-5":
        ends = torch.randint(0, seqlen + 1, (1, 5, batch * seqlen), generator=gen, dtype=torch.int32)
        return ends.sort(dim=1).values.contiguous(), None
    raise ValueError(f"unknown mask {name!r}; choose from {PLAN_MASKS}")
