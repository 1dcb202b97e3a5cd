"""``hybridflow serve``: the OpenAI-compatible server, driven by the official ``openai`` client.

A real uvicorn server runs in a background thread on a free loopback port, over the tiny model
written as a local HF directory; the reference is the offline ``LLM`` API on the same directory.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch
import uvicorn

from hybridflow.cli import build_parser, main
from hybridflow.models.tiny import write_tiny_model
from hybridflow.serving.llm import LLM
from hybridflow.inference.native import NativeEngine
from hybridflow.serving.formats import IncrementalDetokenizer
from hybridflow.serving.launch import ServeError, build_server_engine, warn_if_exposed
from hybridflow.serving.server import create_app
from hybridflow.types import GenerationRequest, SamplingParams

torch.set_num_threads(1)

MODEL = "tiny"
PROMPTS = ["The answer is", "1 + 1 ="]
# The tiny random model writes diverse text (printable and not) when sampled with this seed.
SEED = 2


@dataclass
class Server:
    url: str
    engine: NativeEngine
    tokenizer: Any

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0, timeout=30)

    def stats(self) -> dict[str, int]:
        return httpx.get(f"{self.url}/stats").json()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("serve") / "tiny", seed=2)


@pytest.fixture(scope="module")
def server(model_dir: Path) -> Iterator[Server]:
    engine, tokenizer, max_model_len = build_server_engine(
        model_dir, max_batch_size=16, kv_cache_memory_bytes=256 << 20
    )
    app = create_app(engine, tokenizer, model_name=MODEL, max_model_len=max_model_len)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))  # a free port, held from here on: no race with other tests
    uv = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=uv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not uv.started:
        assert thread.is_alive() and time.monotonic() < deadline, "server did not start"
        time.sleep(0.02)
    yield Server(f"http://127.0.0.1:{sock.getsockname()[1]}", engine, tokenizer)
    uv.should_exit = True
    thread.join(timeout=10)
    sock.close()


@pytest.fixture(scope="module")
def llm(model_dir: Path) -> LLM:
    return LLM(model_dir, max_num_seqs=16)


def greedy(max_tokens: int = 12) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens)


def test_models_and_health(server: Server) -> None:
    models = server.client().models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}


def test_greedy_completion_equals_llm_generate(server: Server, llm: LLM) -> None:
    expected = [o.outputs[0] for o in llm.generate(PROMPTS, greedy())]
    client = server.client()
    answer = client.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=12, temperature=0)
    assert [c.text for c in answer.choices] == [e.text for e in expected]
    assert [c.index for c in answer.choices] == [0, 1]
    assert {c.finish_reason for c in answer.choices} <= {"stop", "length"}
    prompt_ids = [server.tokenizer.encode(p) for p in PROMPTS]
    assert answer.usage.prompt_tokens == sum(len(ids) for ids in prompt_ids)
    assert answer.usage.completion_tokens == sum(len(e.token_ids) for e in expected)
    by_ids = client.completions.create(model=MODEL, prompt=prompt_ids, max_tokens=12, temperature=0)
    assert [c.text for c in by_ids.choices] == [e.text for e in expected]
    logprobs = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=12, temperature=0, logprobs=2)
    (choice,) = logprobs.choices
    assert choice.logprobs.token_logprobs == pytest.approx(expected[0].token_logprobs, abs=1e-6)
    assert all(len(top) >= 2 for top in choice.logprobs.top_logprobs)


def test_chat_completion_equals_llm_chat(server: Server, llm: LLM) -> None:
    conversation = [{"role": "user", "content": "What is 2 + 3?"}]
    (expected,) = llm.chat(conversation, greedy(10))
    answer = server.client().chat.completions.create(
        model=MODEL, messages=conversation, max_tokens=10, temperature=0, logprobs=True, top_logprobs=3
    )
    (choice,) = answer.choices
    assert choice.message.role == "assistant"
    assert choice.message.content == expected.outputs[0].text
    assert answer.usage.prompt_tokens == len(expected.prompt_token_ids)
    tokens = choice.logprobs.content
    assert [t.logprob for t in tokens] == pytest.approx(expected.outputs[0].token_logprobs, abs=1e-6)
    assert all(len(t.top_logprobs) == 3 for t in tokens)
    assert all(t.top_logprobs[0].logprob >= t.logprob - 1e-6 for t in tokens)  # greedy takes the most likely


def test_streaming_chunks_concatenate_to_the_non_streamed_text(server: Server) -> None:
    client = server.client()
    settings: dict[str, Any] = dict(model=MODEL, prompt="Hello", max_tokens=40, temperature=1.0, seed=SEED, n=2)
    whole = client.completions.create(**settings)
    texts, finishes, chunks = ["", ""], [None, None], 0
    usage = None
    for chunk in client.completions.create(**settings, stream=True, stream_options={"include_usage": True}):
        usage = chunk.usage or usage
        for choice in chunk.choices:
            texts[choice.index] += choice.text
            finishes[choice.index] = choice.finish_reason or finishes[choice.index]
            chunks += 1
    assert texts == [c.text for c in whole.choices]
    assert finishes == [c.finish_reason for c in whole.choices]
    assert chunks > 4, "tokens should arrive in several chunks, not all at the end"
    assert usage is not None and usage.completion_tokens == whole.usage.completion_tokens

    conversation = [{"role": "user", "content": "Say something"}]
    chat = dict(model=MODEL, messages=conversation, max_tokens=20, temperature=0)
    expected = client.chat.completions.create(**chat).choices[0].message.content
    deltas = list(client.chat.completions.create(**chat, stream=True))
    assert deltas[0].choices[0].delta.role == "assistant"
    assert "".join(d.choices[0].delta.content or "" for d in deltas) == expected
    assert deltas[-1].choices[0].finish_reason in ("stop", "length")


def test_n_samples_and_seeds_are_reproducible(server: Server, llm: LLM) -> None:
    client = server.client()
    first = client.completions.create(model=MODEL, prompt="Hello", n=3, max_tokens=16, temperature=1.0, seed=5)
    again = client.completions.create(model=MODEL, prompt="Hello", n=3, max_tokens=16, temperature=1.0, seed=5)
    other = client.completions.create(model=MODEL, prompt="Hello", n=3, max_tokens=16, temperature=1.0, seed=6)
    texts = [c.text for c in first.choices]
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert len(set(texts)) == 3, "the samples of one request differ"
    assert [c.text for c in again.choices] == texts
    assert [c.text for c in other.choices] != texts
    (offline,) = llm.generate(["Hello"], SamplingParams(n=3, max_tokens=16, temperature=1.0, seed=5))
    assert [o.text for o in offline.outputs] == texts


def test_stop_strings_cut_streamed_and_whole_text(server: Server) -> None:
    client = server.client()
    settings: dict[str, Any] = dict(model=MODEL, prompt="Hello", max_tokens=40, temperature=1.0, seed=SEED)
    full = client.completions.create(**settings).choices[0].text
    # Two printable characters past the start of the text, so the cut is a real one.
    match = re.search(r"[!-~]{2}", full[3:])
    assert match is not None, f"no printable pair in {full!r}"
    stop = match.group(0)
    expected = full[: full.index(stop)]
    (choice,) = client.completions.create(**settings, stop=[stop]).choices
    assert (choice.text, choice.finish_reason) == (expected, "stop")
    assert choice.model_extra["stop_reason"] == stop
    streamed = "".join(c.choices[0].text for c in client.completions.create(**settings, stop=stop, stream=True))
    assert streamed == expected
    kept = client.completions.create(**settings, stop=[stop], extra_body={"include_stop_str_in_output": True})
    assert kept.choices[0].text == expected + stop


@pytest.mark.parametrize(
    ("call", "param"),
    [
        (dict(temperature=-1.0), "temperature"),
        (dict(top_p=1.5), "top_p"),
        (dict(n=0), "n"),
        (dict(extra_body={"top_k": -3}), "top_k"),
        (dict(extra_body={"frobnicate": 1}), "frobnicate"),
        (dict(echo=True, stream=True), "echo"),
        (dict(extra_body={"prompt_logprobs": 1}, stream=True), "prompt_logprobs"),
        (dict(extra_body={"prompt_logprobs": 100000}), "prompt_logprobs"),
        (dict(extra_body={"prompt_logprobs": -1}), "prompt_logprobs"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(presence_penalty=0.5), "presence_penalty"),
        (dict(logprobs=100000), "logprobs"),
        (dict(prompt="x" * 600), "prompt"),
        (dict(prompt=[[1, 2], [3, 100000]]), "prompt.1"),
    ],
)
def test_bad_completion_parameters_are_400_naming_the_field(server: Server, call: dict[str, Any], param: str) -> None:
    arguments: dict[str, Any] = {"model": MODEL, "prompt": "hi", "max_tokens": 4, **call}
    with pytest.raises(openai.BadRequestError) as error:
        server.client().completions.create(**arguments)
    assert error.value.param == param
    assert error.value.status_code == 400 and param in error.value.message


def test_other_refusals_name_the_field(server: Server) -> None:
    client = server.client()
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(model=MODEL, messages=messages, top_logprobs=2)
    assert error.value.param == "top_logprobs"
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(
            model=MODEL, messages=messages, tools=[{"type": "function", "function": {"name": "f"}}]
        )
    assert error.value.param == "tools"
    with pytest.raises(openai.NotFoundError) as missing:
        client.completions.create(model="gpt-4", prompt="hi")
    assert missing.value.param == "model"
    answer = httpx.post(f"{server.url}/generate", json={"prompt_ids": [1, 2], "sampling_params": {"top_p": 0}})
    assert answer.status_code == 400
    assert answer.json()["error"]["param"] == "sampling_params.top_p"


def test_concurrent_requests_are_batched_in_one_engine(server: Server, llm: LLM) -> None:
    prompts = [f"question {i}:" for i in range(6)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    expected = [o.outputs[0].text for o in llm.generate(prompts, params)]
    before = server.stats()

    async def ask_all() -> list[str]:
        client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=30)
        async with client:
            answers = await asyncio.gather(*(
                client.completions.create(
                    model=MODEL, prompt=p, max_tokens=24, temperature=0, extra_body={"ignore_eos": True}
                )
                for p in prompts
            ))
        return [a.choices[0].text for a in answers]

    assert asyncio.run(ask_all()) == expected
    after = server.stats()
    tokens = after["generated_tokens"] - before["generated_tokens"]
    steps = after["steps"] - before["steps"]
    assert tokens == 6 * 24
    # One sequence per step would take 144 steps; batched requests share steps.
    assert tokens / steps > 2, f"{tokens} tokens in {steps} steps: requests were not batched"


def test_tokens_endpoint_equals_a_direct_engine_call(server: Server, llm: LLM) -> None:
    prompt_ids = server.tokenizer.encode("Hello there")
    params = {"n": 2, "temperature": 0.8, "top_p": 0.9, "max_tokens": 12, "seed": 11, "logprobs": 2}
    answer = httpx.post(f"{server.url}/generate", json={"prompt_ids": prompt_ids, "sampling_params": params}).json()
    (direct,) = llm.engine.generate_batch([GenerationRequest(prompt_ids, SamplingParams(**params))])
    assert [s["response_ids"] for s in answer["samples"]] == [t.response_ids for t in direct]
    for sample, trajectory in zip(answer["samples"], direct, strict=True):
        assert sample["rollout_logprobs"] == pytest.approx(trajectory.rollout_logprobs, abs=1e-6)
        assert sample["finish_reason"] == trajectory.finish_reason
        assert trajectory.top_logprobs is not None
        for top, reference in zip(sample["top_logprobs"], trajectory.top_logprobs, strict=True):
            assert {token: logprob for token, logprob in top} == pytest.approx(reference, abs=1e-6)
    assert answer["usage"]["completion_tokens"] == sum(len(t.response_ids) for t in direct)


def test_a_closed_stream_stops_generating(server: Server) -> None:
    client = server.client()
    before = server.stats()["generated_tokens"]
    stream = client.completions.create(
        model=MODEL, prompt="Hello", max_tokens=400, temperature=1.0, seed=1, stream=True,
        extra_body={"ignore_eos": True},
    )
    for _, _chunk in zip(range(3), stream, strict=False):
        pass
    stream.close()
    # Wait until the engine is idle (the count stops moving); uncancelled, it would reach 400.
    deadline, previous = time.monotonic() + 10, -1
    while (count := server.stats()["generated_tokens"]) != previous and time.monotonic() < deadline:
        previous = count
        time.sleep(0.3)
    assert 3 <= count - before < 400


def test_incremental_detokenizer_matches_a_whole_decode(server: Server) -> None:
    tokenizer = server.tokenizer
    text = "héllo wörld ✓ 🙂 <|im_end|> done"
    ids = tokenizer.encode(text, add_special_tokens=False)
    detokenizer = IncrementalDetokenizer(tokenizer)
    pieces = [detokenizer.push(t) for t in ids]
    assert "".join(pieces) == tokenizer.decode(ids, skip_special_tokens=True)
    assert all("\ufffd" not in p for p in pieces), "partial UTF-8 characters are held back"


def test_cli_parses_serve_and_warns_on_exposed_hosts(caplog: pytest.LogCaptureFixture, tmp_path: Path) -> None:
    args = build_parser().parse_args(["serve", "/m", "--port", "9001", "--max-batch-size", "8", "--dtype", "bfloat16"])
    assert (args.command, args.model_dir, args.host, args.port) == ("serve", "/m", "127.0.0.1", 9001)
    assert (args.max_batch_size, args.dtype, args.served_model_name) == (8, "bfloat16", None)
    with caplog.at_level(logging.WARNING, logger="hybridflow.serving.launch"):
        assert not warn_if_exposed("127.0.0.1") and not warn_if_exposed("localhost") and not warn_if_exposed("::1")
        assert not caplog.records
        assert warn_if_exposed("0.0.0.0")
    assert "no authentication" in caplog.text
    assert main(["serve", str(tmp_path / "missing")]) == 1


# A lone surrogate: JSON allows the escape "\ud800", which Python reads as a str that is not
# Unicode text (no tokenizer, no UTF-8 writer takes it). Written here as raw JSON text, since
# a client library would escape or refuse it first.
LONE_SURROGATE_BODIES = [
    ("/v1/completions", '{"model": "tiny", "prompt": "a\\ud800b", "max_tokens": 2}', "prompt", 1),
    ("/v1/completions", '{"model": "tiny", "prompt": ["ok", "\\udfff"], "max_tokens": 2}', "prompt.1", 0),
    ("/v1/chat/completions", '{"model": "tiny", "messages": [{"role": "user", "content": "hi"}, '
     '{"role": "user", "content": "x\\ud83d"}], "max_tokens": 2}', "messages.1.content", 1),
    ("/v1/chat/completions", '{"model": "tiny", "messages": [{"role": "user", "content": '
     '[{"type": "text", "text": "ab\\udc00"}]}], "max_tokens": 2}', "messages.0.content.0.text", 2),
    ("/v1/chat/completions", '{"model": "tiny", "messages": [{"role": "us\\udc00er", "content": "hi"}], '
     '"max_tokens": 2}', "messages.0.role", 2),
    ("/v1/completions", '{"model": "tiny", "prompt": "a", "stop": ["\\ud800"], "max_tokens": 2}', "stop.0", 0),
    ("/generate", '{"prompt_ids": [1, 2], "request_id": "r\\ud800"}', "request_id", 1),
]


@pytest.mark.parametrize(("path", "body", "param", "position"), LONE_SURROGATE_BODIES,
                         ids=[param for _, _, param, _ in LONE_SURROGATE_BODIES])
def test_a_lone_surrogate_is_a_400_naming_the_field(server: Server, path: str, body: str, param: str,
                                                    position: int) -> None:
    answer = httpx.post(f"{server.url}{path}", content=body.encode(), headers={"content-type": "application/json"})
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == param
    assert error["message"].startswith(f"{param}: character {position} is a lone surrogate (\\u"), error["message"]
    assert "not Unicode text" in error["message"]


def test_a_surrogate_pair_is_text_not_an_error(server: Server) -> None:
    body = '{"model": "tiny", "prompt": "smile \\ud83d\\ude00", "max_tokens": 2}'  # one emoji, escaped as JSON does
    headers = {"content-type": "application/json"}
    answer = httpx.post(f"{server.url}/v1/completions", content=body.encode(), headers=headers)
    assert answer.status_code == 200, answer.text
    assert answer.json()["usage"]["prompt_tokens"] == len(server.tokenizer.encode("smile \U0001f600"))


def _model_with_template(tmp_path: Path, template: str) -> Path:
    directory = write_tiny_model(tmp_path / "model", seed=2)
    (directory / "chat_template.jinja").write_text(template)
    return directory


@pytest.mark.parametrize(
    ("template", "error"),
    [
        ("{% for m in messages %}{{ m['content'] }}", "TemplateSyntaxError"),  # no endfor
        ("{{ messages[0]['content'] | no_such_filter }}", "TemplateAssertionError"),
        ("{{ raise_exception('this template is broken') }}", "this template is broken"),
    ],
    ids=["syntax", "unknown-filter", "always-raises"],
)
def test_a_broken_chat_template_refuses_to_start_naming_its_file(tmp_path: Path, template: str, error: str) -> None:
    directory = _model_with_template(tmp_path, template)
    with pytest.raises(ServeError) as refused:
        build_server_engine(directory, max_batch_size=2, kv_cache_memory_bytes=16 << 20)
    message = str(refused.value)
    assert "\n" not in message
    assert str(directory / "chat_template.jinja") in message and error in message, message


def test_a_template_in_tokenizer_config_is_named_there(tmp_path: Path) -> None:
    directory = write_tiny_model(tmp_path / "model", seed=2)
    (directory / "chat_template.jinja").unlink()
    config_file = directory / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["chat_template"] = "{% if %}"
    config_file.write_text(json.dumps(config))
    with pytest.raises(ServeError, match=r"tokenizer_config\.json's chat_template.*TemplateSyntaxError"):
        build_server_engine(directory, max_batch_size=2, kv_cache_memory_bytes=16 << 20)


def test_a_template_that_needs_a_system_message_still_starts(tmp_path: Path) -> None:
    # Some templates refuse a conversation without a system turn: not broken, just strict.
    template = (
        "{% if messages[0]['role'] != 'system' %}{{ raise_exception('a system message comes first') }}{% endif %}"
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    engine, tokenizer, _ = build_server_engine(
        _model_with_template(tmp_path, template), max_batch_size=2, kv_cache_memory_bytes=16 << 20
    )
    assert "a system message comes first" in tokenizer.chat_template


@torch.no_grad()
def hf_prompt_logprobs(model_dir: Path, prompt: list[int]) -> torch.Tensor:
    """log_softmax of an HF forward over ``prompt`` (float32): row i is the distribution of token i + 1."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    return model(torch.tensor([prompt])).logits[0, :-1].float().log_softmax(-1)


def test_prompt_logprobs_come_back_in_vllms_shape(server: Server, model_dir: Path) -> None:
    prompt = server.tokenizer.encode("1 + 1 = 2, 2 + 2 = 4")
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 1, "prompt_logprobs": 2, "n": 2, "temperature": 1.0}
    answer = httpx.post(f"{server.url}/v1/completions", json=body, timeout=30)
    assert answer.status_code == 200, answer.text
    expected = hf_prompt_logprobs(model_dir, prompt)
    choices = answer.json()["choices"]
    assert len(choices) == 2 and choices[0]["prompt_logprobs"] == choices[1]["prompt_logprobs"]
    entries = choices[0]["prompt_logprobs"]
    assert len(entries) == len(prompt) and entries[0] is None
    for position, (token, entry) in enumerate(zip(prompt[1:], entries[1:], strict=True)):
        row = expected[position]
        mine = entry[str(token)]  # the prompt's own token, ranked in the whole vocabulary
        assert abs(mine["logprob"] - float(row[token])) < 1e-5
        assert mine["rank"] == int((row > row[token]).sum()) + 1
        assert mine["decoded_token"] == server.tokenizer.decode([token])
        best = [int(t) for t in row.topk(2).indices]
        assert {entry[str(t)]["rank"] for t in best} == {1, 2} and set(entry) == {str(token), *map(str, best)}
    # Without the field the answer keeps its usual shape.
    plain = httpx.post(f"{server.url}/v1/completions", json={**body, "prompt_logprobs": None}, timeout=30).json()
    assert "prompt_logprobs" not in plain["choices"][0]


def test_echo_with_max_tokens_0_scores_the_prompt_the_legacy_way(server: Server, model_dir: Path) -> None:
    text = "1 + 1 = 2"
    prompt = server.tokenizer.encode(text)
    scored = server.client().completions.create(model=MODEL, prompt=text, echo=True, logprobs=1, max_tokens=0)
    choice = scored.choices[0]
    assert choice.text == server.tokenizer.decode(prompt) and scored.usage.completion_tokens == 0
    expected = hf_prompt_logprobs(model_dir, prompt)
    assert choice.logprobs.tokens == [server.tokenizer.decode([t]) for t in prompt]
    assert choice.logprobs.token_logprobs[0] is None and choice.logprobs.top_logprobs[0] is None
    got = torch.tensor(choice.logprobs.token_logprobs[1:])
    torch.testing.assert_close(got, expected.gather(1, torch.tensor(prompt[1:])[:, None])[:, 0], rtol=0, atol=1e-5)
    # echo with a completion: the prompt's text and tokens, then the completion's.
    both = server.client().completions.create(model=MODEL, prompt=text, echo=True, logprobs=0, max_tokens=3,
                                              temperature=0)
    alone = server.client().completions.create(model=MODEL, prompt=text, logprobs=0, max_tokens=3, temperature=0)
    assert both.choices[0].text == choice.text + alone.choices[0].text
    assert both.choices[0].logprobs.token_logprobs[len(prompt):] == alone.choices[0].logprobs.token_logprobs
