"""The lossless BF16 KV page format (docs/format.md).

``encode_page`` / ``decode_page`` work on one page; ``page_sizes``, ``encode_pages_into`` and
``decode_pages`` are the batched forms the memory manager uses. On CUDA tensors the batched
forms run the Triton kernels of :mod:`zipfusion.format.triton_codec`; the torch reference in
:mod:`zipfusion.format.reference` defines the bytes and runs everywhere.
"""

from .layout import (BLOCK_VALUES, COMPRESSED_BLOCK_BYTES, PAGE_TOKENS, RAW_BLOCK_BYTES, RAW_MARK,
                     SUPPORTED_HEAD_DIMS, PageLayout, from_blocks, to_blocks)
from .reference import (CorruptPageError, analyze_pages, decode_page, decode_pages, encode_page,
                        encode_pages_into, page_sizes)

__all__ = [
    "BLOCK_VALUES", "COMPRESSED_BLOCK_BYTES", "PAGE_TOKENS", "RAW_BLOCK_BYTES", "RAW_MARK",
    "SUPPORTED_HEAD_DIMS", "PageLayout", "CorruptPageError", "analyze_pages", "decode_page",
    "decode_pages", "encode_page", "encode_pages_into", "page_sizes", "from_blocks", "to_blocks",
]
