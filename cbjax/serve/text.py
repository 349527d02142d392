"""Text in and out of the server: a byte tokenizer for random models, the checkpoint's for
model=hf, chat prompts, and incremental decoding for streams."""

from __future__ import annotations

import codecs
import json
from pathlib import Path
from typing import Any, Optional, Protocol, Sequence

from cbjax.core.request import eos_token_ids

# The simulator materialises no tokens (token_id None). The server then stands in this byte
# for each one: printable, a single byte, and one token again when re-tokenized by the byte
# tokenizer, so a client counting tokens from the text counts what the server generated.
FILLER_TEXT = "x"


class Tokenizer(Protocol):
    # every id the engine ends a request on as EOS (the model's eos_token_id and
    # extra_eos_token_ids: generation_config.json's list): none of them is output text
    eos_token_ids: tuple[int, ...]

    def encode(self, text: str, *, special: bool = True) -> list[int]: ...

    def decoder(self) -> "Decoder": ...

    def chat_prompt(self, messages: list[dict[str, str]]) -> str: ...

    @property
    def filler_token_id(self) -> int: ...


class Decoder(Protocol):
    def push(self, token_id: int) -> str:
        """The text this token adds (possibly empty: a multi-byte character not yet whole)."""

    def flush(self) -> str:
        """The text still held back once no token follows (U+FFFD for an incomplete character)."""


class ByteTokenizer:
    """Token id b < 256 is byte b of the UTF-8 text; no special tokens, no merges. A random
    model may sample ids from 256 up: they have no text and decode to nothing.

    Chat prompts are plain: one line `role: content` per message, then `assistant: `."""

    def __init__(self, vocab_size: int, eos_token_id: Optional[int] = None, extra_eos_token_ids: Sequence[int] = ()):
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids(eos_token_id, extra_eos_token_ids)

    def encode(self, text: str, *, special: bool = True) -> list[int]:
        return list(text.encode("utf-8"))

    def decoder(self) -> "ByteDecoder":
        return ByteDecoder()

    def chat_prompt(self, messages: list[dict[str, str]]) -> str:
        return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant: "

    @property
    def filler_token_id(self) -> int:
        return ord(FILLER_TEXT)


class ByteDecoder:
    def __init__(self) -> None:
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        if not 0 <= token_id < 256:
            return ""
        return self._utf8.decode(bytes((token_id,)))

    def flush(self) -> str:
        return self._utf8.decode(b"", final=True)


class HFTokenizer:
    """A checkpoint's tokenizer.json (through `tokenizers`), with its chat template when it has
    one (chat_template.jinja, else tokenizer_config.json's; rendered with jinja2, as
    transformers does)."""

    def __init__(self, model_dir: str | Path, eos_token_id: Optional[int], extra_eos_token_ids: Sequence[int] = ()):
        from tokenizers import Tokenizer as RustTokenizer

        path = Path(model_dir) / "tokenizer.json"
        try:
            self._tok = RustTokenizer.from_file(str(path))
        except Exception as e:  # the Rust side raises its own exception type
            raise ValueError(f"tokenizer {str(path)!r}: cannot read it: {e}") from e
        self.eos_token_ids = eos_token_ids(eos_token_id, extra_eos_token_ids)
        self._template, self._special = _chat_template(Path(model_dir))

    def encode(self, text: str, *, special: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=special).ids

    def decode(self, token_ids: list[int]) -> str:
        return self._tok.decode(token_ids, skip_special_tokens=True)

    def decoder(self) -> "WindowDecoder":
        return WindowDecoder(self)

    def chat_prompt(self, messages: list[dict[str, str]]) -> str:
        if self._template is None:
            return ByteTokenizer.chat_prompt(self, messages)  # type: ignore[arg-type]
        return self._template.render(messages=messages, add_generation_prompt=True, **self._special)

    @property
    def filler_token_id(self) -> int:
        ids = self.encode(FILLER_TEXT, special=False)
        return ids[0] if ids else 0


class WindowDecoder:
    """Incremental decoding for tokenizers whose tokens' text depends on their neighbours
    (a leading-space marker, byte fallback): decode the tokens since the last emitted text's
    context with and without the new ones and emit the difference, holding it back while it
    ends in half a character."""

    def __init__(self, tok: HFTokenizer):
        self.tok = tok
        self.ids: list[int] = []
        self.prefix = 0  # ids[prefix:read] is the context the last emitted text was cut from
        self.read = 0

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        before = self.tok.decode(self.ids[self.prefix : self.read])
        after = self.tok.decode(self.ids[self.prefix :])
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return after[len(before) :]

    def flush(self) -> str:
        before = self.tok.decode(self.ids[self.prefix : self.read])
        after = self.tok.decode(self.ids[self.prefix :])
        self.prefix = self.read = len(self.ids)
        return after[len(before) :]


def _chat_template(model_dir: Path) -> tuple[Any, dict[str, Any]]:
    """The checkpoint's chat template compiled in a jinja2 sandbox, and the special tokens it
    may name (tokenizer_config.json's); (None, {}) when the checkpoint has none. The template
    is chat_template.jinja, where transformers saves it since 4.50 (and which wins there too),
    else tokenizer_config.json's `chat_template`."""
    path = model_dir / "tokenizer_config.json"
    config = json.loads(path.read_text()) if path.is_file() else {}
    jinja = model_dir / "chat_template.jinja"
    source = jinja.read_text() if jinja.is_file() else config.get("chat_template")
    if isinstance(source, list):  # named templates: the default one
        source = next((t["template"] for t in source if t.get("name") == "default"), None)
    if not source:
        return None, {}
    return _template_environment().from_string(source), _special_tokens(config)


def _template_environment() -> Any:
    """A jinja2 sandbox with what transformers' `apply_chat_template` gives a template, so that
    a checkpoint's template renders the prompt transformers renders: loop controls (`break`,
    `continue`), the `generation` block (its body, rendered as is), `tojson` as json.dumps
    (no HTML escaping, non-ASCII kept), `strftime_now` (today's date, which Llama 3's templates
    put in the system prompt) and `raise_exception`."""
    from datetime import datetime

    from jinja2 import nodes
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):
        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller: Any) -> str:
            return caller()

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[Generation, loopcontrols])

    def raise_exception(message: str) -> None:
        raise ValueError(f"chat template: {message}")

    def tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


def _special_tokens(config: dict[str, Any]) -> dict[str, str]:
    """The special tokens a template may name, from tokenizer_config.json."""
    special = {}
    for key in ("bos_token", "eos_token", "unk_token", "pad_token"):
        value = config.get(key)
        if isinstance(value, dict):
            value = value.get("content")
        special[key] = value or ""
    return special


def load_tokenizer(model_path: Optional[str], vocab_size: int, eos_token_id: Optional[int],
                   extra_eos_token_ids: Sequence[int] = ()) -> Tokenizer:  # fmt: skip
    """The checkpoint's tokenizer with model.path and a tokenizer.json, else the byte tokenizer;
    either knows the model's EOS ids (the engine's), whose text is not output."""
    if model_path and (Path(model_path) / "tokenizer.json").is_file():
        return HFTokenizer(model_path, eos_token_id, extra_eos_token_ids)
    return ByteTokenizer(vocab_size, eos_token_id, extra_eos_token_ids)


def byte_tokenizer_json() -> str:
    """ByteTokenizer as a Hugging Face tokenizer.json (byte-level BPE with no merges: token id
    b is byte b), so standard clients that count tokens with a tokenizer (AIPerf, vLLM's
    benchmark) count what the server counts."""
    from tokenizers import Tokenizer as RustTokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()  # the 256 printable stand-ins, in no order
    table = _byte_to_unicode()
    assert sorted(alphabet) == sorted(table.values())
    vocab = {table[b]: b for b in range(256)}
    tok = RustTokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return tok.to_str()


def _byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map of bytes to printable characters (what ByteLevel pre-tokenizes to)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars = {b: chr(b) for b in printable}
    n = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + n)
            n += 1
    return chars


def write_hf_tokenizer(snapshot_dir: str | Path) -> None:
    """Write the byte tokenizer as a Hugging Face model directory's tokenizer files."""
    out = Path(snapshot_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "tokenizer.json").write_text(byte_tokenizer_json())
    (out / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 1 << 20}))
