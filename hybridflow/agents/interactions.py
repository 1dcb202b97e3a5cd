"""Interactions: an optional user simulator for multi-turn dialogue tasks.

The tool agent consults the interaction after every assistant turn that made no tool call
(a turn addressed to the user). The interaction sees the conversation so far and the row's
metadata (``ground_truth`` and ``extra_info`` included) and may

- reply: the reply is appended as a user turn (loss mask 0) and the assistant continues;
- end the episode (``done``, or no reply);
- give a reward: the last reward given is stored in the trajectory's
  ``metadata["interaction_reward"]``.

One interaction object serves every episode of a run concurrently, so per-episode state must
live in the conversation or the metadata, not on the object.

``INTERACTIONS`` maps a config name to a ``module:Class`` path (none are built in); any
``module:Class`` path works too. The class is built with the keyword arguments of the config.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from hybridflow.agents.registry import resolve_object

INTERACTIONS: dict[str, str] = {}


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
