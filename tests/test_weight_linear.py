"""The weight format's kernels (kernels/weight_linear.py): the restore and the row gather bit for
bit, the fused decompress-GEMM exact where the arithmetic is exact, close to fp64 elsewhere,
deterministic; the Triton interpreter on the CPU at tiny sizes, the GPU at real sizes."""

import functools

import pytest
import torch
from hypothesis import given, settings, strategies as st

from helpers import adversarial_weight
from zipfusion.format.weights import compress_weight, restore_weight
from zipfusion.kernels.weight_linear import fused_linear, gather_rows, restore_into, weight_linear

GPU = pytest.mark.gpu


def _bits(t):
    return t.view(torch.int16)


def _integer_weight(n, k, seed):
    """Small integers (and ±0) with rare ±2^18 outliers that escape: every product and partial
    sum of x in {-2..2} times it is exact in fp32, whatever the order."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randint(-64, 65, (n, k), generator=g).float()
    w[torch.rand(n, k, generator=g) < 0.1] = -0.0
    out = torch.rand(n, k, generator=g) < 0.01
    w[out] = torch.where(torch.rand(n, k, generator=g) < 0.5, 2.0 ** 18, -2.0 ** 18)[out]
    return w.bfloat16()


def _int_x(m, k, seed, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-2, 3, (m, k), generator=g).bfloat16().to(device)


def _exact(x, w, bias=None):
    """x Wᵀ (+ bias) in fp64; a zero sum as +0 (the kernel also sums the +0 products of K's
    padding, so a sum of -0 products comes out +0)."""
    y = x.double() @ w.double().T + 0.0
    return (y if bias is None else y + bias.double()).bfloat16()


@pytest.mark.parametrize("n,k", [(40, 300), (17, 128), (3, 1000)])
@pytest.mark.parametrize("m", [1, 5, 19])
def test_fused_exact_on_exact_arithmetic(n, k, m, seed):
    w = _integer_weight(n, k, seed)
    cw = compress_weight(w)
    assert cw.num_escapes > 0
    x = _int_x(m, k, seed + 1)
    bias = torch.randint(-8, 9, (n,)).bfloat16()
    assert torch.equal(_bits(fused_linear(x, cw)), _bits(_exact(x, w)))
    assert torch.equal(_bits(fused_linear(x, cw, bias)), _bits(_exact(x, w, bias)))


@pytest.mark.parametrize("split,reduce", [(2, 1), (3, 2), (2, 2)])
def test_fused_split_k_exact_and_deterministic(split, reduce, seed):
    """Split-K partials summed by the reduce kernel (1) or the tile's last program (2), in a fixed
    order; the tile counters are left zero for the next launch."""
    from zipfusion.kernels.weight_linear import _counters
    w = _integer_weight(33, 400, seed)
    cw, x = compress_weight(w), _int_x(7, 400, seed + 1)
    bias = torch.randint(-8, 9, (33,)).bfloat16()
    a = fused_linear(x, cw, bias, split=split, reduce=reduce)
    assert torch.equal(_bits(a), _bits(_exact(x, w, bias)))
    assert torch.equal(_bits(a), _bits(fused_linear(x, cw, bias, split=split, reduce=reduce)))
    assert not _counters(x.device).any()


@pytest.mark.parametrize("kw", [dict(natural=False, swap=False), dict(swap=True, BN=32, split=2),
                                dict(swap=True, BN=32, split=2, ech=64)])
def test_fused_loads_exact(kw, seed):
    """Both word orders and dot orientations, K split; escapes 16 or 64 a dot."""
    w = _integer_weight(40, 300, seed)
    cw, x = compress_weight(w), _int_x(5, 300, seed + 1)
    assert torch.equal(_bits(fused_linear(x, cw, **kw)), _bits(_exact(x, w)))


@pytest.mark.parametrize("natural,swap", [(True, True), (False, False)])
def test_fused_gaussian_close_to_fp64(natural, swap, seed):
    w = adversarial_weight(24, 260, seed, share=0.01)
    w[~(w.abs() < 1e4)] = 3.0                 # finite outliers: fp64 is the reference
    cw = compress_weight(w)
    x = torch.randn(6, 260, generator=torch.Generator().manual_seed(seed)).bfloat16()
    y = fused_linear(x, cw, natural=natural, swap=swap).double()
    ref = x.double() @ w.double().T
    assert ((y - ref).norm() / ref.norm()).item() < 8e-3


def test_fused_inf_nan_weights_propagate():
    """NaN/inf weights, escaped or inside a block's window (b = 240), propagate as in fp64."""
    w = torch.randn(32, 256).bfloat16() * 0.02
    w[3, 5], w[7, 200], w[9, 17] = float("inf"), float("nan"), float("-inf")
    w[20, :128] = torch.ldexp(torch.ones(128), torch.randint(115, 126, (128,))).bfloat16()
    w[20, 64] = float("inf")                        # inside the window of base 240: no escape
    cw = compress_weight(w)
    assert cw.base[20, 0].item() == 120
    x = torch.rand(4, 256).bfloat16() * 1e-30 + 1e-31
    y, ref = fused_linear(x, cw).double(), x.double() @ w.double().T
    assert torch.equal(torch.isnan(y), torch.isnan(ref)) and torch.equal(torch.isinf(y), torch.isinf(ref))
    assert torch.equal(y[torch.isinf(y)], ref[torch.isinf(ref)])


def test_fused_into_given_rows(seed):
    """``out=``: the result lands in the given rows (a block of a larger output), bit for bit."""
    w = _integer_weight(24, 256, seed)
    cw = compress_weight(w)
    x = _int_x(9, 256, seed + 1)
    full = torch.full((20, 24), 7.0, dtype=torch.bfloat16)
    assert fused_linear(x, cw, out=full[5:14]).data_ptr() == full[5:14].data_ptr()
    assert torch.equal(_bits(full[5:14]), _bits(_exact(x, w)))
    assert (full[:5] == 7).all() and (full[14:] == 7).all()


def test_fused_empty_and_leading_dims():
    cw = compress_weight(torch.randn(20, 130).bfloat16())
    assert fused_linear(torch.zeros(0, 130, dtype=torch.bfloat16), cw).shape == (0, 20)
    x = torch.randn(2, 3, 130).bfloat16()
    assert fused_linear(x, cw).shape == (2, 3, 20)
    with pytest.raises(ValueError, match=r"bfloat16 tensor \[..., 130\]"):
        fused_linear(torch.zeros(2, 129, dtype=torch.bfloat16), cw)


@pytest.mark.parametrize("n,k", [(16, 128), (37, 300), (5, 7), (1, 1000)])
def test_restore_and_gather_bit_identical(n, k, seed):
    w = adversarial_weight(n, k, seed, share=0.05)
    w[n // 2, :] = torch.tensor(1e30).bfloat16()            # a row of escapes (the block's base is capped)
    w[n // 2, ::3] = 1e-3
    cw = compress_weight(w)
    out = torch.full((n, k), float("nan"), dtype=torch.bfloat16)
    assert torch.equal(_bits(restore_into(cw, out)), _bits(w))
    ids = torch.randint(0, n, (9,), generator=torch.Generator().manual_seed(seed))
    ids[0] = n // 2
    assert torch.equal(_bits(gather_rows(cw, ids, kernel=True)), _bits(w[ids]))      # the Triton kernel
    assert torch.equal(_bits(gather_rows(cw, ids)), _bits(w[ids]))                   # torch on the CPU
    assert gather_rows(cw, ids[:0], kernel=True).shape == (0, k)


def test_weight_linear_cpu_is_f_linear_bit_for_bit(seed):
    w = adversarial_weight(30, 200, seed)
    cw = compress_weight(w)
    x, b = torch.randn(0 + 4, 200).bfloat16(), torch.randn(30).bfloat16()
    assert torch.equal(_bits(weight_linear(x, cw, b)), _bits(torch.nn.functional.linear(x, w, b)))
    assert weight_linear(x[:0], cw).shape == (0, 30)


@settings(max_examples=4, deadline=None)
@given(n=st.integers(1, 40), k=st.integers(1, 300), m=st.integers(1, 20), share=st.floats(0, 0.2),
       seed=st.integers(0, 2 ** 16))
def test_hypothesis_random_shapes(n, k, m, share, seed):
    w = adversarial_weight(n, k, seed, share=share)
    cw = compress_weight(w)
    assert torch.equal(_bits(restore_into(cw, torch.empty(n, k, dtype=torch.bfloat16))), _bits(w))
    wi = _integer_weight(n, k, seed)
    x = _int_x(m, k, seed)
    assert torch.equal(_bits(fused_linear(x, compress_weight(wi))), _bits(_exact(x, wi)))


# ---------------------------------------------------------------------------------------- GPU
SHAPES = [(6144, 4096), (4096, 14336), (1000, 4100), (1000, 4104)]
SM90 = dict(sm90=True, BK=128, BN=64, warps=4, stages=3)          # the Hopper kernel (Gluon)


@GPU
@pytest.mark.parametrize("n,k", SHAPES)
def test_gpu_restore_and_gather(n, k):
    w = adversarial_weight(n, k, seed=n + k, share=0.001).cuda()
    cw = compress_weight(w)
    out = torch.empty_like(w)
    assert torch.equal(_bits(restore_into(cw, out)), _bits(w))
    assert torch.equal(_bits(restore_weight(cw)), _bits(w))
    ids = torch.randint(0, n, (300,), device="cuda")
    assert torch.equal(_bits(gather_rows(cw, ids)), _bits(w[ids]))


@functools.lru_cache(maxsize=3)
def _gpu_weights(n, k):
    """(integer weight, its compressed form, Gaussian weight with outliers, its compressed form)."""
    wi = _integer_weight(n, k, seed=n).cuda()
    w = (torch.randn(n, k, device="cuda") * 0.02).bfloat16()
    w.view(-1)[torch.randint(0, n * k, (50,), device="cuda")] = 3.0
    return wi, compress_weight(wi), w, compress_weight(w)


@GPU
@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("m", [1, 8, 32, 64, 100, 256, 600])
@pytest.mark.parametrize("kw", [{}, dict(sm90=False), dict(sm90=False, natural=False, swap=False),
                                dict(SM90, split=1), dict(SM90, BN=128, warps=8, stages=2)])
def test_gpu_fused_exact_and_close(n, k, m, kw):
    wi, cwi, w, cw = _gpu_weights(n, k)
    x = _int_x(m, k, seed=m + 1, device="cuda")
    if kw.get("sm90", True) and torch.cuda.get_device_capability()[0] == 9:
        from zipfusion.kernels import weight_gemm_sm90
        assert weight_gemm_sm90.supported(x, cwi) == (k % 8 == 0)
    a = fused_linear(x, cwi, **kw)
    assert torch.equal(_bits(a), _bits(_exact(x, wi)))
    assert torch.equal(_bits(a), _bits(fused_linear(x, cwi, **kw)))
    xg = torch.randn(m, k, device="cuda").bfloat16()
    bias = torch.randn(n, device="cuda").bfloat16()
    ref = xg.double() @ w.double().T + bias.double()
    for y in (fused_linear(xg, cw, bias, **kw), weight_linear(xg, cw, bias)):
        assert ((y.double() - ref).norm() / ref.norm()).item() < 5e-3


@GPU
def test_gpu_cuda_graph_capture():
    """warmup builds every variant the dispatch launches (biased or not): capture compiles nothing."""
    from zipfusion.kernels import weight_linear as wl
    w = (torch.randn(4096, 4096, device="cuda") * 0.02).bfloat16()
    cw = compress_weight(w)
    bias = torch.randn(4096, device="cuda").bfloat16()
    wl.warmup([(cw, None), (cw, bias)], 1024)
    cache = wl._module(cw.device)._fused_kernel.device_caches[torch.cuda.current_device()][0]
    built = len(cache)
    xs = [torch.randn(m, 4096, device="cuda").bfloat16() for m in (3, 20, 64, 100, 1024)]
    eager = [weight_linear(x, cw, b) for x in xs for b in (None, bias)]
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        outs = [weight_linear(x, cw, b) for x in xs for b in (None, bias)]
    g.replay()
    torch.cuda.synchronize()
    assert len(cache) == built
    for a, b in zip(outs, eager):
        assert torch.equal(_bits(a), _bits(b))


@GPU
def test_gpu_vocabulary_sized_weight_runs_fused_in_row_blocks():
    """A weight above RESTORE_MAX_VALUES never gets a restore buffer: M > FUSED_MAX_M runs the
    fused kernel over blocks of rows, each block's bits those of a lone fused call."""
    from zipfusion.kernels import weight_linear as wl
    n = wl.RESTORE_MAX_VALUES // 2048 + 16
    w = (torch.randn(n, 2048, device="cuda") * 0.02).bfloat16()
    cw = compress_weight(w)
    del w
    wl.warmup([(cw, None)], 512)
    assert wl._BUFFERS.get(cw.device) is None or wl._BUFFERS[cw.device].numel() < n * 2048
    x = torch.randn(300, 2048, device="cuda").bfloat16()
    y = weight_linear(x, cw)
    for i in range(0, 300, wl.FUSED_MAX_M):
        assert torch.equal(_bits(y[i:i + wl.FUSED_MAX_M]), _bits(fused_linear(x[i:i + wl.FUSED_MAX_M], cw)))
