"""Attention over the paged KV cache: the backend (backend.py: AttentionBackend, PagedKVCacheStep)
and its routes -- decode rows (decode.py), prefill chunks over their own K/V (prefill_open.py) or
over their request's pages (prefill_stored.py) -- and packed decode rows behind a shared prefix
(packing.py)."""
