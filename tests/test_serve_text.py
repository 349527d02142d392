"""The server's text: the byte tokenizer and its tokenizer.json twin, incremental decoding, and a
checkpoint's tokenizer and chat template (served on the simulator: config.json is all it reads)."""

from __future__ import annotations

import json

import openai
import pytest
from tokenizers import Tokenizer

from test_serve import rows, running
from cbjax.serve.text import ByteTokenizer, HFTokenizer, byte_tokenizer_json, write_hf_tokenizer

TEXTS = ["hello world", "héllo wörld ✓ 日本", "tabs\tand\nnewlines", "x" * 40]
TEMPLATE = ("{{ bos_token }}{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</{{ m['role'] }}>{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")  # fmt: skip


def test_the_tokenizer_json_counts_as_the_byte_tokenizer_does():
    byte, twin = ByteTokenizer(512), Tokenizer.from_str(byte_tokenizer_json())
    for text in TEXTS:
        ids = byte.encode(text)
        assert ids == list(text.encode("utf-8")) == twin.encode(text).ids
        assert twin.decode(ids) == text


def test_incremental_decoding_emits_each_character_once_it_is_whole(tmp_path):
    write_hf_tokenizer(tmp_path)
    for tok in (ByteTokenizer(512), HFTokenizer(tmp_path, eos_token_id=None)):
        for text in TEXTS:
            dec = tok.decoder()
            pieces = [dec.push(t) for t in tok.encode(text)]
            assert "".join(pieces) == text
            assert not any("\ufffd" in p for p in pieces)  # half a character is held, not sent
            if "é" in text:
                assert "" in pieces  # the first byte of a two-byte character waited


def checkpoint(path, template: bool, jinja: bool = False):
    """A Llama config.json and the byte tokenizer's files: what the simulator and server read.
    The template goes in tokenizer_config.json, or (`jinja`) in chat_template.jinja beside it,
    where transformers saves it since 4.50."""
    write_hf_tokenizer(path)
    config = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 256, "hidden_size": 64,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128,
              "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "hidden_act": "silu"}  # fmt: skip
    (path / "config.json").write_text(json.dumps(config))
    if template:
        tok_config = json.loads((path / "tokenizer_config.json").read_text())
        tok_config.update(bos_token={"content": "<s>"})
        if jinja:
            (path / "chat_template.jinja").write_text(TEMPLATE)
        else:
            tok_config.update(chat_template=TEMPLATE)
        (path / "tokenizer_config.json").write_text(json.dumps(tok_config))


def test_the_chat_template_is_read_from_chat_template_jinja(tmp_path):
    checkpoint(tmp_path, template=True, jinja=True)
    assert "chat_template" not in json.loads((tmp_path / "tokenizer_config.json").read_text())
    messages = [{"role": "user", "content": "hi"}]
    assert HFTokenizer(tmp_path, eos_token_id=None).chat_prompt(messages) == "<s><user>hi</user><assistant>"


def test_a_checkpoint_serves_with_its_tokenizer_and_chat_template(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    checkpoint(model, template=True)
    messages = [{"role": "system", "content": "terse"}, {"role": "user", "content": "héllo"}]
    rendered = "<s><system>terse</system><user>héllo</user><assistant>"
    with running(tmp_path / "run", "model=hf", f"model.path={model}") as (base, srv):
        assert srv.state.tokenizer.chat_prompt(messages) == rendered
        client = openai.OpenAI(base_url=base, api_key="unused")
        r = client.chat.completions.create(model="hf", messages=messages, max_tokens=3)
        assert r.usage.prompt_tokens == len(rendered.encode("utf-8")) and r.choices[0].message.content == "xxx"
        r = client.completions.create(model="hf", prompt="ab", max_tokens=2, stream=False)
        assert r.usage.prompt_tokens == 2
    assert [row["prompt_len"] for row in rows(tmp_path / "run")] == [len(rendered.encode("utf-8")), 2]


def test_a_checkpoint_without_a_template_uses_the_plain_chat_format(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    checkpoint(model, template=False)
    with running(None, "model=hf", f"model.path={model}") as (base, srv):
        r = openai.OpenAI(base_url=base, api_key="unused").chat.completions.create(
            model="hf", messages=[{"role": "user", "content": "hi"}], max_tokens=1
        )
        assert r.usage.prompt_tokens == len("user: hi\nassistant: ")


def test_the_real_engine_streams_its_own_tokens(tmp_path):
    """executor=jax, tiny random model: the text a client gets is the engine's tokens decoded,
    and greedy requests with the same prompt get the same tokens."""
    small = ["executor=jax", "scheduler.max_num_seqs=2", "scheduler.max_num_batched_tokens=32",
             "model.max_model_len=64", "cache.num_pages=16", "executor.token_buckets=[2,32]"]  # fmt: skip
    byte = ByteTokenizer(512)
    with running(tmp_path, *small) as (base, srv):
        client = openai.OpenAI(base_url=base, api_key="unused")
        streamed = "".join(c.choices[0].text for c in client.completions.create(
            model="tiny", prompt="hello", max_tokens=12, temperature=0, stream=True) if c.choices)  # fmt: skip
        again = client.completions.create(model="tiny", prompt="hello", max_tokens=12, temperature=0)
        sampled = client.completions.create(model="tiny", prompt=[1, 2, 3], max_tokens=5, temperature=1.0, seed=7)
    first, second, third = rows(tmp_path)
    assert first["output_token_ids"] == second["output_token_ids"] and len(first["output_token_ids"]) == 12
    assert streamed and streamed == again.choices[0].text == _decode(byte, first["output_token_ids"])
    assert again.usage.completion_tokens == 12 and sampled.usage.completion_tokens == len(third["output_token_ids"]) == 5


def _decode(tok: ByteTokenizer, ids: list[int]) -> str:
    dec = tok.decoder()
    return "".join(dec.push(t) for t in ids)


def _ended_output(tok, token_ids: list[int], stop_token_ids=(), stops=()) -> str:
    """The text a client is sent for `token_ids`, the last of which ended the request: the
    chunks as they come, then the end's (what the stream and the whole response both send)."""
    from cbjax.core.request import Request, SamplingParams
    from cbjax.serve.output import Output

    req = Request("r", 0.0, 1, [1], SamplingParams(max_tokens=len(token_ids), stop_token_ids=tuple(stop_token_ids)))
    out = Output(tok, req, list(stops))
    sent = "".join(out.add(t) for t in token_ids) + out.close()
    assert sent == out.text
    return sent


def test_a_character_left_incomplete_at_the_end_is_sent_as_a_whole_decode_reads_it(tmp_path):
    """Token id b is byte b: 0xC3 opens a two-byte character (é is C3 A9) that the output ends
    before completing. A decode of all the tokens reads it as U+FFFD; it is not dropped."""
    write_hf_tokenizer(tmp_path)
    for tok in (ByteTokenizer(512), HFTokenizer(tmp_path, eos_token_id=None)):
        assert _ended_output(tok, [ord("a"), 0xC3]) == "a\ufffd"  # ended by max_tokens
        assert _ended_output(tok, [ord("a"), 0xC3, ord("!")], stop_token_ids=[ord("!")]) == "a\ufffd"  # by a stop token
        assert _ended_output(tok, [ord("a"), 0xC3, 0xA9]) == "aé"  # whole: nothing held at the end
        assert _ended_output(tok, [ord("a"), ord("b"), 0xC3], stops=["b"]) == "a"  # what follows a stop string is cut


def _deltas(tok, token_ids: list[int], stops: list[str]) -> list[str]:
    """The text sent for each token as it comes, then the end's."""
    from cbjax.core.request import Request, SamplingParams
    from cbjax.serve.output import Output

    out = Output(tok, Request("r", 0.0, 1, [1], SamplingParams(max_tokens=len(token_ids))), stops)
    return [out.add(t) for t in token_ids] + [out.close()]


def test_only_text_that_may_begin_a_stop_string_is_held_back():
    """A stream holds back text while it could still be the start of a stop string, and sends
    it as soon as it cannot: text that begins no stop string is sent with its own token."""
    tok = ByteTokenizer(512)
    # "ab" begins no stop: sent at once; "<" and "</" may begin "</answer>"; "</b" cannot
    assert _deltas(tok, list(b"ab</b"), ["</answer>"]) == ["a", "b", "", "", "</b", ""]
    # the stop completes: its text is never sent, nor what follows it
    assert _deltas(tok, list(b"a</answer>z"), ["</answer>"]) == ["a"] + [""] * 11
    # "xx" may begin "xxy" until the "z" comes; the end sends what is held
    assert _deltas(tok, list(b"xxzxx"), ["xxy", "q"]) == ["", "", "xxz", "", "", "xx"]
    # "aa" may begin "aac"; the "b" completes "ab" instead: the text before it is sent
    assert _deltas(tok, list(b"aab"), ["ab", "aac"]) == ["", "", "a", ""]


def test_the_chat_template_renders_what_transformers_renders(tmp_path):
    """What transformers gives a template beyond plain jinja2: loop controls, the `generation`
    block, a `tojson` that neither HTML-escapes nor ASCII-escapes, and `strftime_now` (Llama 3's
    templates date the system prompt with it, falling back to a fixed date without it)."""
    transformers = pytest.importorskip("transformers")
    template = ("{{ bos_token }}{% for m in messages %}{% if loop.index > 2 %}{% break %}{% endif %}"
                "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}{% endgeneration %}"
                "{% else %}<{{ m['role'] }}>{{ m['content'] | tojson }}{% endif %}{% endfor %}"
                "{% if strftime_now is defined %}{{ strftime_now('%Y-%m-%d') }}{% else %}26 Jul 2024{% endif %}"
                "{% if add_generation_prompt %}<assistant>{% endif %}")  # fmt: skip
    write_hf_tokenizer(tmp_path)
    tok_config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**tok_config, "bos_token": "<s>"}))
    (tmp_path / "chat_template.jinja").write_text(template)
    messages = [{"role": "user", "content": "<é> & 'x'"}, {"role": "assistant", "content": "ok"}, {"role": "user", "content": "dropped"}]
    want = transformers.AutoTokenizer.from_pretrained(str(tmp_path)).apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    assert '"<é> & \'x\'"' in want and "26 Jul 2024" not in want and "dropped" not in want
    assert HFTokenizer(tmp_path, eos_token_id=None).chat_prompt(messages) == want


def test_no_eos_of_the_checkpoint_is_output_text(tmp_path):
    """generation_config.json lists several EOS ids; the engine ends a request on any of them,
    and none is text, as the first is not. Byte b is token b here: 33 is "!", 35 is "#"."""
    model = tmp_path / "model"
    model.mkdir()
    checkpoint(model, template=False)
    (model / "generation_config.json").write_text(json.dumps({"eos_token_id": [35, 33]}))
    with running(None, "model=hf", f"model.path={model}") as (_, srv):
        tok = srv.state.tokenizer
    assert _ended_output(tok, [ord("a"), 35]) == "a"
    assert _ended_output(tok, [ord("a"), 33]) == "a"


def test_the_serve_extra_brings_the_chat_template_renderer():
    """A checkpoint's chat template is rendered with jinja2, which none of the serve extra's
    other packages (nor the core dependencies) pulls in."""
    import re
    import tomllib
    from pathlib import Path

    project = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]
    names = {re.split(r"[\[<>=;! ]", req, maxsplit=1)[0].lower() for req in project["optional-dependencies"]["serve"]}
    assert "jinja2" in names


def test_a_message_name_reaches_the_chat_template(tmp_path):
    """OpenAI's `name` on a message (who speaks, among several users or tools) is the
    template's to render, as transformers and vLLM hand it over."""
    transformers = pytest.importorskip("transformers")
    model = tmp_path / "model"
    model.mkdir()
    checkpoint(model, template=True, jinja=True)
    tok_config = json.loads((model / "tokenizer_config.json").read_text())
    (model / "tokenizer_config.json").write_text(json.dumps({**tok_config, "bos_token": "<s>"}))
    (model / "chat_template.jinja").write_text(
        "{% for m in messages %}<{{ m['role'] }}{% if m['name'] is defined %} {{ m['name'] }}{% endif %}>"
        "{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    messages = [{"role": "user", "content": "hi", "name": "ann"}, {"role": "user", "content": "yo"}]
    want = transformers.AutoTokenizer.from_pretrained(str(model)).apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    assert want == "<user ann>hi<user>yo<assistant>"
    with running(tmp_path / "run", "model=hf", f"model.path={model}") as (base, _):
        r = openai.OpenAI(base_url=base, api_key="unused").chat.completions.create(
            model="hf", messages=messages, max_tokens=1
        )
        assert r.usage.prompt_tokens == len(want.encode("utf-8"))
