"""An agent for the built-in calculator task, written against the official ``openai`` client.

Copy it as the start of your own: it is what a framework-free agent looks like. It asks the
model, runs the tool calls the model makes, sends their results back, and returns the reward of
the final answer, scored by the task's own scorer. hybridflow records every completion it makes.

    hybridflow train --preset tool_agent rollout.multi_turn.default_agent_loop=openai \\
        rollout.multi_turn.openai_agent=hybridflow.agents.examples.openai_calculator:run_episode

The same function runs against any OpenAI-compatible server (``hybridflow serve``, vLLM, the
OpenAI API) when given an ``OpenAIEpisode`` with that server's URL.
"""

from __future__ import annotations

import json

from openai import OpenAI

from hybridflow.agents.openai_agent import OpenAIEpisode
from hybridflow.agents.tools import evaluate_arithmetic, format_number
from hybridflow.rewards.calculator import compute_score

MAX_TURNS = 2  # call the calculator, then answer (the tool_agent preset's max_assistant_turns)


def calculator(expression: str) -> str:
    """The tool: the exact value, as the built-in calculator writes it, or the error."""
    try:
        return format_number(evaluate_arithmetic(expression))
    except ValueError as error:
        return f"Error: {error}"


def run_tool(name: str, arguments: str) -> str:
    try:
        args = json.loads(arguments or "{}")
    except json.JSONDecodeError:
        return "Error: the arguments are not JSON"
    if name != "calculator" or not isinstance(args, dict) or not isinstance(args.get("expression"), str):
        return f"Error: unknown tool {name!r} or no 'expression' argument"
    return calculator(args["expression"])


def run_episode(episode: OpenAIEpisode) -> float:
    """One episode: the reward of its final answer (1.0 for the exact product, else 0.0)."""
    client = OpenAI(base_url=episode.base_url, api_key=episode.api_key, max_retries=0)
    messages = list(episode.messages)
    for turn in range(MAX_TURNS):
        reply = client.chat.completions.create(model=episode.model, messages=messages, tools=episode.tools or None)
        message = reply.choices[0].message
        if not message.tool_calls:
            return compute_score(message.content or "", episode.metadata["ground_truth"])
        if turn == MAX_TURNS - 1:
            break  # still calling a tool on the last turn: no answer
        messages.append(message.model_dump(exclude_none=True))
        for call in message.tool_calls:
            messages.append({"role": "tool", "tool_call_id": call.id,
                             "content": run_tool(call.function.name, call.function.arguments)})
    return 0.0
