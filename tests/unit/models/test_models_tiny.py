import torch
from transformers import AutoTokenizer

from hybridflow.models.loading import eos_token_ids, load_causal_lm, load_tokenizer
from hybridflow.models.tiny import TinyModelSpec, write_tiny_model


def test_tiny_model_directory_round_trips_through_from_pretrained(tmp_path):
    d = write_tiny_model(tmp_path / "m", TinyModelSpec(hidden_size=32, intermediate_size=64, num_hidden_layers=1))
    tok = AutoTokenizer.from_pretrained(d)
    assert type(tok).__name__ == "Qwen2Tokenizer"  # transformers rebuilds qwen2 tokenizers byte-level
    # Spaces, newlines, tabs and non-ASCII survive (a plain char vocab would silently drop spaces).
    text = "What is 12 + 34?  é\n\tok"
    ids = tok.encode(text, add_special_tokens=False)
    assert len(ids) == len(text.encode())  # one token per byte
    assert tok.decode(ids) == text
    chat = tok.apply_chat_template([{"role": "user", "content": "1 + 2"}], tokenize=False, add_generation_prompt=True)
    assert chat == "<|im_start|>user\n1 + 2<|im_end|>\n<|im_start|>assistant\n"
    assert load_tokenizer(d).eos_token_id == 258 and eos_token_ids(d, tok) == [258]
    model = load_causal_lm(d)
    assert model.config.model_type == "qwen2"
    with torch.no_grad():
        assert model(torch.tensor([ids])).logits.shape == (1, len(ids), 272)


def test_loading_refuses_anything_but_a_local_directory(tmp_path):
    import pytest

    with pytest.raises(FileNotFoundError, match="never downloads"):
        load_tokenizer("Qwen/Qwen2.5-0.5B-Instruct")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_causal_lm(tmp_path / "empty")
