"""Tokenizer loading: transformers' AutoTokenizer (a folder with tokenizer_config.json, or a
.gguf file's metadata), else a bare tokenizer.json through ``tokenizers``."""

from __future__ import annotations

from pathlib import Path


class Tokenizer:
    """encode / decode / chat template over either backend."""

    def __init__(self, folder: str | Path, chat_template: str | Path | None = None):
        """``chat_template``: a file whose Jinja template replaces the tokenizer's."""
        folder = Path(folder)
        self._hf = None
        self._tok = None
        if folder.name.lower().endswith(".gguf") and folder.is_file():
            self._hf = _gguf_tokenizer(folder)
        elif (folder / "tokenizer_config.json").is_file():
            try:
                from transformers import AutoTokenizer
            except ImportError:
                raise ImportError("loading this tokenizer needs transformers: pip install -e '.[models]' "
                                  "from the zipfusion checkout") from None
            self._hf = AutoTokenizer.from_pretrained(str(folder))
        elif (folder / "tokenizer.json").is_file():
            try:
                from tokenizers import Tokenizer as RawTokenizer
            except ImportError:
                raise ImportError("loading this tokenizer needs tokenizers: pip install -e '.[models]' "
                                  "from the zipfusion checkout") from None
            self._tok = RawTokenizer.from_file(str(folder / "tokenizer.json"))
        else:
            raise FileNotFoundError(f"no tokenizer.json or tokenizer_config.json in {folder}")
        if chat_template is not None:
            if self._hf is None:
                raise ValueError(f"chat_template: the tokenizer in {folder} has no tokenizer_config.json, which "
                                 "a chat template needs; pass --tokenizer with a full tokenizer")
            self._hf.chat_template = Path(chat_template).expanduser().read_text()

    def save(self, folder: str | Path) -> None:
        """Write the tokenizer's files into ``folder`` (a GGUF file's as tokenizer.json and friends)."""
        if self._hf is not None:
            self._hf.save_pretrained(str(folder))
        else:
            self._tok.save(str(Path(folder) / "tokenizer.json"))

    def encode(self, text: str) -> list[int]:
        if not isinstance(text, str):
            raise TypeError(f"prompt must be a str, got {type(text).__name__}")
        if self._hf is not None:
            return list(self._hf.encode(text))
        return list(self._tok.encode_batch([text])[0].ids)  # the batch call tokenizes without the GIL

    def encode_plain(self, text: str) -> list[int]:
        """``encode`` without the special tokens the tokenizer adds (a BOS)."""
        if self._hf is not None:
            return list(self._hf.encode(text, add_special_tokens=False))
        return list(self._tok.encode_batch([text], add_special_tokens=False)[0].ids)

    def decode(self, ids: list[int]) -> str:
        if self._hf is not None:
            return self._hf.decode(ids, skip_special_tokens=True)
        return self._tok.decode(ids, skip_special_tokens=True)

    def encode_many(self, texts: list[str]) -> list[list[int]]:
        """``[encode(t) for t in texts]`` in one call (the Rust tokenizer's batch path)."""
        if self._hf is not None:
            return [list(ids) for ids in self._hf(list(texts), add_special_tokens=True)["input_ids"]]
        return [list(e.ids) for e in self._tok.encode_batch(list(texts))]

    def longest_token_bytes(self) -> int:
        """The most UTF-8 bytes one token stands for, plus a margin of 4: a text of more than
        ``n`` x this many bytes has more than ``n`` tokens."""
        if self._hf is not None:
            n = len(self._hf)
            texts = self._hf.batch_decode([[i] for i in range(n)], skip_special_tokens=False)
        else:
            n = self._tok.get_vocab_size(with_added_tokens=True)
            texts = self._tok.decode_batch([[i] for i in range(n)], skip_special_tokens=False)
        return max((len(t.encode("utf-8", "replace")) for t in texts), default=1) + 4

    def vocab_size(self) -> int:
        """Tokens this tokenizer knows, added and special ones included."""
        return len(self._hf) if self._hf is not None else self._tok.get_vocab_size(with_added_tokens=True)

    def to_json(self) -> str:
        """The Rust tokenizer as tokenizer.json text: what llguidance builds its token table from."""
        from copy import copy
        tok = copy(self._hf.backend_tokenizer) if self._hf is not None else copy(self._tok)
        tok.no_padding()
        tok.no_truncation()
        return tok.to_str()

    @property
    def eos_token_ids(self) -> tuple:
        if self._hf is not None and self._hf.eos_token_id is not None:
            return (int(self._hf.eos_token_id),)
        return ()

    @property
    def chat_template(self) -> str | None:
        return getattr(self._hf, "chat_template", None) if self._hf is not None else None

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None) -> str:
        if not self.chat_template:
            raise ValueError("this model's tokenizer has no chat template")
        return self._hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                            **({"tools": tools} if tools else {}))


def _gguf_tokenizer(file: Path):
    from .gguf import MissingDependencyError
    try:
        from transformers import PreTrainedTokenizerFast
    except ImportError:
        raise MissingDependencyError("loading a GGUF tokenizer needs transformers: "
                                     "pip install -e '.[models]' from the zipfusion checkout") from None
    import transformers
    level = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()          # no "converting tokenizer" chatter
    try:
# the tokenizer class alone: AutoTokenizer would parse the file again for a config
        return PreTrainedTokenizerFast.from_pretrained(str(file.parent), gguf_file=file.name)
    except (ValueError, KeyError, OSError) as e:
        raise ValueError(f"{file}: cannot build a tokenizer from the GGUF metadata: {e}") from None
    finally:
        transformers.logging.set_verbosity(level)


def load_tokenizer(folder: str | Path | None, chat_template: str | Path | None = None) -> Tokenizer | None:
    if folder is None and chat_template is not None:
        raise ValueError("chat_template given, but the model has no tokenizer; pass --tokenizer too")
    return None if folder is None else Tokenizer(folder, chat_template)
