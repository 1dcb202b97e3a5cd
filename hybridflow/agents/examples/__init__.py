"""Agents a user can copy: ``openai_calculator`` (an OpenAI-client agent for the calculator task)."""
