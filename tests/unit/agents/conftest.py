"""Shared fakes for the agent tests: the byte-level tiny tokenizer and a scripted engine.

The engine is the external boundary, so it is the one thing faked: it answers each request
with a scripted text chosen from the conversation so far, as the model's tokens plus EOS.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest

from hybridflow.models.tiny import build_tiny_tokenizer
from hybridflow.types import GenerationRequest, Trajectory


class ScriptedEngine:
    """``reply(conversation_text, turn)`` gives the text (or the token ids) of assistant turn
    ``turn`` (0-based); the engine appends EOS and cuts at ``max_tokens``."""

    def __init__(self, tokenizer, reply: Callable[[str, int], str | list[int]], delay_s: float = 0.0) -> None:
        self.tokenizer = tokenizer
        self.reply = reply
        self.delay_s = delay_s
        self.requests: list[GenerationRequest] = []
        self.in_flight = 0
        self.max_in_flight = 0

    async def generate(self, request: GenerationRequest) -> list[Trajectory]:
        self.requests.append(request)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            await asyncio.sleep(self.delay_s)
        finally:
            self.in_flight -= 1
        text = self.tokenizer.decode(request.prompt_ids, skip_special_tokens=False)
        turn = text.count("<|im_start|>assistant") - 1
        eos = self.tokenizer.eos_token_id
        reply = self.reply(text, turn)
        # A list is raw token ids: a model may sample a split the tokenizer would never produce.
        ids = list(reply) if isinstance(reply, list) else self.tokenizer.encode(reply, add_special_tokens=False)
        ids.append(eos)
        ids = ids[: request.params.max_tokens]
        logprobs = [-0.01 * (index + 1) for index in range(len(ids))]
        finish = "stop" if ids[-1] == eos else "length"
        return [Trajectory(list(request.prompt_ids), ids, [1] * len(ids), logprobs, finish)]


@pytest.fixture(scope="session")
def tokenizer():
    return build_tiny_tokenizer()


@pytest.fixture
def scripted(tokenizer) -> Callable[..., ScriptedEngine]:
    def make(reply: Callable[[str, int], str | list[int]], delay_s: float = 0.0) -> ScriptedEngine:
        return ScriptedEngine(tokenizer, reply, delay_s)

    return make
