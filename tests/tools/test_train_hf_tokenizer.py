"""``tools/train_hf_tokenizer.py`` reads ``.jsonl`` inputs as records."""

import json

from tools import train_hf_tokenizer


def test_jsonl_is_read_as_records(tmp_path, capsys):
    from transformers import AutoTokenizer

    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps({"text": "hello world, hello again", "id": i}) + "\n" for i in range(50)))
    assert train_hf_tokenizer.main(["--input", str(data), "--vocab-size", "300", "--output-dir",
                                    str(tmp_path / "bpe")]) == 0
    vocab = AutoTokenizer.from_pretrained(str(tmp_path / "bpe"), local_files_only=True).get_vocab()
    assert "hello" in vocab and not any('"' in token or "text" in token for token in vocab
                                   if len(token) > 1 and token != "<|endoftext|>")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"body": "no text key"}\n')
    capsys.readouterr()
    assert train_hf_tokenizer.main(["--input", str(bad), "--vocab-size", "300", "--output-dir",
                                    str(tmp_path / "bpe2")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "bad.jsonl:2" in err and "--json-keys" in err, err
