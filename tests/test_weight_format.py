"""The weight format's torch reference: every bit pattern restored, every block compressed."""

import pytest
import torch

from helpers import adversarial_weight as _adversarial
from zipfusion.format.weights import (ESC_ROWS, WEIGHT_BLOCK, compress_weight, restore_rows,
                                      restore_weight)

def _bits(t):
    return t.view(torch.int16)


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


def test_worked_example():
    """docs/format.md, weight format section 5."""
    e = torch.arange(128) % 14 + 118                                   # exponents 118..131
    bits = (e << 7) | (torch.arange(128) * 37 % 128)
    bits[0], bits[4], bits[1], bits[2] = 0xBF95, 0xC123, 0x8000, 0x7149
    w = torch.where(bits >= 0x8000, bits - 0x10000, bits).to(torch.int16).view(torch.bfloat16).view(1, 128)
    cw = compress_weight(w)
    assert cw.base[0, 0].item() == 0x3A and cw.codes[0, 0].item() == 0xFD
    assert cw.lo[0, 0].item() == 0x95 and cw.lo[0, 1].item() == 0 and cw.lo[0, 2].item() == 0
    assert cw.codes[0, 1].item() >> 7 == 1 and cw.codes[0, 1].item() & 7 == 0      # value 1: -0
    assert cw.codes[0, 2].item() >> 7 == 0 and cw.codes[0, 2].item() & 7 == 0      # value 2: +0, escaped
    assert (cw.esc_row.tolist(), cw.esc_col.tolist(), cw.esc_val.tolist()) == ([0], [2], [0x7149])
    assert torch.equal(_bits(restore_weight(cw)), _bits(w))
