"""Serving the native engine: the OpenAI-compatible HTTP server (``server`` and its parts, started
by ``launch``), its client (``http_client``, which a rollout worker uses to reach a replica) and the
offline ``LLM`` API (``llm``). FastAPI and uvicorn are imported only by the server's modules (through
``web``); the client needs httpx, the ``LLM`` neither.
"""
