"""Serving the native engine: the OpenAI-compatible HTTP server (``server``), its client
(``http_client``, which a rollout worker uses to reach a replica) and the offline ``LLM`` API
(``llm``). FastAPI and uvicorn are imported only by ``server``.
"""
