"""The lossless BF16 weight format (docs/format.md, "Weights"): the torch reference defining the bits
the weight kernels read.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

WEIGHT_BLOCK = 128        # values along K that share one base byte
GROUP = 8                 # values whose codes share one 32-bit word
ESC_ROWS = 16
MAX_BASE_HALF = 120       # b/2 + 7 <= 127: restoring never carries into the sign bit
FORMAT_VERSION = 1
ROW_CHUNK_VALUES = 1 << 24  # encoded this many values at a time


@dataclass
class CompressedWeight:
    """A BF16 matrix ``[N, K]`` in the weight format: ``lo``, ``codes`` and ``base`` planes and
    escapes sorted by (row, column), indexed by groups of ESC_ROWS rows (``esc_ptr``)."""

    shape: tuple[int, int]
    lo: torch.Tensor
    codes: torch.Tensor
    base: torch.Tensor
    esc_ptr: torch.Tensor
    esc_row: torch.Tensor
    esc_col: torch.Tensor
    esc_val: torch.Tensor

    @property
    def padded_k(self) -> int:
        return self.lo.shape[1]

    @property
    def device(self) -> torch.device:
        return self.lo.device

    @property
    def num_escapes(self) -> int:
        return self.esc_row.numel()

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors().values())

    @property
    def original_nbytes(self) -> int:
        return self.shape[0] * self.shape[1] * 2

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"lo": self.lo, "codes": self.codes, "base": self.base, "esc_ptr": self.esc_ptr,
                "esc_row": self.esc_row, "esc_col": self.esc_col, "esc_val": self.esc_val}

    def to(self, device) -> "CompressedWeight":
        return CompressedWeight(self.shape, **{k: v.to(device) for k, v in self.tensors().items()})

    def restore(self) -> torch.Tensor:
        return restore_weight(self)


def _pad_k(k: int) -> int:
    return -(-k // WEIGHT_BLOCK) * WEIGHT_BLOCK


def _bits(w: torch.Tensor) -> torch.Tensor:
    return w.contiguous().view(torch.int16).to(torch.int32) & 0xFFFF


def choose_base_half(e: torch.Tensor, nonzero: torch.Tensor) -> torch.Tensor:
    """Exponents ``e [..., WEIGHT_BLOCK]`` and nonzero mask -> each block's b/2: the even b whose
    window leaves the fewest nonzero values out (the largest among equals)."""
    hist = torch.zeros(*e.shape[:-1], 257, dtype=torch.int32, device=e.device)
    hist.scatter_add_(-1, e + 1, nonzero.to(torch.int32))
    below = torch.cumsum(hist, -1)
    b = torch.arange(0, 2 * MAX_BASE_HALF + 1, 2, device=e.device)
    inside = below[..., b + 16] - below[..., b + 2]
    return (MAX_BASE_HALF - inside.flip(-1).argmax(-1)).to(torch.int32)


def _encode_rows(bits: torch.Tensor):
    """bits [n, Kp] int32 -> (lo, codes, base, escape mask, d) of those rows."""
    n, kp = bits.shape
    e, s, lo = (bits >> 7) & 0xFF, bits >> 15, bits & 0xFF
    nonzero = (bits & 0x7FFF) != 0
    bh = choose_base_half(e.view(n, -1, WEIGHT_BLOCK), nonzero.view(n, -1, WEIGHT_BLOCK))
    b = (2 * bh).repeat_interleave(WEIGHT_BLOCK, dim=1)
    inside = nonzero & (e >= b + 2) & (e <= b + 15)
    escape = nonzero & ~inside
    d = torch.where(inside, (e - b) >> 1, 0)
    s = torch.where(escape, 0, s)
    lo = torch.where(inside, lo, 0)
    g = torch.stack([s, d], -1).view(n, kp // GROUP, 2, 4, 2)
    first, second = g[:, :, 0], g[:, :, 1]  # values j and j+4
    codes = (first[..., 0] << 7) | (second[..., 0] << 6) | (second[..., 1] << 3) | first[..., 1]
    return (lo.to(torch.uint8), codes.reshape(n, kp // 2).to(torch.uint8), bh.to(torch.uint8), escape)


def compress_weight(w: torch.Tensor) -> CompressedWeight:
    """BF16 ``[N, K]`` -> :class:`CompressedWeight` on the same device (any N, K >= 1)."""
    if w.dtype != torch.bfloat16 or w.dim() != 2:
        raise ValueError(f"compress_weight takes a 2-D bfloat16 tensor, got {w.dtype} of shape {tuple(w.shape)}")
    N, K = w.shape
    kp = _pad_k(K)
    bits = _bits(w)
    if kp != K:
        bits = torch.nn.functional.pad(bits, (0, kp - K))
    rows = max(1, ROW_CHUNK_VALUES // kp)
    lo, codes, base, esc_row, esc_col, esc_val = [], [], [], [], [], []
    for r0 in range(0, N, rows):
        chunk = bits[r0:r0 + rows]
        l, c, b, escape = _encode_rows(chunk)
        lo.append(l), codes.append(c), base.append(b)
        r, col = escape.nonzero(as_tuple=True)
        esc_row.append((r + r0).to(torch.int32)), esc_col.append(col.to(torch.int32))
        esc_val.append(chunk[r, col].to(torch.int16))
    esc_row = torch.cat(esc_row)
    groups = -(-N // ESC_ROWS)
    counts = torch.bincount(esc_row.long() // ESC_ROWS, minlength=groups)
    esc_ptr = torch.zeros(groups + 1, dtype=torch.int32, device=w.device)
    esc_ptr[1:] = torch.cumsum(counts, 0)
    return CompressedWeight((N, K), torch.cat(lo), torch.cat(codes), torch.cat(base), esc_ptr,
                            esc_row, torch.cat(esc_col), torch.cat(esc_val))


def restore_words(code_word: torch.Tensor, lo_0123: torch.Tensor, lo_4567: torch.Tensor,
                  base_half: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """One group's three words -> its four words of two BF16 values: the arithmetic every kernel
    does (``d = 0`` gives ±0)."""
    w = code_word
    t = w & 0x07070707
    hi_0123 = (w & 0x87878787) + ((((t + 0x7F7F7F7F) >> 7) & 0x01010101) * base_half)
    u = (w >> 3) & 0x07070707
    hi_4567 = ((w << 1) & 0x80808080) + u + ((((u + 0x7F7F7F7F) >> 7) & 0x01010101) * base_half)
    out = []
    for lo, hi in ((lo_0123, hi_0123), (lo_4567, hi_4567)):
        out.append((lo & 0x00FF00FF) | ((hi & 0x00FF00FF) << 8))
        out.append(((lo >> 8) & 0x00FF00FF) | (hi & 0xFF00FF00))
    return tuple(out)


def restore_rows(cw: CompressedWeight, rows: torch.Tensor | None = None) -> torch.Tensor:
    """The BF16 rows ``rows`` (all by default) of ``cw``, bit for bit, in torch (any device)."""
    if rows is not None:
        uniq, inverse = rows.to(cw.device).long().unique(return_inverse=True)
        return _restore(cw, uniq)[inverse]
    return _restore(cw, torch.arange(cw.shape[0], device=cw.device))


def _restore(cw: CompressedWeight, idx: torch.Tensor) -> torch.Tensor:
    n, kp = idx.numel(), cw.padded_k
    lo = cw.lo[idx].view(n, kp // GROUP, 2, 4).to(torch.int64)
    shifts = torch.tensor([0, 8, 16, 24], device=cw.device)
    lo_words = (lo << shifts).sum(-1)
    code = cw.codes[idx].view(n, kp // GROUP, 4).to(torch.int64)
    code_word = (code << shifts).sum(-1)
    bh = cw.base[idx].to(torch.int64).repeat_interleave(WEIGHT_BLOCK // GROUP, dim=1)
    p02, p13, p46, p57 = restore_words(code_word, lo_words[..., 0], lo_words[..., 1], bh)
    half = lambda p, k: (p >> (16 * k)) & 0xFFFF                            # noqa: E731
    vals = torch.stack([half(p02, 0), half(p13, 0), half(p02, 1), half(p13, 1),
                        half(p46, 0), half(p57, 0), half(p46, 1), half(p57, 1)], -1)
    bits = vals.reshape(n, kp)
    if cw.num_escapes:
        pos = torch.full((cw.shape[0],), -1, dtype=torch.int64, device=cw.device)
        pos[idx] = torch.arange(n, device=cw.device)
        at = pos[cw.esc_row.long()]
        keep = at >= 0
        bits[at[keep], cw.esc_col.long()[keep]] = cw.esc_val.to(torch.int64)[keep] & 0xFFFF
    bits = bits[:, :cw.shape[1]]
    return torch.where(bits >= 0x8000, bits - 0x10000, bits).to(torch.int16).view(torch.bfloat16)


def restore_weight(cw: CompressedWeight) -> torch.Tensor:
    """The whole BF16 ``[N, K]`` matrix, bit for bit, row chunks at a time."""
    N, kp = cw.shape[0], cw.padded_k
    rows = max(1, ROW_CHUNK_VALUES // (8 * kp))
    out = torch.empty(cw.shape, dtype=torch.bfloat16, device=cw.device)
    for r0 in range(0, N, rows):
        r = torch.arange(r0, min(N, r0 + rows), device=cw.device)
        out[r0:r0 + r.numel()] = restore_rows(cw, r)
    return out
