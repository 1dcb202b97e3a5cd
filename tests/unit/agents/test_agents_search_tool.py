"""The ``search`` tool (verl's SearchTool) against a fake search-R1 retrieval server on 127.0.0.1:
verl's request, verl's formatting of the documents, and every failure (slow, 5xx, refused,
malformed) an error message for the model within the call's budget, never a crashed episode."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from hybridflow.agents.base import AgentContext, AgentRow, AgentRunner
from hybridflow.agents.parsers import ToolCall
from hybridflow.agents.search import RetrievalClient, RetrievalSettings, SearchError, format_results
from hybridflow.agents.tokens import render_ids
from hybridflow.agents.tools import load_tools
from hybridflow.types import RowFields, SamplingParams

VERL_SEARCH_CONFIG = Path(__file__).parents[2] / "data" / "verl_tool_configs" / "search_tool_config.yaml"


class FakeRetrieval:
    """A retrieval server: answers each query with ``topk`` documents titled after it, unless told to
    be slow (``delay_s``), to fail (``statuses``: the status of each next request) or to misbehave."""

    def __init__(self) -> None:
        self.requests: list[dict] = []
        self.content_types: list[str] = []
        self.delay_s = 0.0
        self.statuses: list[int] = []
        self.body: bytes | None = None  # answer this instead of documents
        self.cut = False  # promise more bytes than are sent, then hang up
        self.in_flight = 0
        self.max_in_flight = 0
        self._lock = threading.Lock()
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                fake.handle(self)

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/retrieve"
        threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

    def handle(self, handler: BaseHTTPRequestHandler) -> None:
        request = json.loads(handler.rfile.read(int(handler.headers["Content-Length"])))
        with self._lock:
            self.requests.append(request)
            self.content_types.append(handler.headers["Content-Type"])
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
            status = self.statuses.pop(0) if self.statuses else 200
        try:
            time.sleep(self.delay_s)
            # The search counts as finished once the answer is ready, before it is sent: a client
            # that has its answer frees its slot and may send the next search before this thread
            # runs again, so counting down after the write would see one search too many in flight.
            with self._lock:
                self.in_flight -= 1
            if status != 200:
                body = b"retriever overloaded"
            elif self.body is not None:
                body = self.body
            else:
                body = json.dumps({"result": [
                    [{"document": {"contents": f"{query} {rank}\npassage {rank} about {query}"}, "score": 1.0 / rank}
                     for rank in range(1, request["topk"] + 1)]
                    for query in request["queries"]]}).encode()
            handler.send_response(status)
            handler.send_header("Content-Length", str(len(body) + (1000 if self.cut else 0)))
            handler.end_headers()
            handler.wfile.write(body)
            handler.close_connection = self.cut
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client gave up waiting: what a slow server's client does

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def retrieval():
    fake = FakeRetrieval()
    yield fake
    fake.close()


def verl_file(tmp_path: Path, url: str, timeout_s: float = 30, limit: int = 120) -> str:
    """verl's search_tool_config.yaml pointed at ``url``, with its time and concurrency limits set."""
    text = VERL_SEARCH_CONFIG.read_text()
    for old, new in [("http://127.0.0.1:8000/retrieve", url), ("timeout: 30", f"timeout: {timeout_s}"),
                     ("num_workers: 120", f"num_workers: {limit}")]:
        assert old in text
        text = text.replace(old, new)
    path = tmp_path / "search_tool_config.yaml"
    path.write_text(text)
    return str(path)


def search(registry, queries):
    return asyncio.run(registry.call(ToolCall("search", {"query_list": queries})))


def test_verls_search_tool_file_is_the_search_tool():
    registry = load_tools(str(VERL_SEARCH_CONFIG))  # builds without contacting the server
    assert registry.names == ["search"]
    schema = registry.schemas()[0]["function"]
    assert schema["description"] == "Searches the web for relevant information based on the given query."
    assert schema["parameters"]["required"] == ["query_list"]


def test_the_server_gets_verls_request_and_the_model_verls_text(tmp_path, retrieval):
    registry = load_tools(verl_file(tmp_path, retrieval.url))
    result = search(registry, ["capital of France", "Eiffel tower"])
    assert retrieval.requests == [{"queries": ["capital of France", "Eiffel tower"], "topk": 3, "return_scores": True}]
    assert retrieval.content_types == ["application/json"]
    assert result.status == "ok"
    # Each query's documents as "Doc i (Title: <first line>)\n<the rest>", queries apart by "---".
    france = "\n\n".join(f"Doc {rank} (Title: capital of France {rank})\npassage {rank} about capital of France"
                         for rank in (1, 2, 3))
    tower = "\n\n".join(f"Doc {rank} (Title: Eiffel tower {rank})\npassage {rank} about Eiffel tower"
                        for rank in (1, 2, 3))
    assert result.text == json.dumps({"result": france + "\n---\n" + tower})


def test_a_slow_server_costs_the_call_its_budget_and_no_more(tmp_path, retrieval):
    retrieval.delay_s = 5.0
    registry = load_tools(verl_file(tmp_path, retrieval.url, timeout_s=0.5))
    start = time.monotonic()
    result = search(registry, ["slow"])
    assert time.monotonic() - start < 2.5
    assert result.status == "error"
    assert f"retrieval server {retrieval.url} gave no answer within 0.5 s" in result.text
    assert registry.stats["search"].errors == 1


def test_a_server_error_is_retried_then_reported(tmp_path, retrieval):
    retrieval.statuses = [500] * 100
    registry = load_tools(verl_file(tmp_path, retrieval.url, timeout_s=0.5))
    start = time.monotonic()
    result = search(registry, ["anything"])
    assert time.monotonic() - start < 2.5
    assert result.status == "error"
    assert "HTTP 500 retriever overloaded (gave up after 1 attempt(s) in the 0.5 s budget)" in result.text
    # Within a larger budget, a server that recovers answers the same call.
    client = RetrievalClient(RetrievalSettings(retrieval.url), retry_delay_s=0.01)
    retrieval.statuses = [503, 500]
    assert "Doc 1 (Title: again 1)" in client.search(["again"])
    assert len(retrieval.requests) == 1 + 3


def test_a_client_error_is_not_retried_and_nothing_answers_a_closed_port(tmp_path, retrieval):
    retrieval.statuses = [404]
    registry = load_tools(verl_file(tmp_path, retrieval.url))
    result = search(registry, ["x"])
    assert (result.status, len(retrieval.requests)) == ("error", 1)
    assert "answered HTTP 404: retriever overloaded" in result.text
    url = retrieval.url
    retrieval.close()
    closed = search(load_tools(verl_file(tmp_path, url, timeout_s=0.5)), ["x"])
    assert closed.status == "error" and "cannot connect" in closed.text


def test_an_answer_cut_short_is_an_error(tmp_path, retrieval):
    retrieval.cut = True
    result = search(load_tools(verl_file(tmp_path, retrieval.url, timeout_s=0.5)), ["x"])
    assert result.status == "error" and "connection failed (the answer was cut short after" in result.text


def test_malformed_answers_and_arguments_are_the_models_information(tmp_path, retrieval):
    registry = load_tools(verl_file(tmp_path, retrieval.url))
    retrieval.body = b"<html>not json</html>"
    assert "answered something that is not JSON: <html>" in search(registry, ["x"]).text
    retrieval.body = json.dumps({"result": [[{"doc": "no contents"}]]}).encode()
    assert "has no document.contents text" in search(registry, ["x"]).text
    retrieval.body = json.dumps({"result": [[], []]}).encode()
    assert search(registry, ["x", "y"]).text == '{"result": "No search results found."}'
    for queries in ([], ["ok", ""], "a string"):
        assert search(registry, queries).status == "error"
    assert registry.stats["search"].errors == 5 and registry.stats["search"].calls == 6


def test_no_more_searches_in_flight_than_the_limit(tmp_path, retrieval):
    retrieval.delay_s = 0.2
    registry = load_tools(verl_file(tmp_path, retrieval.url, limit=2))

    async def six() -> list:
        return await asyncio.gather(*(registry.call(ToolCall("search", {"query_list": [f"q{i}"]})) for i in range(6)))

    results = asyncio.run(six())
    assert [result.status for result in results] == ["ok"] * 6
    assert retrieval.max_in_flight == 2


def test_an_episode_goes_on_after_a_failed_search(tmp_path, retrieval, tokenizer, scripted):
    retrieval.statuses = [404]
    registry = load_tools(verl_file(tmp_path, retrieval.url))
    runner = AgentRunner(AgentContext(tokenizer, tools=registry), default_agent="tool_agent")

    def reply(text: str, turn: int) -> str:
        call = '<tool_call>{"name": "search", "arguments": {"query_list": ["Paris"]}}</tool_call>'
        return call if turn < 2 else "<answer>Paris</answer>"

    prompt = render_ids(tokenizer, [{"role": "user", "content": "Capital of France?"}], add_generation_prompt=True)
    (episode,) = runner.generate_sync([AgentRow(prompt, RowFields(extra_info={}))], SamplingParams(max_tokens=2000),
                                      scripted(reply))
    messages = episode.agent.messages
    assert "HTTP 404" in messages[1]["content"]  # the first search failed ...
    assert "Doc 1 (Title: Paris 1)" in messages[3]["content"]  # ... the second found documents
    assert messages[-1]["content"] == "<answer>Paris</answer>"
    assert episode.agent.stop == "no_tool_call"
    assert episode.agent.metrics["tool_errors"] == 1.0


def test_format_results_is_verls_text():
    answer = {"result": [[{"document": {"contents": "Paris\nThe capital of France.\nPopulation 2M."}}]]}
    assert json.loads(format_results(answer)) == {"result": "Doc 1 (Title: Paris)\nThe capital of France.\n"
                                                            "Population 2M."}
    with pytest.raises(SearchError, match="has no 'result' list"):
        format_results({"documents": []})


@pytest.mark.parametrize(("text", "match"), [
    ("timeout: 30", r"tools\[0\]: verl tool class verl\.tools\.search_tool\.SearchTool: unknown SearchTool config "
                    r"key\(s\) \['timeout_seconds'\]"),
    ("retrieval_service_url: http://127.0.0.1:8000/retrieve",
     r"config\.retrieval_service_url must be an http\(s\) URL of the retrieval server .* got 'localhost:8000'"),
    ("type: native", r"SearchTool config\.type='mcp': only verl's native tools"),
])
def test_a_bad_verl_config_is_refused_naming_the_key(tmp_path, text, match):
    bad = {"timeout: 30": "timeout_seconds: 30",
           "retrieval_service_url: http://127.0.0.1:8000/retrieve": "retrieval_service_url: localhost:8000",
           "type: native": "type: mcp"}[text]
    path = tmp_path / "bad.yaml"
    path.write_text(VERL_SEARCH_CONFIG.read_text().replace(text, bad))
    with pytest.raises(ValueError, match=match):
        load_tools(str(path))


def test_hybridflows_own_entry_and_the_builtin_name(tmp_path, retrieval):
    path = tmp_path / "tools.yaml"
    path.write_text(f"tools:\n  - name: search\n    timeout_s: 5\n    config: {{retrieval_service_url: {retrieval.url}, "
                    f"topk: 1, max_concurrency: 4}}\n")
    registry = load_tools(str(path))
    assert json.loads(search(registry, ["x"]).text) == {"result": "Doc 1 (Title: x 1)\npassage 1 about x"}
    assert retrieval.requests[-1]["topk"] == 1
    with pytest.raises(ValueError, match=r"config\.retrieval_service_url is required"):
        load_tools("builtin:search")
    path.write_text("tools:\n  - name: search\n    config: {url: http://x}\n")
    with pytest.raises(ValueError, match=r"unknown config key\(s\) \['url'\]; known: retrieval_service_url"):
        load_tools(str(path))
