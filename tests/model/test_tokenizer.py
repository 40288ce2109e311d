"""Tokenizer and chat template of the default model against the golden file, and jinja conventions."""

import json
from pathlib import Path

import pytest

from folio.model.tokenizer import Tokenizer

from support import GOLDEN_PATH

REFERENCE = json.loads(GOLDEN_PATH.read_text())
CASES = REFERENCE["tokenizer_cases"]


@pytest.fixture(scope="module")
def tok(default_model_dir):
    return Tokenizer.from_pretrained(default_model_dir)


@pytest.mark.parametrize("case", CASES, ids=[repr(c["text"][:20]) for c in CASES])
def test_encode_matches_golden_ids(tok, case):
    assert tok.encode(case["text"]) == case["ids"]


@pytest.mark.parametrize("case", CASES, ids=[repr(c["text"][:20]) for c in CASES])
def test_decode_round_trips(tok, case):
    assert tok.decode(case["ids"], skip_special_tokens=False) == case["text"]


def test_decode_skips_special_tokens(tok):
    case = next(c for c in CASES if c["text"].startswith("<|im_start|>"))
    assert tok.decode(case["ids"], skip_special_tokens=True) == "user\nWhat is 2+2?\nassistant\n"


def test_special_ids_eos_and_vocab(tok):
    assert tok.all_special_ids == set(range(17))  # golden notes: ids 0..16 are control tokens
    assert tok.eos_token_ids == [REFERENCE["config"]["eos_token_id"]]
    assert tok.vocab_size == REFERENCE["config"]["vocab_size"]
    cap = REFERENCE["logits_capital"]
    assert [tok.decode([i]) for i in cap["top5_ids"]] == cap["top5_tokens"]
    assert tok.convert_ids_to_tokens([cap["top5_ids"][0], 2]) == ["\u0120Paris", "<|im_end|>"]


def test_chat_template_gives_golden_prompt_ids(tok):
    case = next(c for c in REFERENCE["greedy_cases"] if c["id"] == "e")
    text = tok.apply_chat_template(case["chat_messages"], add_generation_prompt=True)
    assert tok.encode(text) == case["prompt_ids"]
    without = tok.apply_chat_template(case["chat_messages"], add_generation_prompt=False)
    assert text == without + "<|im_start|>assistant\n"


def _folder_with_template(tmp_path, default_model_dir, template):
    (tmp_path / "tokenizer.json").write_bytes((Path(default_model_dir) / "tokenizer.json").read_bytes())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": template, "eos_token": "<|im_end|>",
                                                                "bos_token": "<|im_start|>"}))
    return Tokenizer.from_pretrained(tmp_path)


def test_template_whitespace_follows_hf_conventions(tmp_path, default_model_dir):
    # trim_blocks drops the newline after a block tag; lstrip_blocks drops indentation before one
    template = ("{{ bos_token }}{% for m in messages %}\n    {% if m.role == 'user' %}\n"
                "U: {{ m.content | tojson }}\n    {% else %}\nA: {{ m.content }}\n    {% endif %}\n{% endfor %}")
    tok = _folder_with_template(tmp_path, default_model_dir, template)
    msgs = [{"role": "user", "content": "héllo"}, {"role": "assistant", "content": "hi"}]
    assert tok.apply_chat_template(msgs) == '<|im_start|>U: "héllo"\nA: hi\n'


def test_template_raise_exception_is_value_error(tmp_path, default_model_dir):
    template = "{% if messages[0].role != 'user' %}{{ raise_exception('first message must be user') }}{% endif %}ok"
    tok = _folder_with_template(tmp_path, default_model_dir, template)
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]) == "ok"
    with pytest.raises(ValueError, match="first message must be user"):
        tok.apply_chat_template([{"role": "system", "content": "x"}])


def test_no_template_is_a_clear_error(tmp_path, default_model_dir):
    (tmp_path / "tokenizer.json").write_bytes((Path(default_model_dir) / "tokenizer.json").read_bytes())
    tok = Tokenizer.from_pretrained(tmp_path)
    with pytest.raises(ValueError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "x"}])
    with pytest.raises(FileNotFoundError):
        Tokenizer.from_pretrained(tmp_path / "nothing")
