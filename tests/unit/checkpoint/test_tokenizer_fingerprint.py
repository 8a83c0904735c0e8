"""A checkpoint fingerprints the recipe's tokenizer (checkpoint/tokenizer.py): the same after a save and reload,
another for another vocabulary or special token, and a resume with another is refused in one line."""

from __future__ import annotations

import pytest

from accel_trainer.checkpoint.files import CheckpointError
from accel_trainer.checkpoint.tokenizer import RECORD_KEY, check_tokenizer, save_tokenizer, tokenizer_fingerprint

transformers = pytest.importorskip("transformers")


def byte_tokenizer():
    import accel_trainer as at

    return at.get_recipe("hf_causal_lm")(at.get_recipe("hf_causal_lm").Config()).build_tokenizer(None)


def test_the_fingerprint_survives_a_save_and_reload_and_its_calls(tmp_path):
    tokenizer = byte_tokenizer()
    fingerprint = tokenizer_fingerprint(tokenizer)
    tokenizer(["a", "longer text"], padding=True, truncation=True, max_length=4)  # call settings are not identity
    save_tokenizer(tokenizer, tmp_path)
    reloaded = transformers.AutoTokenizer.from_pretrained(tmp_path)
    text = "def f(x):\n    return x  # é"
    assert reloaded(text)["input_ids"] == list(text.encode())  # one id per byte, as the data encodes text
    assert tokenizer_fingerprint(reloaded) == tokenizer_fingerprint(tokenizer) == fingerprint
    check_tokenizer(tmp_path, {RECORD_KEY: fingerprint}, tokenizer_fingerprint(reloaded))


def test_another_tokenizer_is_refused_on_resume(tmp_path):
    tokenizer, other = byte_tokenizer(), byte_tokenizer()
    other.add_special_tokens({"additional_special_tokens": ["<|user|>"]})
    assert tokenizer_fingerprint(other) != tokenizer_fingerprint(tokenizer)
    with pytest.raises(CheckpointError, match="was trained with another tokenizer"):
        check_tokenizer(tmp_path, {RECORD_KEY: tokenizer_fingerprint(tokenizer)}, tokenizer_fingerprint(other))
    check_tokenizer(tmp_path, {}, tokenizer_fingerprint(other))  # a checkpoint from before tokenizers were recorded
    assert tokenizer_fingerprint(None) is None
