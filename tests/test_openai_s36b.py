"""OpenAI surface fixes from an outside tester's findings (session 36, helper b), through a real
`appserver serve` on loopback (token auth, echo agent `alpha`) with httpx, the real `openai` SDK and
raw sockets.

1. Chat's `tools[i].type` and an assistant history tool call's `type` are required, as OpenAI's
   `ChatCompletionTool` / `ChatCompletionMessageToolCall` have them (left out, null, 5 or "bogus"
   was taken as a function); and so is every other field those messages require (a `function`
   message's `content`, an `input_audio` part's `format`, a `file` part's `file`), its path named.
2. Errors about the legacy `functions` name `functions[i].…`, the field the client sent (they named
   `tools[i].function.…`), and a `function_call` naming no offered function names `function_call`
   (it named `tool_choice`).
3. A `Transfer-Encoding` with a coding besides `chunked` (`gzip, chunked`, …) is a 501 naming the
   coding, the connection closed (RFC 9112 §6.1); the body was read as if no coding were applied.
"""

from __future__ import annotations

import gzip
import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.openai_schema import require_conformance, validate
from tests.support.cli import cli_env, run_cli
from tests.support.serve import serving

pytestmark = pytest.mark.timeout(90)

PARAMS = {"type": "object", "properties": {}}
USER = {"role": "user", "content": "hi"}


class Env:
    def __init__(self, url: str, token: str) -> None:
        self.url, self.token = url, token

    def http(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {self.token}"}, timeout=30)

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=self.token, max_retries=0, timeout=30)

    def address(self) -> tuple[str, int]:
        host, port = self.url.removeprefix("http://").rsplit(":", 1)
        return host, int(port)


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    require_conformance()
    home: Path = tmp_path_factory.mktemp("s36b") / "home"
    home.mkdir()
    (home / "config.toml").write_text('[auth]\nmode = "token"\n')
    cli = cli_env(home)
    made = run_cli(home, "agents", "create", "--name", "alpha", env=cli)
    assert made.code == 0, made.err
    minted = run_cli(home, "token", "create", "--name", "tester", "--json", env=cli)
    assert minted.code == 0, minted.err
    with serving(home, env=cli) as sp:
        yield Env(sp.url, str(minted.json()["token"]))


def chat(http: httpx.Client, **body: Any) -> httpx.Response:
    return http.post("/v1/chat/completions", json={"model": "alpha", **body})


def refused(r: httpx.Response, code: str, param: str) -> dict[str, Any]:
    assert r.status_code == 400, r.text[:500]
    validate("ErrorResponse", r.json())
    err: dict[str, Any] = r.json()["error"]
    assert (err["code"], err["param"]) == (code, param), err
    return err


def history(call: dict[str, Any]) -> list[dict[str, Any]]:
    """A transcript whose assistant message made `call` (answered), then a new user message."""
    return [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "x"},
        USER,
    ]


FN_CALL = {"name": "lookup", "arguments": "{}"}


# ---------------------------------------------------------------- 1. required `type` and the like


@pytest.mark.parametrize(
    ("tool", "code"),
    [
        ({"function": {"name": "lookup", "parameters": PARAMS}}, "missing_required_parameter"),
        ({"type": None, "function": {"name": "lookup", "parameters": PARAMS}}, "invalid_type"),
    ],
    ids=["missing", "null"],
)
def test_chat_tool_type_is_required(env: Env, tool: dict[str, Any], code: str) -> None:
    with env.http() as http:
        refused(chat(http, messages=[USER], tools=[tool]), code, "tools[0].type")
        # as on /v1/responses, which already refused it
        refused(http.post("/v1/responses", json={"model": "alpha", "input": "hi", "tools": [{"name": "x"}]}),
                "missing_required_parameter", "tools[0].type")  # fmt: skip
        good = chat(http, messages=[USER], tools=[{"type": "function", "function": {"name": "lookup"}}])
        assert good.status_code == 200, good.text[:300]
    with pytest.raises(openai.BadRequestError) as caught, env.client() as client:
        client.chat.completions.create(model="alpha", messages=[USER], tools=[tool])  # type: ignore[list-item]
    assert (caught.value.code, caught.value.param) == (code, "tools[0].type")


@pytest.mark.parametrize(
    ("kind", "code"),
    [(..., "missing_required_parameter"), (None, "invalid_type"), (5, "invalid_type"), ("bogus", "invalid_value")],
    ids=["missing", "null", "int", "bogus"],
)
def test_history_tool_call_type_is_required(env: Env, kind: Any, code: str) -> None:
    call: dict[str, Any] = {"id": "c1", "function": FN_CALL}
    if kind is not ...:
        call["type"] = kind
    with env.http() as http:
        refused(chat(http, messages=history(call)), code, "messages[1].tool_calls[0].type")
        good = chat(http, messages=history({"id": "c1", "type": "function", "function": FN_CALL}))
        assert good.status_code == 200, good.text[:300]


def test_history_custom_call_is_checked(env: Env) -> None:
    """A custom tool call of the history is checked as OpenAI's `ChatCompletionMessageCustomToolCall`."""
    with env.http() as http:
        refused(
            chat(http, messages=history({"id": "c1", "type": "custom"})),
            "missing_required_parameter",
            "messages[1].tool_calls[0].custom",
        )
        refused(
            chat(http, messages=history({"id": "c1", "type": "custom", "custom": {"name": "g", "input": 5}})),
            "invalid_type",
            "messages[1].tool_calls[0].custom.input",
        )


def test_function_message_content_is_required(env: Env) -> None:
    legacy = [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": None, "function_call": {"name": "f", "arguments": "{}"}},
        {"role": "function", "name": "f"},
        USER,
    ]
    with env.http() as http:
        refused(chat(http, messages=legacy), "missing_required_parameter", "messages[2].content")
        legacy[2] = {"role": "function", "name": "f", "content": ["x"]}
        refused(chat(http, messages=legacy), "invalid_type", "messages[2].content")
        legacy[2] = {"role": "function", "name": "f", "content": None}  # null is OpenAI's too
        good = chat(http, messages=legacy)
        assert good.status_code == 200, good.text[:300]


@pytest.mark.parametrize(
    ("part", "code", "param"),
    [
        ({"type": "input_audio", "input_audio": {"data": "AAAA"}}, "missing_required_parameter", ".input_audio.format"),
        ({"type": "input_audio"}, "missing_required_parameter", ".input_audio"),
        ({"type": "input_audio", "input_audio": {"data": 5, "format": "wav"}}, "invalid_type", ".input_audio.data"),
        ({"type": "file"}, "missing_required_parameter", ".file"),
        ({"type": "file", "file": {"file_data": "data:,x", "filename": 5}}, "invalid_type", ".file.filename"),
    ],
    ids=["audio-format", "audio", "audio-data", "file", "filename"],
)
def test_media_part_fields(env: Env, part: dict[str, Any], code: str, param: str) -> None:
    """Required fields of a user message's audio and file parts, and their types, named by path
    (they were `invalid_content_part` naming the part, or a non-string `filename` was dropped)."""
    with env.http() as http:
        refused(chat(http, messages=[{"role": "user", "content": [part]}]), code, f"messages[0].content[0]{param}")


# ---------------------------------------------------------------- 2. legacy `functions` paths


@pytest.mark.parametrize(
    ("functions", "code", "param", "said"),
    [
        ([{"name": "ok"}, {"parameters": {}}], "missing_required_parameter", "functions[1].name", "functions[1].name"),
        ([{"name": "a b"}], "invalid_function_name", "functions[0].name", "functions[0].name"),
        ([{"name": 5}], "invalid_type", "functions[0].name", "functions[0].name"),
        ([{"name": "a", "parameters": "x"}], "invalid_type", "functions[0].parameters", "functions[0].parameters"),
        ([{"name": "a", "description": 5}], "invalid_type", "functions[0].description", "functions[0].description"),
        (["a"], "invalid_type", "functions[0]", "functions[0]"),
        ([{"name": "a"}, {"name": "a"}], "duplicate_function_name", "functions", "functions[1]"),
    ],
    ids=["no-name", "pattern", "name-int", "params-str", "desc-int", "not-object", "duplicate"],
)
def test_legacy_functions_errors_name_functions(
    env: Env, functions: list[Any], code: str, param: str, said: str
) -> None:
    with env.http() as http:
        err = refused(chat(http, messages=[USER], functions=functions), code, param)
    assert said in err["message"] and "tools" not in err["message"], err


def test_legacy_function_call_naming_no_function(env: Env) -> None:
    fns = [{"name": "lookup", "parameters": PARAMS}]
    with env.http() as http:
        err = refused(
            chat(http, messages=[USER], functions=fns, function_call={"name": "nope"}),
            "invalid_tool_choice",
            "function_call",
        )
        assert "'nope'" in err["message"] and "tool_choice" not in err["message"], err
        good = chat(http, messages=[USER], functions=fns, function_call={"name": "lookup"})
        assert good.status_code == 200, good.text[:300]


# ---------------------------------------------------------------- 3. Transfer-Encoding codings


BODY = json.dumps({"model": "alpha", "messages": [USER]}).encode()


def exchange(env: Env, te_lines: list[bytes], payload: bytes = BODY) -> tuple[int, dict[str, str], bytes, bool]:
    """POST a chunked body with these `Transfer-Encoding` lines on a raw socket; → (status,
    headers, body, whether the server closed the connection after its answer)."""
    head = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer "
        + env.token.encode()
        + b"\r\nContent-Type: application/json\r\n"
        + b"".join(b"Transfer-Encoding: " + te + b"\r\n" for te in te_lines)
        + b"\r\n"
    )
    chunks = b"%x\r\n" % len(payload) + payload + b"\r\n0\r\n\r\n"
    with socket.create_connection(env.address(), timeout=10) as s:
        s.sendall(head + chunks)
        data = b""
        deadline = time.monotonic() + 10
        closed = False
        while time.monotonic() < deadline:
            got = s.recv(65536)
            if not got:
                closed = True
                break
            data += got
            head_end = data.find(b"\r\n\r\n")
            if head_end >= 0:
                length = next(
                    (int(line.split(b":", 1)[1]) for line in data[:head_end].split(b"\r\n")
                     if line.lower().startswith(b"content-length:")),
                    None,
                )  # fmt: skip
                if (
                    length is not None
                    and len(data) >= head_end + 4 + length
                    and b"connection: close" not in data[:head_end].lower()
                ):
                    break  # a keep-alive answer, complete
    head_raw, _, body = data.partition(b"\r\n\r\n")
    lines = head_raw.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.strip().lower(): v.strip() for k, v in (line.split(":", 1) for line in lines[1:])}
    return status, headers, body, closed


@pytest.mark.parametrize(
    ("te_lines", "shown"),
    [
        ([b"gzip, chunked"], "'gzip'"),
        ([b"deflate, chunked"], "'deflate'"),
        ([b"x-bogus, chunked"], "'x-bogus'"),
        ([b"identity, chunked"], "'identity'"),
        ([b"gzip", b"chunked"], "'gzip'"),
    ],
    ids=["gzip", "deflate", "bogus", "identity", "two-fields"],
)
def test_transfer_coding_other_than_chunked_is_501(env: Env, te_lines: list[bytes], shown: str) -> None:
    status, headers, body, closed = exchange(env, te_lines)
    assert status == 501, (status, body[:300])
    assert headers.get("connection") == "close" and closed, headers
    assert headers.get("x-should-retry") == "false", headers
    error = json.loads(body)
    validate("ErrorResponse", error)
    assert error["error"]["code"] == "unsupported_transfer_encoding", error
    assert shown in error["error"]["message"], error


def test_really_gzipped_body_is_501_not_a_json_error(env: Env) -> None:
    status, _, body, _ = exchange(env, [b"gzip, chunked"], gzip.compress(BODY))
    assert status == 501, (status, body[:300])
    assert json.loads(body)["error"]["code"] == "unsupported_transfer_encoding"
    # a last coding other than chunked leaves the body's length unknown: 400, as before (RFC 9112 §6.3)
    status, headers, body, closed = exchange(env, [b"gzip"])
    assert status == 400 and closed, (status, body[:300])
    # chunked alone is taken as before, its connection kept
    status, headers, body, closed = exchange(env, [b"chunked"])
    assert status == 200, body[:300]
    assert json.loads(body)["object"] == "chat.completion"
    assert headers.get("connection") != "close" and not closed, headers
