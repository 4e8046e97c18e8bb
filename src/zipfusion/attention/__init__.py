"""Attention over the paged KV cache: the backend and its decode and prefill routes."""
