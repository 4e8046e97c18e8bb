"""The lossless BF16 KV page format (docs/format.md).

``encode_page`` / ``decode_page`` work on one page; ``page_sizes``, ``encode_pages_into`` and
``decode_pages`` are batched forms. They are the torch reference
(:mod:`zipfusion.format.reference`), which defines the bytes and runs on any device; the
Triton kernels of :mod:`zipfusion.format.triton_codec` produce the same bytes on the GPU, and
the memory manager picks between the two (:mod:`zipfusion.memory.codec`).
"""

from .layout import (BLOCK_VALUES, COMPRESSED_BLOCK_BYTES, ESCAPE_FLAG, ESCAPED_BLOCK_BYTES,
                     MAX_ESCAPES, PAGE_TOKENS, RAW_BLOCK_BYTES, RAW_MARK, PageLayout, block_bytes,
                     from_blocks, to_blocks)
from .reference import (CorruptPageError, analyze_pages, decode_page, decode_pages, encode_page,
                        encode_pages_into, page_sizes)

__all__ = [
    "BLOCK_VALUES", "COMPRESSED_BLOCK_BYTES", "ESCAPE_FLAG", "ESCAPED_BLOCK_BYTES", "MAX_ESCAPES",
    "block_bytes", "PAGE_TOKENS", "RAW_BLOCK_BYTES", "RAW_MARK",
    "PageLayout", "CorruptPageError", "analyze_pages", "decode_page",
    "decode_pages", "encode_page", "encode_pages_into", "page_sizes", "from_blocks", "to_blocks",
]
