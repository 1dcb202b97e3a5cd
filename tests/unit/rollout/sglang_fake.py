"""A scripted fake of an SGLang server's native HTTP API, run as its own process by the tests of
``hybridflow.rollout.sglang_engine`` (``python sglang_fake.py --model-path X --port P ...``).

It plays SGLang's side of the external boundary only, with request and reply bodies shaped as in
sglang 0.5.x (``srt/entrypoints/http_server.py``, ``srt/managers/io_struct.py``): ``/health``,
``/generate`` (batched ``input_ids`` and ``sampling_params``, ``return_logprob``,
``top_logprobs_num``, ``meta_info.finish_reason``), ``/abort_request``, ``/flush_cache``,
``/release_memory_occupation``, ``/resume_memory_occupation``, ``/init_weights_update_group``
(joins a group built like SGLang's: a ``tcp://`` rendezvous, a store prefixed by the group name,
torch's group helper) and ``/update_weights_from_distributed`` (one broadcast from rank 0 per
tensor, in order). ``/_fake/log`` and ``/_fake/weights`` let a test see what arrived.

Its "model": token ``t`` is the text ``chr(ord('a') + t % 26)``, EOS is ``EOS``; a sample's tokens
come from ``random.Random(sampling_seed)`` (greedy: the prompt's last token + 1, + 2, ...); the
logprob of token ``t`` is ``-(t % 7 + 1) / 10``. A prompt starting with ``HANG`` is never
answered until it is aborted.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
from datetime import timedelta
from typing import Any

import uvicorn
from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse

VOCAB = 50
EOS = 2
HANG = 49

app = FastAPI()
LOG: list[dict[str, Any]] = []
WEIGHTS: dict[str, list[Any]] = {}
ABORTED: set[str] = set()
GROUPS: dict[str, Any] = {}
STATE = {"healthy": True}
ARGV: list[str] = []


def text_of(token: int) -> str:
    return chr(ord("a") + token % 26)


def logprob_of(token: int) -> float:
    return -(token % 7 + 1) / 10


def sample(prompt: list[int], params: dict[str, Any], top_n: int) -> tuple[list[int], dict[str, Any]]:
    rng = random.Random(params.get("sampling_seed", 42))
    greedy = params.get("temperature", 1.0) == 0
    stops = set(params.get("stop_token_ids") or [])
    stop_strs = params.get("stop") or []
    tokens: list[int] = []
    finish: dict[str, Any] = {"type": "length", "length": params.get("max_new_tokens", 128)}
    for step in range(params.get("max_new_tokens", 128)):
        token = (prompt[-1] + step + 1) % VOCAB if greedy else rng.randrange(3, VOCAB - 1)
        tokens.append(token)
        if token in stops or (token == EOS and not params.get("ignore_eos")):
            finish = {"type": "stop", "matched": token}
            break
        text = "".join(map(text_of, tokens))
        matched = next((s for s in stop_strs if s in text), None)
        if matched is not None:
            finish = {"type": "stop", "matched": matched}
            break
    return tokens, finish


def output(rid: str, prompt: list[int], tokens: list[int], finish: dict[str, Any], top_n: int) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "id": rid, "finish_reason": finish, "prompt_tokens": len(prompt), "completion_tokens": len(tokens),
        "cached_tokens": 0, "weight_version": "default",
        "input_token_logprobs": [[None, prompt[0], None]] + [[logprob_of(t), t, None] for t in prompt[1:]],
        "output_token_logprobs": [[logprob_of(t), t, None] for t in tokens],
        "output_token_logprobs_length": len(tokens),
    }
    if top_n:
        meta["output_top_logprobs"] = [[[-0.05 * (k + 1), (t + k + 1) % VOCAB, None] for k in range(top_n)]
                                       for t in tokens]
    return {"text": "".join(map(text_of, tokens)), "output_ids": tokens, "meta_info": meta}


@app.get("/health")
async def health() -> Response:
    return Response(status_code=200 if STATE["healthy"] else 503)


@app.post("/generate")
async def generate(request: Request) -> Any:
    body = await request.json()
    LOG.append({"path": "/generate", "body": body})
    prompts, params, rids = body["input_ids"], body["sampling_params"], body["rid"]
    if not (isinstance(prompts[0], list) and len(prompts) == len(params) == len(rids)):
        return JSONResponse({"error": {"message": "batch fields disagree"}}, status_code=400)
    if prompts[0][0] == HANG:
        while not all(rid in ABORTED for rid in rids):
            await asyncio.sleep(0.05)
        return [output(rid, p, [], {"type": "abort", "message": "aborted"}, 0) for rid, p in zip(rids, prompts)]
    top_n = int(body.get("top_logprobs_num") or 0)
    outputs = []
    for rid, prompt, p in zip(rids, prompts, params):
        tokens, finish = sample(prompt, p, top_n)
        outputs.append(output(rid, prompt, tokens, finish, top_n))
    return outputs


@app.post("/abort_request")
async def abort_request(request: Request) -> Response:
    body = await request.json()
    LOG.append({"path": "/abort_request", "body": body})
    ABORTED.add(body["rid"])
    return Response(status_code=200)


@app.api_route("/flush_cache", methods=["GET", "POST"])
async def flush_cache() -> Response:
    LOG.append({"path": "/flush_cache", "body": None})
    return Response(content="Cache flushed.\n", status_code=200)


@app.api_route("/release_memory_occupation", methods=["GET", "POST"])
async def release(request: Request) -> None:
    LOG.append({"path": "/release_memory_occupation", "body": await request.json()})


@app.api_route("/resume_memory_occupation", methods=["GET", "POST"])
async def resume(request: Request) -> None:
    LOG.append({"path": "/resume_memory_occupation", "body": await request.json()})


@app.post("/init_weights_update_group")
def init_weights_update_group(body: dict[str, Any]) -> dict[str, Any]:
    from torch.distributed import distributed_c10d as c10d

    LOG.append({"path": "/init_weights_update_group", "body": body})
    timeout = timedelta(seconds=60)
    store, rank, world = next(c10d.rendezvous(f"tcp://{body['master_address']}:{body['master_port']}",
                                              body["rank_offset"], body["world_size"], timeout=timeout))
    store.set_timeout(timeout)
    group, _ = c10d._new_process_group_helper(world, rank, [], c10d.Backend(body.get("backend", "nccl")),
                                              c10d.PrefixStore(body["group_name"], store),
                                              group_name=body["group_name"], backend_options=None, timeout=timeout)
    c10d._world.pg_group_ranks[group] = {i: i for i in range(world)}
    GROUPS[body["group_name"]] = group
    return {"success": True, "message": "Succeeded to initialize custom process group."}


@app.post("/update_weights_from_distributed")
def update_weights_from_distributed(body: dict[str, Any]) -> Any:
    import torch
    import torch.distributed as dist

    LOG.append({"path": "/update_weights_from_distributed", "body": body})
    group = GROUPS.get(body.get("group_name", "weight_update_group"))
    if group is None:
        return JSONResponse({"success": False, "message": "Please call `init_weights_update_group` first."},
                            status_code=400)
    received = []
    for name, dtype, shape in zip(body["names"], body["dtypes"], body["shapes"]):
        tensor = torch.empty(shape, dtype=getattr(torch, dtype))
        received.append((name, tensor, dist.broadcast(tensor, src=0, group=group, async_op=True)))
    for name, tensor, work in received:
        work.wait()
        WEIGHTS[name] = [list(tensor.shape), float(tensor.double().sum())]
    return {"success": True, "message": "Succeeded to update parameter online."}


@app.get("/_fake/log")
async def fake_log() -> list[dict[str, Any]]:
    return LOG


@app.post("/_fake/forget_groups")
async def forget_groups() -> None:
    GROUPS.clear()  # as after a restart: the next update is refused


@app.get("/_fake/argv")
async def fake_argv() -> list[str]:
    return ARGV


@app.get("/_fake/weights")
async def fake_weights() -> dict[str, list[Any]]:
    return WEIGHTS


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--fake-never-healthy", action="store_true")
    parser.add_argument("--fake-exit-at-start", action="store_true")
    args, _ = parser.parse_known_args(argv)  # SGLang's own flags are accepted and ignored
    ARGV.extend(argv)
    if args.fake_exit_at_start:
        print("fake: failing at start-up as asked", flush=True)
        sys.exit(3)
    STATE["healthy"] = not args.fake_never_healthy
    import torch.distributed  # noqa: F401  (before serving: the first weight sync must not wait for it)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main(sys.argv[1:])
