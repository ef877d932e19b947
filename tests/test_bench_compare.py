"""The pure parts of bench/compare.py: wrk output parsing, percentiles, the table with ratios,
HTTP/1.1 response reading and the fake upstream. No load, no timing assertions."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def compare() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_compare", ROOT / "bench" / "compare.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["bench_compare"] = mod  # dataclasses look their module up while the class is built
    spec.loader.exec_module(mod)
    return mod


WRK_OUT = """Running 2s test @ http://127.0.0.1:5000/v1/chat/completions
  1 threads and 64 connections
  Thread Stats   Avg      Stdev     Max   +/- Stdev
    Latency     5.01ms    1.02ms  20.31ms   90.00%
  6400 requests in 2.00s, 3.1MB read
Requests/sec:   3200.00
Transfer/sec:      1.55MB
BENCH requests 6400
BENCH duration_us 2000000
BENCH errors connect=0 read=1 write=0 status=3 timeout=0
BENCH latency_us min=900 mean=5010.5 max=20310
BENCH pct 1 1000
BENCH pct 50 4800
BENCH pct 99 9000
BENCH pct 99.9 15000
"""


def test_parse_wrk(compare: ModuleType) -> None:
    run = compare.parse_wrk(WRK_OUT)
    assert run.requests == 6400
    assert run.duration_s == 2.0
    assert run.rps == 3200.0
    assert run.errors == {"read": 1, "status": 3}
    assert run.error_count == 4
    assert run.p(50) == 4.8 and run.p(99) == 9.0 and run.p(99.9) == 15.0
    assert run.mean_ms == pytest.approx(5.0105)
    assert run.max_ms == pytest.approx(20.31)


def test_parse_wrk_without_bench_lines(compare: ModuleType) -> None:
    run = compare.parse_wrk("unable to connect to 127.0.0.1:1 Connection refused\n")
    assert run.requests == 0 and run.rps == 0.0 and run.pct_ms == {}


def test_wrk_lua_embeds_the_body_and_percentiles(compare: ModuleType) -> None:
    lua = compare.wrk_lua(compare.BODY)
    assert json.dumps(compare.BODY) in lua
    assert "99.9" in lua and "__" not in lua
    assert "done = function(summary, latency, requests)" in lua


def test_percentile_linear_between_ranks(compare: ModuleType) -> None:
    assert compare.percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert compare.percentile([1.0, 2.0, 3.0, 4.0], 0) == 1.0
    assert compare.percentile([1.0, 2.0, 3.0, 4.0], 100) == 4.0
    assert compare.percentile([7.0], 99) == 7.0
    values = [float(i) for i in range(1, 101)]  # 1..100, unsorted on purpose below
    p = compare.percentiles(list(reversed(values)), [50, 99])
    assert p[50] == pytest.approx(50.5) and p[99] == pytest.approx(99.01)


def test_load_from_latencies(compare: ModuleType) -> None:
    run = compare.load_from_latencies([0.001, 0.002, 0.003], 1.5, {"timeout": 1})
    assert run.requests == 3 and run.rps == 2.0
    assert run.p(50) == pytest.approx(2.0) and run.mean_ms == pytest.approx(2.0) and run.max_ms == pytest.approx(3.0)
    assert run.errors == {"timeout": 1}
    assert compare.load_from_latencies([], 1.0, {}).requests == 0


def test_table_with_ratios(compare: ModuleType) -> None:
    direct = compare.Row("upstream directly", 0.2, 0.4, 10000.0)
    server = compare.Row("appserver", 1.0, 2.0, 2500.0, 60.0, 80.0, 0.45)
    absent = compare.Row("LiteLLM proxy", note=compare.LITELLM_HINT)
    text = compare.table([direct, server, absent], direct)
    lines = text.splitlines()
    assert lines[0].startswith("| target | c=1 p50 | c=1 p99 | c=64 req/s |")
    assert lines[2] == "| upstream directly | 0.20 ms | 0.40 ms | 10,000 | — | — |"
    assert lines[3] == "| appserver | 1.00 ms (5.00×) | 2.00 ms (5.00×) | 2,500 (0.25×) | 60 → 80 MB | 0.45 s |"
    assert "not installed (pip install 'litellm[proxy]')" in lines[4]


def test_ratio_formats(compare: ModuleType) -> None:
    assert compare.ratio(15.4, 0.16) == " (96.2×)"
    assert compare.ratio(640.0, 0.5) == " (1280×)"
    assert compare.ratio(75.0, 12812.0) == " (0.0059×)"
    assert compare.ratio(None, 1.0) == "" and compare.ratio(1.0, 0.0) == ""


def test_target_lines(compare: ModuleType) -> None:
    assert compare.target_line("rps", 3000.0, "req/s", 2500, at_least=True).endswith("meets")
    assert compare.target_line("p99", 6.0, "ms", 5).endswith("misses")
    assert compare.target_line("p99", None, "ms", 5).endswith("not measured")


def test_stream_gaps_and_in_flight(compare: ModuleType) -> None:
    assert compare.stream_gaps([1.0, 1.05, 1.2]) == pytest.approx([0.05, 0.15])
    assert compare.stream_gaps([1.0]) == []
    assert compare.max_in_flight([(0, 5), (1, 2), (3, 6), (7, 8)]) == 2


def feed(data: bytes) -> asyncio.StreamReader:
    reader = asyncio.StreamReader()
    reader.feed_data(data)
    reader.feed_eof()
    return reader


def test_read_response_content_length_and_chunked(compare: ModuleType) -> None:
    async def go() -> tuple[Any, Any]:
        a = await compare.read_response(
            feed(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nX-Conversation-Id: c1\r\n\r\nhi")
        )
        b = await compare.read_response(
            feed(b"HTTP/1.1 429 Too Many\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n2;x=y\r\nde\r\n0\r\n\r\n")
        )
        return a, b

    a, b = asyncio.run(go())
    assert (a.status, a.body, a.headers["x-conversation-id"]) == (200, b"hi", "c1")
    assert (b.status, b.body) == (429, b"abcde")


def test_http_request_bytes(compare: ModuleType) -> None:
    data = compare.http_request("/v1/chat/completions", 8000, {"a": 1}, {"X-Conversation-Id": "c"})
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"POST /v1/chat/completions HTTP/1.1\r\n")
    assert b"Content-Length: 8" in head and b"X-Conversation-Id: c" in head and body == b'{"a": 1}'
    assert compare.http_request("/metrics", 8000, None).startswith(b"GET /metrics HTTP/1.1\r\n")


def call_upstream(compare: ModuleType, path: str, body: dict[str, Any]) -> tuple[int, bytes]:
    app = compare.upstream_app(0.0, 3)
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}

    async def send(msg: dict[str, Any]) -> None:
        sent.append(msg)

    asyncio.run(app({"type": "http", "path": path}, receive, send))
    return sent[0]["status"], b"".join(m.get("body", b"") for m in sent[1:])


def test_upstream_answers_json_and_streams(compare: ModuleType) -> None:
    status, body = call_upstream(compare, "/v1/chat/completions", compare.BODY)
    assert status == 200
    assert json.loads(body)["choices"][0]["message"]["content"] == "Hello from the fake upstream."
    status, body = call_upstream(compare, "/slow/v1/chat/completions", {**compare.BODY, "stream": True})
    events = [e[len(b"data: ") :] for e in body.split(b"\n\n") if e]
    assert events[-1] == b"[DONE]"
    text = "".join(json.loads(e)["choices"][0]["delta"].get("content", "") for e in events[:-1])
    assert text == "t0 t1 t2 "


def test_summary_states_the_issue_ratios_when_measured(
    compare: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """With `--baseline` (and LiteLLM) in the run, the summary states the issue's relative targets:
    against the code it measured (≥ 4x), as a share of the upstream (≥ 0.2), against LiteLLM (≥ 30x);
    with the bare relay, the share of it the server keeps."""
    import argparse

    def run(rps: float, p50: float) -> dict[str, Any]:
        return {"rps": rps, "pct_ms": {"50": p50, "99": p50 * 2}, "errors": {}}

    b = compare.Bench(argparse.Namespace(), compare.Cpus(False), tmp_path)
    b.results["http"] = {
        "upstream": {"c1": run(8000, 0.1), "c64": run(10000, 5)},
        "relay": {"c1": run(2000, 0.4), "c64": run(5000, 12)},
        "appserver": {"c1": run(400, 0.9), "c64": run(1500, 40), "rss_idle_mb": 45.0, "rss_after_mb": 50.0},
        "baseline": {"c1": run(200, 4), "c64": run(500, 120), "rev": "a00da74"},
        "litellm": {"c1": run(60, 15), "c64": run(75, 800)},
    }
    compare.summary(b)
    out = capsys.readouterr().out
    lines = {line.split("  ")[2].strip(): line for line in out.splitlines() if line.startswith("    c=64")}
    assert (
        "3.00 ×" in lines["c=64 against the code at a00da74"] and "misses" in lines["c=64 against the code at a00da74"]
    )
    assert "0.150" in lines["c=64 as a share of the upstream direct"]
    assert lines["c=64 as a share of the bare relay (the floor; no target) 0.300"]
    assert "20.00 ×" in lines["c=64 against LiteLLM"] and "misses" in lines["c=64 against LiteLLM"]


def test_ab_reads_cpu_times_and_finds_source_trees(tmp_path: Path) -> None:
    """bench/ab.py's pure parts: CPU times from /proc, `.` and directories as they are."""
    import os

    spec = importlib.util.spec_from_file_location("bench_ab", ROOT / "bench" / "ab.py")
    assert spec is not None and spec.loader is not None
    ab = importlib.util.module_from_spec(spec)
    sys.modules["bench_ab"] = ab
    spec.loader.exec_module(ab)
    user, system = ab.cpu_times(os.getpid())
    assert user > 0 and system >= 0
    assert ab.source_tree(".", tmp_path) == ROOT and ab.source_tree(str(tmp_path), tmp_path) == tmp_path.resolve()
