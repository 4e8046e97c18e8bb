"""Structured output (vLLM's guided decoding) through llguidance: a matcher per request fills a
bitmask of allowed tokens on the CPU behind the forward, applied to the logits on their device;
each sampled token is fed back, and a complete grammar allows only end-of-sequence.
"""

from __future__ import annotations

import functools
import json
import threading

import torch

from ..config import GUIDED_FIELDS

# JSON defaults: no whitespace between tokens (a small model can emit it forever)
JSON_DEFAULTS = {"whitespace_flexible": False}
INSTALL_HINT = "structured output needs llguidance: pip install llguidance (or the zipfusion 'server' extra)"


def guide_of(params) -> tuple[str, str] | None:
    """(kind, text) of a SamplingParams' grammar, or None."""
    if params.guided_json is not None:
        g = params.guided_json
        return "json", g if isinstance(g, str) else json.dumps(g, sort_keys=True)
    if params.guided_regex is not None:
        return "regex", params.guided_regex
    if params.guided_choice is not None:
        return "choice", json.dumps(list(params.guided_choice))
    if params.guided_grammar is not None:
        return "grammar", params.guided_grammar
    return None


def check_guided(params) -> None:
    """SamplingParams' guided fields: at most one, each of its type (ValueError otherwise)."""
    given = [n for n in GUIDED_FIELDS if getattr(params, n) is not None]
    if len(given) > 1:
        raise ValueError(f"give at most one of {', '.join(GUIDED_FIELDS)} (got {', '.join(given)})")
    g = params.guided_json
    if g is not None:
        if isinstance(g, str):
            try:
                g = json.loads(g)
            except ValueError as exc:
                raise ValueError(f"guided_json is not valid JSON ({exc}); give a JSON schema") from None
        if not isinstance(g, (dict, bool)):
            raise ValueError(f"guided_json must be a JSON schema (an object), got {type(g).__name__}")
    for name in ("guided_regex", "guided_grammar"):
        v = getattr(params, name)
        if v is not None and (not isinstance(v, str) or not v):
            raise ValueError(f"{name} must be a non-empty string")
    c = params.guided_choice
    if c is not None and (isinstance(c, str) or not isinstance(c, (list, tuple)) or not c
                          or not all(isinstance(s, str) and s for s in c)):
        raise ValueError("guided_choice must be a non-empty list of non-empty strings")


class GrammarCompiler:
    """One engine's grammars: the tokenizer as llguidance's, compiled grammars cached, a matcher
    per request, the batch's bitmask."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids):
        self.tokenizer, self.vocab_size, self.eos = tokenizer, vocab_size, sorted(eos_token_ids)
        self._ll = self._executor = None
        self._lock = threading.Lock()
        self.grammar = functools.lru_cache(maxsize=256)(self._grammar)

    def _llguidance(self):
        try:
            import llguidance
        except ImportError:
            raise ValueError(INSTALL_HINT) from None
        return llguidance

    def lltokenizer(self):
        with self._lock:
            if self._ll is None:
                if self.tokenizer is None:
                    raise ValueError("structured output needs the model's tokenizer; this model has none")
                llg = self._llguidance()
                n = max(self.vocab_size, self.tokenizer.vocab_size())
                try:
                    self._ll = llg.LLTokenizer(self.tokenizer.to_json(), n_vocab=n, eos_token=self.eos or None)
                except TypeError:            # llguidance before 1.9 takes one EOS id
                    self._ll = llg.LLTokenizer(self.tokenizer.to_json(), n_vocab=n,
                                               eos_token=self.eos[0] if self.eos else None)
                self._executor = llg.LLExecutor()
            return self._ll

    def _grammar(self, kind: str, text: str) -> str:
        """The llguidance grammar of (kind, text), checked (ValueError naming the field)."""
        llg = self._llguidance()
        field = f"guided_{kind}"
        try:
            if kind == "json":
                grammar = llg.LLMatcher.grammar_from_json_schema(text, defaults=JSON_DEFAULTS)
            else:
                grammar = llg.grammar_from(kind, text)
        except ValueError as exc:
            raise ValueError(f"{field}: {exc}") from None
        err = llg.LLMatcher.validate_grammar(grammar, self.lltokenizer())
        if err:
            raise ValueError(f"{field} cannot be compiled: {err}")
        return grammar

    def matcher(self, params):
        """A fresh matcher for ``params``' grammar, or None when it has none."""
        guide = guide_of(params)
        if guide is None:
            return None
        grammar = self.grammar(*guide)
        m = self._llguidance().LLMatcher(self.lltokenizer(), grammar, log_level=0)
        if m.is_error():
            raise ValueError(f"guided_{guide[0]} cannot be compiled: {m.get_error()}")
        return m

    def bitmask(self, matchers: list, pin: bool) -> torch.Tensor:
        """int32 [len(matchers), words]: bit j of row i is set when token j may come next."""
        words = (self._ll.vocab_size + 31) // 32
        mask = torch.empty(len(matchers), words, dtype=torch.int32, pin_memory=pin)
        self._executor.unsafe_compute_mask_ptr([(m, i) for i, m in enumerate(matchers)], mask.data_ptr(),
                                               words * 4, len(matchers))
        return mask

    @staticmethod
    def accept(matcher, token: int) -> bool:
        """Feed the sampled token; False when the grammar refused it (a matcher error)."""
        return matcher.consume_token(token)


def apply_bitmask(logits: torch.Tensor, rows: list[int], mask: torch.Tensor) -> torch.Tensor:
    """A copy of ``logits`` with -inf wherever the rows' bitmask has a 0 bit."""
    dev, V = logits.device, logits.shape[1]
    m = mask.to(dev, non_blocking=True)
    bits = (m.unsqueeze(-1) >> torch.arange(32, device=dev, dtype=torch.int32)) & 1
    allowed = bits.reshape(len(rows), -1)[:, :V].bool()
    out = logits.clone()
    idx = torch.tensor(rows).to(dev, non_blocking=True)
    out[idx] = out[idx].masked_fill(~allowed, float("-inf"))
    return out
