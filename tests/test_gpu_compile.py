"""Issue 7 on an SM90 GPU: ``torch.compile(fullgraph=True)`` around ``flex_attn_func`` trains like
eager, and a second process reaches its first plan build + forward in under a second because every
CuTe DSL kernel comes from the on-disk compile cache.

``pytest -s tests/test_gpu_compile.py`` prints the measured first-call times of both processes
(first plan build + first forward, after the imports, which are timed separately: importing
CuTe DSL is a per-process cost no cache removes).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

import flexattn
from flexattn import masks
from maskplan_core.testing import cuda_arch_major

pytestmark = pytest.mark.gpu

B, S, H, D = 2, 4096, 16, 128


SM90 = cuda_arch_major() == 9  # the SM90 consumer's kernels can run


_FIRST_CALL = """
import json, time, hashlib
import torch
torch.cuda.init()
start = time.perf_counter()
import flexattn
from flexattn import masks
from flexattn.registry import installed_consumers
from maskplan_kernels import compile_cache
installed_consumers()  # imports the SM90 consumer and CuTe DSL: timed apart from the first call
import_s = time.perf_counter() - start
gen = torch.Generator(device="cuda").manual_seed(0)
shape = ({B}, {S}, {H}, {D})
q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(3))
mask = masks.causal({S}, batch={B}, device="cuda")
torch.cuda.synchronize()
start = time.perf_counter()
plan = flexattn.create_mask_plan(mask, q, k, v)
torch.cuda.synchronize()
planned = time.perf_counter()
out = flexattn.flex_attn_func(q, k, v, mask_plan=plan)
torch.cuda.synchronize()
done = time.perf_counter()
print(json.dumps(dict(
    import_s=import_s, plan_s=planned - start, forward_s=done - planned, first_call_s=done - start,
    out_sha=hashlib.sha256(out.view(torch.int16).cpu().numpy().tobytes()).hexdigest(),
    stats=dict(compile_cache.STATS),
)))
"""


@pytest.mark.skipif(not SM90, reason="needs an SM90 GPU")
def test_second_process_first_call_is_served_by_the_disk_cache(tmp_path):
    env = {**os.environ, "FLEXATTN_CACHE_DIR": str(tmp_path), "FLEXATTN_CACHE": "1"}
    code = _FIRST_CALL.format(B=B, S=S, H=H, D=D)
    runs = []
    for _ in range(2):
        proc = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600
        )
        assert proc.returncode == 0, proc.stderr
        runs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    first, second = runs
    report = "; ".join(
        f"{name} process: plan {r['plan_s']:.3f} s + forward {r['forward_s']:.3f} s "
        f"(imports before the call: {r['import_s']:.2f} s)"
        for name, r in (("first", first), ("second", second))
    )
    print(report)
    assert first["stats"].get("compile", 0) > 0 and first["stats"].get("write", 0) > 0, first
    assert second["stats"].get("compile", 0) == 0 and second["stats"].get("disk_hit", 0) > 0, second
    assert second["out_sha"] == first["out_sha"]  # the loaded kernels compute the same bits
    assert second["first_call_s"] < 1.0, report


class Block(torch.nn.Module):
    def __init__(self, dim=H * D):
        super().__init__()
        self.norm = torch.nn.LayerNorm(dim)
        self.qkv = torch.nn.Linear(dim, 3 * dim, bias=False)
        self.out = torch.nn.Linear(dim, dim, bias=False)
        self.mlp = torch.nn.Sequential(
            torch.nn.Linear(dim, 2 * dim), torch.nn.GELU(), torch.nn.Linear(2 * dim, dim)
        )

    def forward(self, x, plan):
        b, s, _ = x.shape
        q, k, v = self.qkv(self.norm(x)).view(b, s, 3, H, D).unbind(2)
        x = x + self.out(flexattn.flex_attn_func(q, k, v, mask_plan=plan).reshape(b, s, H * D))
        return x + self.mlp(x)


@pytest.mark.skipif(not SM90, reason="needs an SM90 GPU")
def test_compiled_block_trains_one_step_like_eager():
    torch.manual_seed(0)
    s = 1024
    block = Block().cuda().to(torch.bfloat16)
    x = torch.randn(B, s, H * D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    plan = flexattn.create_mask_plan(
        masks.document([[300, 724], [1024]], causal=True, device="cuda"),
        *(torch.empty(B, s, H, D, device="cuda", dtype=torch.bfloat16, requires_grad=True),) * 3,
    )
    block(x, plan).float().square().mean().backward()
    eager = [p.grad.clone() for p in block.parameters()] + [x.grad.clone()]
    block.zero_grad()
    x.grad = None
    compiled = torch.compile(block, fullgraph=True)
    compiled(x, plan).float().square().mean().backward()
    got = [p.grad for p in block.parameters()] + [x.grad]
    for a, b in zip(eager, got, strict=True):
        torch.testing.assert_close(b.float(), a.float(), rtol=2e-2, atol=2e-2)
