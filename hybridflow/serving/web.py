"""FastAPI, Starlette and pydantic for the HTTP server, imported in one place so that a missing
extra is one clear error: ``hybridflow serve`` (and ``rollout.mode=server``) need them, the engine
and the offline ``LLM`` do not.
"""

try:
    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, Response, StreamingResponse
    from pydantic import BaseModel, ConfigDict, Field
    from starlette.exceptions import HTTPException as StarletteHTTPException
except ImportError as exc:  # the server is an optional extra; the engine itself does not need it
    raise ImportError("hybridflow serve needs FastAPI and uvicorn: pip install 'hybridflow[serve]'") from exc

__all__ = [
    "BaseModel", "ConfigDict", "FastAPI", "Field", "JSONResponse", "Request", "RequestValidationError", "Response",
    "StarletteHTTPException", "StreamingResponse",
]
