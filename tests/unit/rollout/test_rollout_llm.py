"""The offline ``LLM`` API on the built-in tiny model written as a local Hugging Face directory."""

from __future__ import annotations

import pytest
import torch

from hybridflow.models.loading import load_causal_lm
from hybridflow.models.tiny import write_tiny_model
from hybridflow.serving.llm import LLM
from hybridflow.types import SamplingParams

from test_rollout_continuous_batching import ForceText

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("llm") / "tiny", seed=2)


@pytest.fixture(scope="module")
def llm(model_dir) -> LLM:
    return LLM(model_dir, max_num_seqs=16)


def test_generate_text_prompts_decodes_and_matches_hf_greedy(llm, model_dir):
    tokenizer = llm.get_tokenizer()
    prompts = ["The answer is", "1 + 1 ="]
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12))
    reference = load_causal_lm(model_dir).eval()
    for prompt, output in zip(prompts, outputs, strict=True):
        ids = tokenizer.encode(prompt)
        assert output.prompt == prompt and output.prompt_token_ids == ids
        (completion,) = output.outputs
        with torch.no_grad():
            expected = reference.generate(
                input_ids=torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                do_sample=False, max_new_tokens=12, eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id,
            )[0, len(ids):].tolist()
        assert completion.token_ids == expected
        assert completion.text == tokenizer.decode(expected, skip_special_tokens=True)
        assert completion.cumulative_logprob == pytest.approx(sum(completion.token_logprobs))
        assert completion.finish_reason in ("stop", "length") and completion.logprobs is None


def test_prompt_forms_per_prompt_params_and_n_samples(llm):
    tokenizer = llm.get_tokenizer()
    ids = tokenizer.encode("hi")
    outputs = llm.generate(
        ["hi", ids, {"prompt_token_ids": ids}, {"prompt": "hi"}],
        [SamplingParams(temperature=0.0, max_tokens=5)] * 3 + [SamplingParams(n=3, temperature=1.0, max_tokens=5, seed=1)],
    )
    assert [o.prompt_token_ids for o in outputs] == [ids] * 4
    assert [o.prompt for o in outputs] == ["hi", None, None, "hi"]
    assert outputs[0].outputs[0].token_ids == outputs[1].outputs[0].token_ids == outputs[2].outputs[0].token_ids
    assert [c.index for c in outputs[3].outputs] == [0, 1, 2]
    assert len({o.request_id for o in outputs}) == 4
    single = llm.generate(ids, SamplingParams(temperature=0.0, max_tokens=5))  # one prompt as token ids
    assert single[0].outputs[0].token_ids == outputs[0].outputs[0].token_ids
    with pytest.raises(ValueError, match="2 SamplingParams for 1 prompts"):
        llm.generate(["a"], [SamplingParams(), SamplingParams()])
    with pytest.raises(ValueError, match="needs 'prompt' or 'prompt_token_ids'"):
        llm.generate({"text": "a"})


def test_chat_applies_the_chat_template(llm):
    tokenizer = llm.get_tokenizer()
    conversation = [{"role": "user", "content": "What is 2 + 3?"}]
    (output,) = llm.chat(conversation, SamplingParams(temperature=0.0, max_tokens=4))
    text = tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
    assert output.prompt == text and output.prompt.endswith("<|im_start|>assistant\n")
    assert output.prompt_token_ids == tokenizer.encode(text, add_special_tokens=False)
    two = llm.chat([conversation, [{"role": "user", "content": "Hi"}]], SamplingParams(max_tokens=2))
    assert len(two) == 2


def test_stop_strings_cut_the_text_and_logprobs_are_returned(model_dir):
    llm = LLM(model_dir, logits_processors=[ForceText(list(b"abcXYZdef"))])
    cut, kept, tops = llm.generate(
        ["q", "q", "q"],
        [
            SamplingParams(temperature=0.0, max_tokens=20, stop=["XY"]),
            SamplingParams(temperature=0.0, max_tokens=20, stop=["XY"], include_stop_str_in_output=True),
            SamplingParams(temperature=0.0, max_tokens=3, logprobs=2),
        ],
    )
    assert cut.outputs[0].text == "abc" and cut.outputs[0].stop_reason == "XY"
    assert cut.outputs[0].finish_reason == "stop"
    assert kept.outputs[0].text == "abcXY"
    assert tops.outputs[0].text == "abc" and tops.outputs[0].finish_reason == "length"
    assert tops.outputs[0].logprobs is not None and len(tops.outputs[0].logprobs) == 3
    assert all(len(top) >= 2 for top in tops.outputs[0].logprobs)


def test_sleep_wake_and_update_weights_pass_through(llm, model_dir):
    params = SamplingParams(temperature=0.0, max_tokens=6)
    before = llm.generate(["abc"], params)[0].outputs[0].token_ids
    llm.sleep()
    assert llm.engine.kv_cache_bytes == 0
    llm.wake_up()
    donor = write_tiny_model(model_dir.parent / "donor", seed=9)
    llm.update_weights(load_causal_lm(donor).state_dict().items())
    changed = llm.generate(["abc"], params)[0].outputs[0].token_ids
    llm.update_weights(load_causal_lm(model_dir).state_dict().items())
    assert llm.generate(["abc"], params)[0].outputs[0].token_ids == before
    assert changed != before
