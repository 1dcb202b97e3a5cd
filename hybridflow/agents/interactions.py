"""Interactions: an optional user simulator for multi-turn dialogue tasks.

The tool agent consults the interaction after every assistant turn that made no tool call
(a turn addressed to the user). The interaction sees the conversation so far and the row's
metadata (``ground_truth`` and ``extra_info`` included) and may

- reply: the reply is appended as a user turn (loss mask 0) and the assistant continues;
- end the episode (``done``, or no reply);
- give a reward: the last reward given is stored in the trajectory's
  ``agent.interaction_reward``.

One interaction object serves every episode of a run concurrently, so per-episode state must
live in the conversation or the metadata, not on the object.

``INTERACTIONS`` maps a config name to a ``module:Class`` path (``gsm8k``: verl's GSM8K
interaction); any ``module:Class`` path works too. The class is built with the keyword arguments
of the config.

``rollout.multi_turn.interaction_config_path`` reads verl's interaction file
(``interaction: - name, class_name, config``, ``load_interaction_config``): each row picks its
interaction by ``extra_info.interaction_kwargs.name``, as verl's agent loop does, and the
interaction reads the rest of ``interaction_kwargs`` (verl's GSM8K one: ``ground_truth``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import yaml

from hybridflow.agents.registry import resolve_object
from hybridflow.rewards import gsm8k

INTERACTIONS: dict[str, str] = {"gsm8k": "hybridflow.agents.interactions:Gsm8kInteraction"}


@dataclass(frozen=True)
class InteractionResponse:
    """What the simulated user does after an assistant turn."""

    reply: str | None = None  # the user's next message; None ends the episode
    done: bool = False  # end the episode (a reply given with done=True is not appended)
    reward: float | None = None


@runtime_checkable
class Interaction(Protocol):
    async def respond(self, messages: list[dict[str, Any]], metadata: dict[str, Any]) -> InteractionResponse:
        """React to the conversation so far. ``messages`` holds the turns the agent loop added
        after the prompt (assistant, tool and earlier user turns), newest last."""
        ...


def build_interaction(name: str, **kwargs: Any) -> Interaction:
    """The interaction registered as ``name``, or the class at a ``module:Class`` path."""
    interaction_class = resolve_object(INTERACTIONS.get(name, name), "interaction", known=INTERACTIONS)
    interaction = interaction_class(**kwargs)
    if not isinstance(interaction, Interaction):
        raise TypeError(f"interaction {name!r} ({interaction_class!r}) has no async respond(messages, metadata)")
    return interaction


def interaction_kwargs(metadata: Mapping[str, Any]) -> dict[str, Any]:
    """verl's per-row interaction arguments: ``extra_info.interaction_kwargs`` (name, query, ground_truth)."""
    extra = metadata.get("extra_info") or {}
    return dict(extra.get("interaction_kwargs") or {}) if isinstance(extra, Mapping) else {}


class Gsm8kInteraction:
    """verl's Gsm8kInteraction: the user checks the last assistant message as a GSM8K answer (strict: the
    number after the last "#### ") against the row's ground truth (``interaction_kwargs.ground_truth``,
    else the row's own). Right: "Your response is correct!", the episode ends, reward 1.0; otherwise the
    user asks for another try, with the score as the reward."""

    CORRECT = "Your response is correct!"
    RETRY = "Your response is incorrect! You need to reflect on your answer and try again."

    async def respond(self, messages: list[dict[str, Any]], metadata: dict[str, Any]) -> InteractionResponse:
        answer = next((m.get("content") or "" for m in reversed(messages) if m.get("role") == "assistant"), "")
        ground_truth = interaction_kwargs(metadata).get("ground_truth", metadata.get("ground_truth"))
        if ground_truth is None:
            raise ValueError("gsm8k interaction: the row has no ground truth (extra_info.interaction_kwargs."
                             "ground_truth or reward_model.ground_truth)")
        reward = gsm8k.compute_score(str(answer), str(ground_truth), method="strict", format_score=0.0, score=1.0)
        if reward == 1.0:
            return InteractionResponse(reply=self.CORRECT, done=True, reward=reward)
        return InteractionResponse(reply=self.RETRY, reward=reward)


# verl's interaction classes (verl/interactions/*.py) -> the built-in with the same meaning.
VERL_INTERACTION_CLASSES = {"Gsm8kInteraction": "gsm8k"}


class NamedInteractions:
    """The interactions of a verl interaction file, by name; each row picks one by
    ``extra_info.interaction_kwargs.name`` (verl requires the name, and so does this)."""

    def __init__(self, interactions: Mapping[str, Interaction]) -> None:
        self.interactions = dict(interactions)

    async def respond(self, messages: list[dict[str, Any]], metadata: dict[str, Any]) -> InteractionResponse:
        name = interaction_kwargs(metadata).get("name")
        if name is None:
            raise ValueError("the row names no interaction: verl's rows carry extra_info.interaction_kwargs.name "
                             f"(one of {', '.join(self.interactions)})")
        if name not in self.interactions:
            raise ValueError(f"the row's interaction {name!r} is not in the interaction file "
                             f"(it has {', '.join(self.interactions)})")
        return await self.interactions[name].respond(messages, metadata)


def load_interaction_config(path: str | Path) -> NamedInteractions:
    """verl's interaction file: ``interaction:`` a list of ``name``, ``class_name`` (a verl class with a
    built-in here, or a hybridflow ``module:Class``) and ``config`` (the class's keyword arguments;
    verl's GSM8K interaction takes none). ``ValueError`` naming the entry otherwise."""
    file = Path(path)
    try:
        config = yaml.safe_load(file.read_text())
    except (OSError, yaml.YAMLError) as error:
        raise ValueError(f"cannot read the interaction config {file}: {error}") from error
    if not isinstance(config, dict) or not isinstance(config.get("interaction"), list) or not config["interaction"]:
        raise ValueError(f"interaction config {file} must be a mapping with an 'interaction' list of entries "
                         "(name, class_name, config)")
    built: dict[str, Interaction] = {}
    for index, entry in enumerate(config["interaction"]):
        where = f"interaction config {file}, interaction[{index}]"
        if not isinstance(entry, dict) or "class_name" not in entry:
            raise ValueError(f"{where}: an entry needs class_name (and name, config)")
        class_name = str(entry["class_name"])
        short = class_name.rsplit(".", 1)[-1]
        if ":" in class_name:
            target = class_name
        elif short in VERL_INTERACTION_CLASSES:
            target = VERL_INTERACTION_CLASSES[short]
        else:
            raise ValueError(f"{where}: verl interaction class {class_name} has no hybridflow equivalent; write a "
                             "class with async respond(messages, metadata) -> InteractionResponse "
                             "(hybridflow.agents.interactions) and name it as 'my_package.module:MyInteraction'. "
                             f"Built-in: {', '.join(VERL_INTERACTION_CLASSES)}")
        name = str(entry.get("name") or short)
        if name in built:
            raise ValueError(f"{where}: two interactions are named {name!r}")
        kwargs = dict(entry.get("config") or {})
        try:
            built[name] = build_interaction(target, **kwargs)
        except TypeError as error:
            raise ValueError(f"{where}: {class_name} does not take config {kwargs}: {error}") from error
    return NamedInteractions(built)
