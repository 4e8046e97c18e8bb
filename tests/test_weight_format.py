"""The weight format's torch reference: every bit pattern restored, every block compressed."""

import pytest
import torch

from zipfusion.format.weights import (ESC_ROWS, WEIGHT_BLOCK, compress_weight, restore_rows,
                                      restore_weight)

SPECIALS = [0.0, -0.0, float("inf"), float("-inf"), float("nan"), 1e-40, -1e-39, 3e38, 1e-20, -7.0]


def _bits(t):
    return t.view(torch.int16)


def _adversarial(n, k, seed, scale=0.02, share=0.02):
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=g) * scale).bfloat16()
    flat = w.view(-1)
    idx = torch.randint(0, flat.numel(), (max(1, int(flat.numel() * share)),), generator=g)
    sp = torch.tensor(SPECIALS).bfloat16()
    flat[idx] = sp[torch.randint(0, len(sp), idx.shape, generator=g)]
    return w


@pytest.mark.parametrize("n,k", [(1, 1), (5, 7), (33, 576), (64, 4096), (17, WEIGHT_BLOCK + 8)])
def test_round_trip_adversarial(n, k):
    w = _adversarial(n, k, seed=n * 1000 + k)
    cw = compress_weight(w)
    assert cw.padded_k % WEIGHT_BLOCK == 0 and cw.lo.shape == (n, cw.padded_k)
    assert torch.equal(_bits(restore_weight(cw)), _bits(w))


def test_every_bit_pattern():
    w = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).view(256, 256)
    cw = compress_weight(w)
    assert torch.equal(_bits(restore_weight(cw)), _bits(w))
    assert cw.num_escapes > 0


def test_gaussian_ratio_and_escapes_indexed_by_row_group():
    w = (torch.randn(256, 1024, generator=torch.Generator().manual_seed(1)) * 0.02).bfloat16()
    cw = compress_weight(w)
    assert cw.nbytes / cw.original_nbytes < 0.77
    ptr, rows = cw.esc_ptr.tolist(), cw.esc_row.tolist()
    for g in range(len(ptr) - 1):
        assert all(r // ESC_ROWS == g for r in rows[ptr[g]:ptr[g + 1]])


def test_restore_rows_gathers_with_escapes():
    w = _adversarial(40, 300, seed=3, share=0.05)
    cw = compress_weight(w)
    rows = torch.tensor([39, 0, 7, 7, 21])
    assert torch.equal(_bits(restore_rows(cw, rows)), _bits(w[rows]))


def test_refuses_other_dtypes_and_shapes():
    with pytest.raises(ValueError, match="2-D bfloat16"):
        compress_weight(torch.zeros(4, 4))
    with pytest.raises(ValueError, match="2-D bfloat16"):
        compress_weight(torch.zeros(4, dtype=torch.bfloat16))
