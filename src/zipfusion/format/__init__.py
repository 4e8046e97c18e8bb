"""The lossless BF16 KV page format (docs/format.md): the torch reference codec that defines the
bytes; the Triton codec (:mod:`.triton_codec`) writes the same bytes on the GPU."""

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
