"""Text in and out for a Hugging Face model directory: its `tokenizer.json`, read with `tokenizers`."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

TOKENIZER_FILE = "tokenizer.json"


class TextTokenizer:
    """Encodes as transformers' fast tokenizer does by default (special tokens such as BOS
    added by the file's post-processor); decodes without special tokens."""

    def __init__(self, path: str | Path):
        from tokenizers import Tokenizer

        try:
            self._tokenizer = Tokenizer.from_file(str(path))
        except Exception as e:  # the Rust side raises its own exception type
            raise ValueError(f"tokenizer {str(path)!r}: cannot read it: {e}") from e
        self.path = Path(path)

    def encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=True).ids

    def decode(self, token_ids: list[int]) -> str:
        return self._tokenizer.decode(token_ids, skip_special_tokens=True)


def load_tokenizer(model_dir: Optional[str | Path]) -> Optional[TextTokenizer]:
    """The tokenizer of `model_dir`, or None when there is no directory or no tokenizer.json."""
    if not model_dir:
        return None
    path = Path(model_dir) / TOKENIZER_FILE
    return TextTokenizer(path) if path.is_file() else None
