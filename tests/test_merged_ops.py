"""The merged small ops (one Triton kernel each) of the CUDA step against the torch ops: compiled on a GPU, through the
Triton interpreter on the CPU (tests/conftest.py chooses).

RMSNorm and SiLU-and-mul are compared to bf16 tolerance (their kernels round with Triton's own
cast, which the interpreter does not do like torch); rope + store is compared bit for bit (its
kernel rounds by integer ops, the same on every backend)."""

import pytest
import torch
import torch.nn.functional as F

from zipfusion.models.config import RopeConfig
from zipfusion.models.layers import RMSNorm, RotaryEmbedding

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"     # the kernels' tensors; references on the CPU


def bf16(*shape, seed=0, scale=1.0):
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(torch.bfloat16)


def test_rmsnorm_matches_torch():
    from zipfusion.models.merged_ops import rmsnorm
    norm = RMSNorm(200, 1e-5)
    norm.weight.data = 1 + 0.1 * bf16(200, seed=9)
    x = bf16(6, 200, scale=3.0)
    got, ref = rmsnorm(x.to(DEVICE), norm.weight.to(DEVICE), 1e-5).cpu(), norm(x)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), ref.float(), rtol=2e-2, atol=1e-2)   # two roundings: <= 2 ulps


def test_rmsnorm_with_residual_adds_first_and_returns_the_sum():
    from zipfusion.models.merged_ops import rmsnorm
    norm = RMSNorm(300, 1e-6)
    norm.weight.data = 1 + 0.1 * bf16(300, seed=8)
    x, r = bf16(5, 300, seed=3, scale=2.0), bf16(5, 300, seed=4, scale=5.0)
    got, got_sum = rmsnorm(x.to(DEVICE), norm.weight.to(DEVICE), 1e-6, residual=r.to(DEVICE))
    got, got_sum = got.cpu(), got_sum.cpu()
    ref, ref_sum = norm(x, r)
    assert torch.equal(ref_sum, x + r)                       # the torch path: the plain bf16 add
    torch.testing.assert_close(got_sum.float(), ref_sum.float(), rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(got.float(), ref.float(), rtol=2e-2, atol=1e-2)
    torch.testing.assert_close(ref.float(), norm(x + r).float(), rtol=0, atol=0)


def test_silu_and_mul_matches_torch():
    from zipfusion.models.merged_ops import silu_and_mul
    gu = bf16(5, 2 * 1500, seed=1, scale=2.0)
    gate, up = gu.chunk(2, dim=-1)
    ref = F.silu(gate) * up
    got = silu_and_mul(gu.to(DEVICE)).cpu()
    torch.testing.assert_close(got.float(), ref.float(), rtol=2e-2, atol=1e-2)   # one or two bf16 ulps


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rope_and_store_is_the_torch_rope_bit_for_bit_and_writes_the_open_pages(dtype, device=DEVICE):
    """One rope arithmetic: the kernel's rotated q and k (and the K/V it stores) are the torch
    path's bits (models.layers.apply_rope + PageLayout.open_elements)."""
    from zipfusion.format import PageLayout
    from zipfusion.kernels.rope_store import rope_and_store
    from zipfusion.models.layers import apply_rope
    T, Hq, H, D = 3, 4, 2, 64
    qkv = (torch.randn(T, (Hq + 2 * H) * D, generator=torch.Generator().manual_seed(2)) * 3).to(dtype).to(device)
    q, k, v = qkv.split([Hq * D, H * D, H * D], dim=-1)
    q, k, v = q.view(T, Hq, D), k.view(T, H, D), v.view(T, H, D)        # strided views, as the model has
    rope = RotaryEmbedding(D, RopeConfig(theta=10000.0)).to(device)
    positions = torch.tensor([5, 17, 40000], device=device)
    cos, sin = rope.cos_sin(positions)
    layout = PageLayout(H, D)
    page_bytes = layout.open_page_bytes
    arena = torch.zeros(4 * page_bytes + 32, dtype=torch.uint8, device=device)
    page_loc = torch.tensor([16 | 1, (16 + page_bytes) | 1, (16 + 2 * page_bytes) | 1, -1], device=device)
    page_ids, slots = torch.tensor([2, 0, 1], device=device), positions % 16
    q_got, k_got = rope_and_store(q, k, v, cos, sin, arena, page_loc, page_ids, slots, want_k=True)
    q_ref, k_ref = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    assert q_got.dtype == dtype and torch.equal(q_got, q_ref) and torch.equal(k_got, k_ref)
    ref_arena = torch.zeros_like(arena)
    idx = layout.open_elements(page_loc[page_ids], slots)
    ref_arena.view(torch.bfloat16).index_copy_(0, idx.reshape(-1),
                                               torch.stack([k_ref, v], 1).to(torch.bfloat16).reshape(-1))
    assert torch.equal(arena, ref_arena)                                 # the same bytes, nothing else touched
    assert (arena[:16] == 0).all() and ref_arena.any()
    q_only, none = rope_and_store(q, k, v, cos, sin, arena, page_loc, page_ids, slots)
    assert torch.equal(q_only, q_ref) and none is None


def test_apply_rope_rounds_once():
    """bf16 rope: fp32 cos/sin, exact products, one rounding -- not bf16 math op by op."""
    from zipfusion.models.layers import apply_rope
    x = (torch.randn(64, 8, 64, generator=torch.Generator().manual_seed(3))).to(torch.bfloat16)
    rope = RotaryEmbedding(64, RopeConfig(theta=10000.0))
    cos, sin = rope.cos_sin(torch.arange(64) * 37)
    got = apply_rope(x, cos, sin)
    x1, x2 = x[..., :32].double(), x[..., 32:].double()
    exact = torch.cat([x1 * cos.double()[:, None] - x2 * sin.double()[:, None],
                       x2 * cos.double()[:, None] + x1 * sin.double()[:, None]], -1)
    assert torch.equal(got, exact.float().to(torch.bfloat16))
