"""gateway/stdio.py: only the gateway writes control lines; a plugin's prints cannot spoof one."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import textwrap
from pathlib import Path

from gateway.stdio import MAX_LINE, ControlLine, parse_line, read_lines

REPO = Path(__file__).resolve().parents[1]

CHILD = textwrap.dedent(
    """
    import os, subprocess, sys
    from gateway.stdio import ControlWriter

    control = ControlWriter.take_stdout()
    # A hostile or careless plugin, after the takeover, tries every way to reach stdout.
    print('GATEWAY_RESPONSE {"id": "r1", "ok": true, "spoofed": true}')
    print("GATEWAY_READY")
    sys.__stdout__.write('GATEWAY_EVENT {"type": "account", "spoofed": true}\\n')
    sys.__stdout__.flush()
    os.write(1, b'GATEWAY_RESPONSE {"id": "r2", "spoofed": true}\\n')
    subprocess.run([sys.executable, "-c", "print('GATEWAY_READY from a grandchild')"])
    control.ready()
    control.response("r1", {"ok": True, "text": "line\\nbreak \\u2028 é"})
    control.event("account", {"channel": "webhook", "state": "running"})
    """
)


def test_plugin_prints_cannot_spoof_control_lines() -> None:
    proc = subprocess.run([sys.executable, "-c", CHILD], cwd=REPO, capture_output=True, timeout=60, check=True)
    out_lines = proc.stdout.decode("ascii").splitlines()
    assert out_lines == [
        "GATEWAY_READY",
        'GATEWAY_RESPONSE {"ok":true,"text":"line\\nbreak \\u2028 \\u00e9","id":"r1"}',
        'GATEWAY_EVENT {"channel":"webhook","state":"running","type":"account"}',
    ]
    parsed = [parse_line(line) for line in out_lines]
    assert parsed[1] == ControlLine("response", {"ok": True, "text": "line\nbreak \u2028 é", "id": "r1"})
    assert all(p is not None and "spoofed" not in p.payload for p in parsed)
    # Everything the plugin wrote went to stderr, where the supervisor logs it.
    err = proc.stderr.decode()
    assert err.count("spoofed") == 3 and "GATEWAY_READY from a grandchild" in err


def test_parse_line_accepts_only_exact_shapes() -> None:
    assert parse_line("GATEWAY_READY\n") == ControlLine("ready", {})
    assert parse_line(b'GATEWAY_EVENT {"type":"x","n":1}\r\n') == ControlLine("event", {"type": "x", "n": 1})
    for noise in (
        "",
        "GATEWAY_READY now",
        " GATEWAY_READY",
        "GATEWAY_RESPONSE",
        "GATEWAY_RESPONSE {}",  # a response without an id
        'GATEWAY_RESPONSE {"id": 7}',
        'GATEWAY_EVENT {"id": "x"}',  # an event without a type
        "GATEWAY_RESPONSE [1, 2]",
        'GATEWAY_RESPONSE {"id": "x"',
        'GATEWAY_RESPONSEX {"id": "x"}',
        'gateway_response {"id": "x"}',
        "INFO starting telegram",
        "GATEWAY_EVENT " + json.dumps({"type": "x", "pad": "y" * MAX_LINE}),
    ):
        assert parse_line(noise) is None, noise
    assert parse_line('GATEWAY_RESPONSE {"id": "\u00e9"}'.encode()) is None  # not ASCII


async def test_reader_yields_control_lines_and_noise_and_stops_at_eof() -> None:
    stream = asyncio.StreamReader(limit=64)
    stream.feed_data(b"GATEWAY_READY\nhello from a plugin\n")
    stream.feed_data(b"x" * 100 + b'GATEWAY_RESPONSE {"id":"forged"}\n')  # over the limit
    stream.feed_data(b'GATEWAY_RESPONSE {"id":"r1"}\nGATEWAY_EVENT {"type":"t"}')  # no final newline
    stream.feed_eof()
    got = [item async for item in read_lines(stream)]
    assert got[0] == ControlLine("ready", {})
    assert got[1] == b"hello from a plugin\n"
    assert isinstance(got[2], bytes)  # the over-long line is noise, and its tail is not re-read
    assert got[3] == ControlLine("response", {"id": "r1"})
    assert got[4] == b'GATEWAY_EVENT {"type":"t"}'  # a line cut by EOF is never trusted
    assert len(got) == 5
