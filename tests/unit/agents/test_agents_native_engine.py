"""The tool agent against the real native engine on the built-in tiny model.

The tiny model's weights are set so its logits are a fixed bias (ASCII text, often <|im_end|>):
turns end by themselves and decode to text that re-encodes to the same ids; a pluggable parser
turns every turn into a calculator call, so episodes go several turns deep.
"""

from __future__ import annotations

import torch

from hybridflow.agents.base import AgentContext, AgentRow, AgentRunner
from hybridflow.agents.parsers import ParsedTurn, ToolCall
from hybridflow.agents.tokens import check_token_consistency, render_ids
from hybridflow.agents.tools import ToolRegistry, calculator
from hybridflow.models.tiny import TinyModelSpec, build_tiny_model, build_tiny_tokenizer
from hybridflow.rollout import EngineArgs, build_rollout_engine
from hybridflow.types import UNVERSIONED_TOKEN, RowFields, SamplingParams

torch.set_num_threads(1)

IM_END, PAD = 258, 256
TURNS = 3


class AlwaysCalculate:
    """Every turn asks for 6*7, whatever the model wrote."""

    def parse(self, text: str) -> ParsedTurn:
        return ParsedTurn(items=(ToolCall("calculator", {"expression": "6*7"}),), content=text)


def steered_model(spec: TinyModelSpec) -> torch.nn.Module:
    """Logits that ignore the context: ``BIAS`` on every position.

    Embedding column 0 is a large constant, so after the final RMSNorm (whose other weights are
    zeroed) hidden dimension 0 is about sqrt(hidden_size) whatever the input; an untied head
    that reads only that dimension then yields the same logits everywhere.
    """
    model = build_tiny_model(spec, seed=0)
    bias = torch.full((spec.vocab_size,), -1e4)
    bias[32:127] = 0.0  # printable ASCII
    bias[IM_END] = 4.0  # about one token in three ends the turn
    with torch.no_grad():
        model.model.embed_tokens.weight[:, 0] = 100.0
        model.model.norm.weight.zero_()
        model.model.norm.weight[0] = 1.0
        head = torch.zeros(spec.vocab_size, spec.hidden_size)
        head[:, 0] = bias / spec.hidden_size**0.5
        model.lm_head.weight = torch.nn.Parameter(head)  # untied from the embedding
    return model


def test_tool_agent_on_the_native_engine() -> None:
    spec = TinyModelSpec(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)
    tokenizer = build_tiny_tokenizer()
    engine = build_rollout_engine(
        "native", EngineArgs(model=steered_model(spec), eos_token_ids=[IM_END], pad_token_id=PAD,
                             max_batch_size=8, device="cpu", dtype="float32", seed=0),
    )
    context = AgentContext(
        tokenizer, tools=ToolRegistry([calculator]), tool_parser=f"{__name__}:AlwaysCalculate", max_assistant_turns=TURNS
    )
    prompt = [{"role": "user", "content": "What is 6*7?"}]
    prompt_ids = render_ids(tokenizer, prompt, add_generation_prompt=True)
    rows = [AgentRow(prompt_ids, RowFields(data_source="x"), group_id=g) for g in range(2)]
    runner = AgentRunner(context, default_agent="tool_agent")
    trajectories = runner.generate_sync(rows, SamplingParams(n=2, max_tokens=256, temperature=1.0, seed=1), engine)

    assert [t.group_id for t in trajectories] == [0, 0, 1, 1]
    for trajectory in trajectories:
        assert trajectory.num_turns == TURNS and trajectory.agent.stop == "max_assistant_turns"
        assert trajectory.agent.metrics["tool_calls"] == TURNS - 1
        assert check_token_consistency(tokenizer, prompt, trajectory) == []
        model_positions = [i for i, m in enumerate(trajectory.loss_mask) if m]
        assert sum(trajectory.response_ids[i] == IM_END for i in model_positions) == TURNS
        assert all(trajectory.rollout_logprobs[i] < 0 for i in model_positions)
        assert all(trajectory.rollout_logprobs[i] == 0 for i, m in enumerate(trajectory.loss_mask) if not m)
        # The engine's policy version (0: no update yet) on model tokens, -1 on inserted ones.
        assert trajectory.token_versions == [0 if m else UNVERSIONED_TOKEN for m in trajectory.loss_mask]
        text = tokenizer.decode(trajectory.response_ids, skip_special_tokens=False)
        assert text.count("<|im_start|>tool\n42<|im_end|>") == TURNS - 1
    # Different seeds per episode: the samples of a group differ.
    assert trajectories[0].response_ids != trajectories[1].response_ids
