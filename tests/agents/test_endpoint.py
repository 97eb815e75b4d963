"""The endpoint's answers to bad requests: OpenAI-shaped errors whose message names the cause; and its formats."""

import asyncio
import json
import logging

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from psrl.rollout.engines.base import turns
from psrl.tasks.agent.chat import ChatTemplate, ToolsIgnored, parse_turn
from psrl.tasks.agent.endpoint import MODEL
from tests.agents.conftest import scripted_engine

HELLO = [{"role": "user", "content": "hi"}]


def serve(task, engine, calls):
    """Open one trajectory (``t0``) and one finished (``t1``); ``calls(http, base)`` posts to them."""

    async def run():
        endpoint = await task.start_endpoint()
        try:
            endpoint.open(task.conversation("t0", turns(engine)))
            endpoint.open(task.conversation("t1", turns(engine)))
            endpoint.finish("t1")
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{endpoint.port}") as http:
                return await calls(http)
        finally:
            await task.close()
            await engine.close()

    return asyncio.run(run())


def post(path, body):
    async def calls(http):
        raw = body if isinstance(body, (bytes, str)) else json.dumps(body)
        r = await http.post(path, content=raw, headers={"content-type": "application/json"})
        return r.status_code, r.json()

    return calls


@pytest.mark.parametrize(
    ("path", "body", "status", "words"),
    [
        ("/t/nope/v1/chat/completions", {"model": MODEL, "messages": HELLO}, 404, "unknown trajectory 'nope'"),
        ("/t/t1/v1/chat/completions", {"model": MODEL, "messages": HELLO}, 404, "trajectory t1 is finished"),
        ("/t/t0/v1/chat/completions", {"model": "gpt-4o", "messages": HELLO}, 404, "the model 'gpt-4o' does not"),
        ("/t/t0/v1/chat/completions", b"{not json", 400, "not JSON"),
        ("/t/t0/v1/chat/completions", b"[1, 2]", 400, "must be a JSON object"),
        ("/t/t0/v1/chat/completions", {"model": MODEL}, 400, "messages must be a non-empty list"),
        ("/t/t0/v1/chat/completions", {"model": MODEL, "messages": [{"content": "x"}]}, 400, "string role"),
        ("/t/t0/v1/chat/completions", {"model": MODEL, "messages": HELLO, "n": 2}, 400, "only n=1"),
        ("/t/t0/v1/chat/completions", {"model": MODEL, "messages": HELLO, "max_tokens": "8"}, 400, "max_tokens"),
        ("/t/t0/v1/chat/completions", {"model": MODEL, "messages": HELLO, "stop": 3}, 400, "stop must be"),
        ("/t/t0/v1/chat/completions", {"model": MODEL, "messages": HELLO, "tools": "add"}, 400, "tools must be"),
        (
            "/t/t0/v1/chat/completions",
            {"model": MODEL, "messages": [{"role": "user", "content": "x" * 2000}]},
            400,
            "maximum context length",
        ),
        ("/t/t0/v1/completions", {"model": MODEL, "prompt": ""}, 400, "prompt must be"),
        ("/t/t0/v1/completions", {"model": MODEL, "prompt": [-1]}, 400, "token id -1, outside"),
        ("/t/t0/v1/completions", {"model": MODEL, "prompt": [1, 10**9]}, 400, f"token id {10**9}, outside"),
    ],
)
def test_a_bad_request_gets_an_openai_error_naming_the_cause(make_task, path, body, status, words):
    task = make_task()
    _, engine = scripted_engine(task, ["1"])
    got_status, got = serve(task, engine, post(path, body))
    assert got_status == status
    assert set(got["error"]) == {"message", "type", "param", "code"} and words in got["error"]["message"]


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    st.dictionaries(
        st.sampled_from(["model", "messages", "n", "max_tokens", "stop", "tools", "tool_choice", "logprobs", "prompt"]),
        st.recursive(
            st.none() | st.booleans() | st.integers(-3, 3) | st.text(max_size=5),
            lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
            max_leaves=6,
        ),
    )
)
def test_any_request_body_is_answered_or_refused_never_crashes(make_task, body):
    """Fuzzed fields over a valid body, for both generating routes: a completion or an OpenAI error, never a
    server error."""
    body = {"model": MODEL, "messages": HELLO, "prompt": "hi", **body}
    task = make_task()
    _, engine = scripted_engine(task, ["1"])

    async def calls(http):
        out = []
        for route in ("chat/completions", "completions"):
            r = await http.post(f"/t/t0/v1/{route}", json=body)
            out.append((r.status_code, r.json()))
        return out

    for status, got in serve(task, engine, calls):
        assert (status == 200 and "choices" in got) or (status in (400, 404) and "message" in got["error"]), got


def test_models_and_token_in_completions(make_task):
    """``/models`` lists the one name; ``/completions`` takes token ids and answers with logprobs and usage."""
    task = make_task()
    _, engine = scripted_engine(task, ["42"])
    ids = task.tokenizer.encode("<|im_start|>assistant\n")

    async def calls(http):
        models = (await http.get("/t/t0/v1/models")).json()
        r = await http.post("/t/t0/v1/completions", json={"model": MODEL, "prompt": ids, "logprobs": 1})
        return models, r.json()

    models, out = serve(task, engine, calls)
    assert [m["id"] for m in models["data"]] == [MODEL]
    choice = out["choices"][0]
    assert choice["text"] == "42" and choice["finish_reason"] == "stop"
    assert len(choice["logprobs"]["token_logprobs"]) == out["usage"]["completion_tokens"] == 3
    assert out["usage"]["prompt_tokens"] == len(ids)


class _Tok:
    """A tokenizer whose template renders only content (as SmolLM2-135M-Instruct's does)."""

    chat_template = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<eos>\n{% endfor %}"
    eos_id, bos_id = 0, None

    def decode(self, ids):
        return "<eos>"


TOOLS = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]


def test_tools_the_tokenizers_template_ignores_use_psrls_template_said_once(caplog):
    template = ChatTemplate(_Tok(), "auto")
    assert not template.renders_tools
    with caplog.at_level(logging.WARNING):
        texts = [template.render(HELLO, TOOLS) for _ in range(2)]
    assert all('"name": "lookup"' in t for t in texts)
    assert sum("ignores tools" in r.message for r in caplog.records) == 1
    assert "lookup" not in template.render(HELLO)  # without tools: the tokenizer's own template


def test_tools_the_template_ignores_are_an_error_when_asked():
    with pytest.raises(ToolsIgnored, match="does not render tools"):
        ChatTemplate(_Tok(), "tokenizer").render(HELLO, TOOLS)


@pytest.mark.parametrize(
    ("text", "content", "names"),
    [
        ('<tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call>', "", ["a"]),
        (
            'ok <tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>{"name": "b"}</tool_call>',
            "ok",
            ["a", "b"],
        ),
        ("<tool_call>{not json}</tool_call>", "<tool_call>{not json}</tool_call>", []),
        ('<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"arguments": {}}</tool_call>', []),
        ("plain", "plain", []),
    ],
)
def test_hermes_calls_are_parsed_and_malformed_ones_stay_visible(text, content, names):
    turn = parse_turn(text)
    assert turn.content == content and [c["function"]["name"] for c in turn.tool_calls] == names
    assert all(isinstance(c["function"]["arguments"], str) for c in turn.tool_calls)
    assert parse_turn(text, "none").tool_calls == []


def test_a_failure_under_a_turn_reaches_the_agent_named(make_task):
    """An engine (or psrl) error during a turn is an OpenAI-style 500 naming it, not a bare server error."""
    task = make_task()

    async def broken(context, budget):
        raise RuntimeError("engine went away")

    async def run():
        endpoint = await task.start_endpoint()
        try:
            endpoint.open(task.conversation("t0", broken))
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{endpoint.port}") as http:
                r = await http.post("/t/t0/v1/chat/completions", json={"model": MODEL, "messages": HELLO})
                return r.status_code, r.json()
        finally:
            await task.close()

    status, body = asyncio.run(run())
    assert status == 500 and "RuntimeError: engine went away" in body["error"]["message"]
