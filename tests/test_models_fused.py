"""The fused Triton ops of the CUDA decode step against the torch ops, under the interpreter.

Compared to bf16 tolerance, not bitwise: the interpreter's float32 -> bf16 conversion does not
round like torch's (most outputs differ by one ulp under the interpreter)."""

import os
import sys

if "triton" not in sys.modules:
    os.environ["TRITON_INTERPRET"] = "1"        # before triton is imported: CPU interpreter

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from zipfusion.models.config import RopeConfig  # noqa: E402
from zipfusion.models.layers import RMSNorm, RotaryEmbedding  # noqa: E402

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="triton was imported before without TRITON_INTERPRET=1")


def bf16(*shape, seed=0, scale=1.0):
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(torch.bfloat16)


def test_rmsnorm_matches_torch():
    from zipfusion.models.fused import rmsnorm
    norm = RMSNorm(200, 1e-5)
    norm.weight.data = 1 + 0.1 * bf16(200, seed=9)
    x = bf16(6, 200, scale=3.0)
    got, ref = rmsnorm(x, norm.weight, 1e-5), norm(x)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), ref.float(), rtol=2e-2, atol=1e-2)   # two roundings: <= 2 ulps


def test_rmsnorm_with_residual_adds_first_and_returns_the_sum():
    from zipfusion.models.fused import rmsnorm
    norm = RMSNorm(300, 1e-6)
    norm.weight.data = 1 + 0.1 * bf16(300, seed=8)
    x, r = bf16(5, 300, seed=3, scale=2.0), bf16(5, 300, seed=4, scale=5.0)
    got, got_sum = rmsnorm(x, norm.weight, 1e-6, residual=r)
    ref, ref_sum = norm(x, r)
    assert torch.equal(ref_sum, x + r)                       # the torch path: the plain bf16 add
    torch.testing.assert_close(got_sum.float(), ref_sum.float(), rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(got.float(), ref.float(), rtol=2e-2, atol=1e-2)
    torch.testing.assert_close(ref.float(), norm(x + r).float(), rtol=0, atol=0)


def test_silu_and_mul_matches_torch():
    from zipfusion.models.fused import silu_and_mul
    gu = bf16(5, 2 * 1500, seed=1, scale=2.0)
    gate, up = gu.chunk(2, dim=-1)
    ref = F.silu(gate) * up
    got = silu_and_mul(gu)
    torch.testing.assert_close(got.float(), ref.float(), rtol=2e-2, atol=1e-2)   # one or two bf16 ulps


def test_rope_and_store_matches_torch_and_writes_the_open_pages():
    from zipfusion.models.fused import rope_and_store
    T, Hq, H, D = 3, 4, 2, 64
    qkv = bf16(T, (Hq + 2 * H) * D, seed=2)
    rope = RotaryEmbedding(D, RopeConfig(theta=10000.0))
    positions = torch.tensor([5, 17, 40])
    cos, sin = rope.cos_sin(positions, torch.bfloat16)
    page_bytes = 2 * 16 * H * D * 2
    arena = torch.zeros(4 * page_bytes + 32, dtype=torch.uint8)
    page_loc = torch.tensor([16 | 1, (16 + page_bytes) | 1, (16 + 2 * page_bytes) | 1, -1])
    page_ids, slots = torch.tensor([2, 0, 1]), positions % 16
    q = rope_and_store(qkv, cos, sin, Hq, H, D, arena, page_loc, page_ids, slots)
    q_ref, k_ref, v_ref = qkv.split([Hq * D, H * D, H * D], dim=-1)
    q_ref = RotaryEmbedding.apply(q_ref.reshape(T, Hq, D).float(), cos.float(), sin.float())
    k_ref = RotaryEmbedding.apply(k_ref.reshape(T, H, D).float(), cos.float(), sin.float())
    torch.testing.assert_close(q.float(), q_ref, rtol=1e-2, atol=1e-2)
    pages = arena[16:16 + 3 * page_bytes].view(torch.bfloat16).view(3, 2, 16, H, D)
    for t in range(T):
        p, s = int(page_ids[t]), int(slots[t])
        torch.testing.assert_close(pages[p, 0, s].float(), k_ref[t], rtol=1e-2, atol=1e-2)
        assert torch.equal(pages[p, 1, s], v_ref[t].reshape(H, D))
    written = torch.zeros(3, 2, 16, dtype=torch.bool)
    written[page_ids, :, slots] = True
    assert (pages[~written] == 0).all()                         # nothing else touched
