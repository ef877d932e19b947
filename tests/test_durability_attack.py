"""Outside attack on "acknowledged = committed" with the SQLite group commit (store/groupcommit.py).

A real `appserver serve`, the `openai` SDK with 64 concurrent clients (and WebSocket clients),
`kill -9` at a random moment, a restart on the same home, then the store read back (the SQLite file,
read-only, and the HTTP API): every reply a client received (its conversation from the
`X-Conversation-Id` header, its text), every `Idempotency-Key` answer, every WebSocket ack names
rows that survived; the restart leaves no turn running or queued. Failing writes inside large groups
(an agent deleted under load, duplicate idempotency keys racing, a full disk through RLIMIT_FSIZE)
fail only their own requests, with OpenAI error objects.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import resource
import signal
import sqlite3
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import websockets

from tests.support.cli import ROOT, cli_env, run_cli
from tests.support.net import SSL
from tests.support.serve import ServeProcess
from tests.support.ws import ws_url
from tests.support.zygote_client import appserver_popen

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(sys.platform != "linux", reason="kill -9 and RLIMIT_FSIZE as on Linux"),
]

CLIENTS = 64
PINNED = "/slow 100"  # 100 words 50 ms apart: a turn of 5 s
PINNED_TURNS = 4
# The seed is printed on failure (pytest shows captured stdout), to replay a failing schedule.
SEED = int(os.environ.get("DURABILITY_ATTACK_SEED", str(random.randrange(1 << 30))))


# ---------------------------------------------------------------- a server whose log is a file


def serve(home: Path, log: Path, timeout: float = 20) -> ServeProcess:
    """`start_serve`, but the log goes to a file: under load (and a full disk) the server logs
    more than a pipe nobody reads holds, and would block on it."""
    home.mkdir(parents=True, exist_ok=True)
    server_json = home / "server.json"
    server_json.unlink(missing_ok=True)
    with open(log, "ab") as out:
        proc = appserver_popen(
            ["serve", "--listen", "127.0.0.1:0"], env=cli_env(home), cwd=ROOT, stdout=out, stderr=subprocess.STDOUT
        )
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"serve exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        with contextlib.suppress(OSError, json.JSONDecodeError):
            info = json.loads(server_json.read_text())
            if info.get("pid") == proc.pid:
                return ServeProcess(proc, home, info["url"])
        time.sleep(0.01)
    proc.kill()
    raise AssertionError("serve did not write server.json in time")


def kill9(sp: ServeProcess) -> None:
    sp.proc.send_signal(signal.SIGKILL)
    sp.proc.wait(10)


@contextlib.contextmanager
def restarted(home: Path, log: Path) -> Any:
    """The next start on the home (it must start: a kill -9 never makes it refuse the store),
    settled: no turn left running or queued (queued ones are run by the restart)."""
    sp = serve(home, log)
    try:
        db = sqlite3.connect(f"file:{home / 'appserver.db'}?mode=ro", uri=True)
        try:
            deadline = time.monotonic() + 15
            while open_turns(db) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert not open_turns(db), f"turns still open after the restart: {open_turns(db)}"
            yield sp, db
        finally:
            db.close()
    finally:
        sp.stop()
        sp.kill()


def running_pinned(db: sqlite3.Connection) -> int:
    """How many of the pinned victim turns run (accepted, not settled)."""
    row = db.execute(
        "SELECT count(*) FROM turns WHERE status = 'running' AND input LIKE ?", (f"%{PINNED}%",)
    ).fetchone()
    return int(row[0])


def open_turns(db: sqlite3.Connection) -> list[tuple[str, str]]:
    return db.execute("SELECT id, status FROM turns WHERE status IN ('running', 'queued')").fetchall()


class Stored:
    """The turns whose user input is a text (in a conversation), and a turn's replies, from one read
    of the store. Asked of SQLite per acknowledgement, each scanned the whole messages table (it
    has no index on content or turn_id), for hundreds of acknowledgements. The same rows, read once
    the store no longer changes under the check (after the restart settled, after the retries)."""

    def __init__(self, db: sqlite3.Connection) -> None:
        self.inputs: dict[str, list[tuple[str, str, str]]] = {}
        wrote: dict[str, str] = {}  # turn → the input it wrote
        for tid, status, conv, content in db.execute(
            "SELECT t.id, t.status, t.conversation_id, m.content FROM turns t JOIN messages m ON m.turn_id = t.id "
            "WHERE m.role = 'user'"
        ):
            self.inputs.setdefault(content, []).append((tid, status, conv))
            wrote[tid] = content
        # a keyed retry's re-run of a turn that answered nothing writes no input of its own: it ran
        # the input of the turn it names (`rerun_of`), once in the history
        for tid, status, conv, earlier in db.execute(
            "SELECT id, status, conversation_id, json_extract(input, '$.rerun_of') FROM turns"
            " WHERE json_extract(input, '$.rerun_of') IS NOT NULL"
        ):
            if earlier in wrote:
                self.inputs.setdefault(wrote[earlier], []).append((tid, status, conv))
        self.replies: dict[str, list[str]] = {}
        for tid, content in db.execute("SELECT turn_id, content FROM messages WHERE role = 'assistant' ORDER BY id"):
            self.replies.setdefault(tid, []).append(content)

    def turns_with_input(self, text: str, conversation: str | None = None) -> list[tuple[str, str]]:
        rows = self.inputs.get(json.dumps(text), [])
        return [(tid, status) for tid, status, conv in rows if conversation is None or conv == conversation]

    def replies_of(self, turn_id: str) -> list[Any]:
        return [json.loads(c) for c in self.replies.get(turn_id, [])]


@dataclass
class Ack:
    """A reply a client received: it must be in the store after any kill."""

    kind: str
    text_in: str
    conversation: str
    text_out: str
    response_id: str | None = None
    key: str | None = None
    body: str | None = None  # a non-stream reply with a key: its replay must be these bytes


@dataclass
class Book:
    acks: list[Ack] = field(default_factory=list)
    keys: dict[str, tuple[str, bool]] = field(default_factory=dict)  # key → (input, stream)
    unexpected: list[str] = field(default_factory=list)


def sdk(sp: ServeProcess) -> openai.AsyncOpenAI:
    # the SDK's own httpx client (its limits and timeouts), with the suite's SSL context
    return openai.AsyncOpenAI(
        base_url=sp.url + "/v1",
        api_key="unused",
        max_retries=0,
        timeout=30,
        http_client=openai.DefaultAsyncHttpxClient(verify=SSL),
    )


def error_object(response: httpx.Response) -> dict[str, Any]:
    """The OpenAI error object of a failed reply (asserting it is one)."""
    body = response.json()
    err = body.get("error")
    assert isinstance(err, dict) and err.get("message") and err.get("type"), body
    return err


# ---------------------------------------------------------------- 1. kill -9 under mixed SDK load


async def _client(i: int, trial: int, client: openai.AsyncOpenAI, book: Book, rng: random.Random) -> None:
    """One SDK client sending requests back to back until the server dies under it."""
    n = 0
    kind = i % 8
    while True:
        n += 1
        text = f"t{trial}-{i}-{n}"
        try:
            if kind in (0, 1):  # chat, a new conversation each time
                r = await client.chat.completions.with_raw_response.create(
                    model="assistant", messages=[{"role": "user", "content": text}]
                )
                out = r.parse().choices[0].message.content
                book.acks.append(Ack("chat", text, r.headers["x-conversation-id"], out))
            elif kind == 2:  # chat with an Idempotency-Key
                key = f"key-{text}"
                book.keys[key] = (text, False)
                r = await client.chat.completions.with_raw_response.create(
                    model="assistant",
                    messages=[{"role": "user", "content": text}],
                    extra_headers={"Idempotency-Key": key},
                )
                out = r.parse().choices[0].message.content
                book.acks.append(Ack("chat_key", text, r.headers["x-conversation-id"], out, key=key, body=r.text))
            elif kind == 3:  # chat stream, keyed half the time: the final chunk is the acknowledgement
                key = f"skey-{text}" if rng.random() < 0.5 else None
                if key:
                    book.keys[key] = (text, True)
                stream = await client.chat.completions.create(
                    model="assistant",
                    messages=[{"role": "user", "content": text}],
                    stream=True,
                    extra_headers={"Idempotency-Key": key} if key else None,
                )
                conv, seen, final = stream.response.headers["x-conversation-id"], "", False
                async for chunk in stream:
                    if chunk.choices:
                        seen += chunk.choices[0].delta.content or ""
                        final = final or chunk.choices[0].finish_reason is not None
                if final:
                    book.acks.append(Ack("chat_stream", text, conv, seen, key=key))
            elif kind == 4:  # responses
                r = await client.responses.with_raw_response.create(model="assistant", input=text)
                resp = r.parse()
                book.acks.append(Ack("responses", text, r.headers["x-conversation-id"], resp.output_text, resp.id))
            elif kind == 5:  # responses stream: response.completed is the acknowledgement
                rstream = await client.responses.create(model="assistant", input=text, stream=True)
                conv = rstream.response.headers["x-conversation-id"]
                async for event in rstream:
                    if event.type == "response.completed":
                        done = event.response
                        book.acks.append(Ack("responses_stream", text, conv, done.output_text, done.id))
            else:  # two clients racing on one pinned conversation
                conv = f"shared-{trial}-{i // 8}"
                r = await client.chat.completions.with_raw_response.create(
                    model="assistant",
                    messages=[{"role": "user", "content": text}],
                    extra_headers={"X-Conversation-Id": conv},
                )
                assert r.headers["x-conversation-id"] == conv
                book.acks.append(Ack("shared", text, conv, r.parse().choices[0].message.content))
        except (openai.APIConnectionError, httpx.TransportError):
            return  # the server was killed
        except Exception as exc:  # noqa: BLE001  (anything else is a finding: recorded, not lost in a task)
            book.unexpected.append(f"{text}: {type(exc).__name__}: {exc}")
            return


def check_acks(sp: ServeProcess, db: sqlite3.Connection, book: Book) -> list[str]:
    with httpx.Client(base_url=sp.url, timeout=10, verify=SSL) as http:  # one client: one TLS context
        return _check_acks(http, db, book)


def _check_acks(http: httpx.Client, db: sqlite3.Connection, book: Book) -> list[str]:
    problems = []
    stored = Stored(db)
    for a in book.acks:
        turns = stored.turns_with_input(a.text_in, a.conversation)
        if [s for _, s in turns] != ["completed"]:
            problems.append(f"{a.kind} {a.text_in!r} in {a.conversation}: acknowledged, stored as {turns}")
            continue
        if a.text_out not in stored.replies_of(turns[0][0]):
            problems.append(
                f"{a.kind} {a.text_in!r}: reply {a.text_out!r} not stored: {stored.replies_of(turns[0][0])}"
            )
        if a.response_id:
            got = http.get(f"/v1/responses/{a.response_id}")
            if got.status_code != 200 or got.json()["status"] != "completed":
                problems.append(f"{a.kind} {a.response_id}: acknowledged, GET {got.status_code} {got.text[:200]}")
    return problems


def check_keys(sp: ServeProcess, db: sqlite3.Connection, book: Book) -> list[str]:
    """Every key sent is retried: an acknowledged one answers the same again, and every key's
    input ran exactly once, acknowledged or not."""
    with httpx.Client(base_url=sp.url, timeout=30, verify=SSL) as http:  # one client: one TLS context
        return _check_keys(http, db, book)


def _check_keys(http: httpx.Client, db: sqlite3.Connection, book: Book) -> list[str]:
    problems = []
    acked = {a.key: a for a in book.acks if a.key}
    answered: list[tuple[str, str, Ack | None]] = []
    for key, (text, stream) in book.keys.items():
        body: dict[str, Any] = {"model": "assistant", "messages": [{"role": "user", "content": text}]}
        if stream:
            body["stream"] = True  # as the SDK sent it (it leaves `stream` out otherwise)
        r = http.post("/v1/chat/completions", json=body, headers={"Idempotency-Key": key})
        if r.status_code != 200:
            problems.append(f"retry of {key}: {r.status_code} {r.text[:200]}")
            continue
        a = acked.get(key)
        if a is not None and not stream:
            if r.headers.get("idempotent-replayed") != "true" or r.text != a.body:
                problems.append(f"retry of acknowledged {key}: not the stored reply ({r.headers}) {r.text[:200]}")
        elif a is not None:
            chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
            text_again = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c.get("choices"))
            if text_again != a.text_out:
                problems.append(f"retry of acknowledged stream {key}: {text_again!r} != {a.text_out!r}")
        answered.append((key, text, a))
    # what each key's input ran as, once every retry has been answered (each retry touches only
    # its own key's input)
    stored = Stored(db)
    for key, text, a in answered:
        ran = sorted(s for _, s in stored.turns_with_input(text))
        # An attempt the kill interrupted is no answer, so the retry runs it (docs/openai.md); an
        # acknowledged one is the answer: it ran once, completed.
        if ran.count("completed") != 1 or set(ran) - {"completed", "interrupted"} or (a and ran != ["completed"]):
            problems.append(f"{key} (acknowledged: {a is not None}): its input ran as {ran}")
    return problems


@pytest.mark.parametrize("trial", range(4))
async def test_kill9_under_sdk_load_loses_no_acknowledged_reply(tmp_path: Path, trial: int) -> None:
    rng = random.Random(SEED + trial)
    print(f"DURABILITY_ATTACK_SEED={SEED}")
    home, log = tmp_path / "home", tmp_path / "serve.log"
    sp = serve(home, log)
    book = Book()
    try:
        client = sdk(sp)
        tasks = [asyncio.create_task(_client(i, trial, client, book, rng)) for i in range(CLIENTS)]
        deadline = time.monotonic() + 20
        while len(book.acks) < 40:  # past the first requests, while every kind of request is in flight
            assert time.monotonic() < deadline and not book.unexpected, book.unexpected
            await asyncio.sleep(0.005)
        await asyncio.sleep(rng.uniform(0.0, 0.6))
        kill9(sp)
        await asyncio.wait_for(asyncio.gather(*tasks), 30)
    finally:
        sp.kill()
    assert not book.unexpected, book.unexpected
    with restarted(home, log) as (sp2, db):
        problems = check_acks(sp2, db, book) + check_keys(sp2, db, book)
    kinds = Counter(a.kind for a in book.acks)
    assert not problems, f"{len(problems)} of {len(book.acks)} acknowledgements ({dict(kinds)}):\n" + "\n".join(
        problems[:20]
    )


# ---------------------------------------------------------------- 2. failing writes inside big groups


async def _ws_duplicates(url: str, prefix: str, book: dict[str, set[str]], stop: asyncio.Event) -> None:
    """Two connections submit the same input with the same idempotency key at once, again and
    again: the second accept fails inside the group the first one is in (DuplicateTurn), and is
    acknowledged as that turn."""

    async def hello(conn: Any) -> None:
        await conn.send(json.dumps({"type": "hello", "protocol": 1, "client": "attack", "request_id": "h"}))
        while json.loads(await conn.recv())["type"] != "welcome":
            pass

    async def submit(conn: Any, key: str, tag: str) -> None:
        rid = f"{key}/{tag}"
        frame = {"type": "submit_input", "agent": "assistant", "conversation": "new", "input": key}
        await conn.send(json.dumps({**frame, "idempotency_key": key, "request_id": rid}))
        while True:
            f = json.loads(await conn.recv())
            if f.get("request_id") == rid:
                assert f["type"] == "ack", f
                book.setdefault(key, set()).add(f["turn_id"])
                return

    a = await websockets.connect(ws_url(url), max_size=None)
    b = await websockets.connect(ws_url(url), max_size=None)
    try:
        await asyncio.gather(hello(a), hello(b))
        n = 0
        while not stop.is_set():
            n += 1
            key = f"{prefix}-{n}"
            await asyncio.gather(submit(a, key, "a"), submit(b, key, "b"))
    except (websockets.ConnectionClosed, OSError):
        return
    finally:
        await a.close()
        await b.close()


async def test_writes_failing_inside_big_groups_fail_only_their_own_requests(tmp_path: Path) -> None:
    """An agent deleted (by the CLI, its own connection to the file) while 32 clients use it and 32
    use another: its turns' commits fail inside groups shared with the others (and its accepts and
    conversation rows), duplicate WebSocket keys race in the same groups. Its requests end with
    OpenAI 404 errors, nobody else's fails, and what was acknowledged survives a kill -9."""
    rng = random.Random(SEED)
    print(f"DURABILITY_ATTACK_SEED={SEED}")
    home, log = tmp_path / "home", tmp_path / "serve.log"
    env = cli_env(home)
    sp = serve(home, log)
    acks: list[Ack] = []
    failures: list[tuple[str, int, dict[str, Any]]] = []
    unexpected: list[str] = []
    ws_turns: dict[str, set[str]] = {}
    stop = asyncio.Event()
    try:
        assert run_cli(home, "agents", "create", "--name", "victim", env=env).code == 0
        client = sdk(sp)

        async def user(i: int) -> None:
            model = "victim" if i % 2 else "assistant"
            n = 0
            while not stop.is_set():
                n += 1
                text = f"g-{i}-{n}"
                # `/slow` with more text streams 10 words, 50 ms apart: turns in flight at the delete
                prompt = f"/slow {text}" if model == "victim" and rng.random() < 0.5 else text
                try:
                    if i % 4 < 2:
                        r = await client.chat.completions.with_raw_response.create(
                            model=model, messages=[{"role": "user", "content": prompt}]
                        )
                        out = r.parse().choices[0].message.content
                    else:
                        r = await client.responses.with_raw_response.create(model=model, input=prompt)
                        out = r.parse().output_text
                    acks.append(Ack(model, prompt, r.headers["x-conversation-id"], out))
                except openai.APIStatusError as exc:
                    failures.append((model, exc.status_code, error_object(exc.response)))
                except (openai.APIConnectionError, httpx.TransportError):
                    return
                except Exception as exc:  # noqa: BLE001
                    unexpected.append(f"{prompt}: {type(exc).__name__}: {exc}")
                    return

        async def pinned() -> None:
            """A victim turn that streams for 5 s: running when the delete lands, however loaded the
            machine (the race of the other users' turns with the delete is theirs to win or lose)."""
            try:
                await client.chat.completions.create(model="victim", messages=[{"role": "user", "content": PINNED}])
            except openai.APIStatusError as exc:
                failures.append(("victim", exc.status_code, error_object(exc.response)))
            except (openai.APIConnectionError, httpx.TransportError):
                return  # the kill -9
            except Exception as exc:  # noqa: BLE001
                unexpected.append(f"{PINNED}: {type(exc).__name__}: {exc}")

        tasks = [asyncio.create_task(user(i)) for i in range(CLIENTS)]
        tasks += [asyncio.create_task(_ws_duplicates(sp.url, f"dup{j}", ws_turns, stop)) for j in range(8)]
        deadline = time.monotonic() + 20
        while sum(a.kind == "victim" for a in acks) < 20:
            assert time.monotonic() < deadline and not unexpected, unexpected
            await asyncio.sleep(0.01)
        tasks += [asyncio.create_task(pinned()) for _ in range(PINNED_TURNS)]
        with sqlite3.connect(f"file:{home / 'appserver.db'}?mode=ro", uri=True) as db:
            while running_pinned(db) < PINNED_TURNS:
                assert time.monotonic() < deadline + 20 and not unexpected, unexpected
                await asyncio.sleep(0.02)
        # Forked from the test's zygote: a new interpreter's start, seconds on a loaded machine,
        # would let the pinned turns end before the delete.
        deleted = appserver_popen(
            ["agents", "delete", "victim"], env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
        )
        _, err = await asyncio.to_thread(deleted.communicate, timeout=30)
        assert deleted.returncode == 0, err.decode()
        # the turns in flight at the delete end (their commits fail) before the kill: waited for,
        # not slept on, so that a loaded machine slower than a fixed pause still shows the race
        landed = time.monotonic() + 15
        while time.monotonic() < landed and not any(
            "deleted while this request ran" in e["message"] for _, _, e in failures
        ):
            await asyncio.sleep(0.02)
        await asyncio.sleep(rng.uniform(0.0, 0.3))
        kill9(sp)
        stop.set()
        await asyncio.wait_for(asyncio.gather(*tasks), 30)
    finally:
        sp.kill()
    assert not unexpected, unexpected
    others = [f for f in failures if f[0] != "victim"]
    assert not others, f"requests of the other agent failed: {others[:5]}"
    assert failures, "no request of the deleted agent failed: the attack did not land"
    assert all(status == 404 and e["code"] == "model_not_found" for _, status, e in failures), Counter(
        (status, e["code"], e["message"]) for _, status, e in failures
    )
    # Turns whose commit failed (their rows went with the agent) were answered so, not as a 500:
    assert any("deleted while this request ran" in e["message"] for _, _, e in failures), Counter(
        e["message"] for _, _, e in failures
    )
    assert len(ws_turns) >= 8
    with restarted(home, log) as (_, db):
        lost = []
        stored = Stored(db)
        for a in acks:
            if a.kind == "victim":
                continue  # deleted on purpose, with its agent
            turns = stored.turns_with_input(a.text_in, a.conversation)
            if [s for _, s in turns] != ["completed"] or a.text_out not in stored.replies_of(turns[0][0]):
                lost.append((a.text_in, turns))
        assert not lost, f"{len(lost)} acknowledged replies of the other agent lost: {lost[:10]}"
        for key, turn_ids in ws_turns.items():
            assert len(turn_ids) == 1, f"the two acks of key {key} name different turns: {turn_ids}"
            (turn_id,) = turn_ids
            stored = db.execute("SELECT id FROM turns WHERE idempotency_key = ?", (key,)).fetchall()
            assert stored == [(turn_id,)], f"key {key}: acknowledged as {turn_id}, stored {stored}"


# ---------------------------------------------------------------- 3. a full disk, without root


@pytest.mark.skipif(not hasattr(resource, "prlimit"), reason="needs prlimit (Linux)")
async def test_a_full_disk_fails_requests_with_error_objects_and_loses_nothing_acknowledged(tmp_path: Path) -> None:
    """RLIMIT_FSIZE lowered on the running server (prlimit; Python ignores SIGXFSZ, so a write past
    it fails with EFBIG, as on a full disk): the WAL cannot grow. Requests fail with OpenAI error
    objects while it lasts; once lifted, the server serves again; after a kill -9 every reply that
    was acknowledged, before, during or after, is in the store."""
    rng = random.Random(SEED)
    print(f"DURABILITY_ATTACK_SEED={SEED}")
    home, log = tmp_path / "home", tmp_path / "serve.log"
    sp = serve(home, log)
    acks: list[Ack] = []
    failures: list[tuple[int, dict[str, Any]]] = []
    unexpected: list[str] = []
    phase = {"name": "before"}
    after_full: list[Ack] = []
    try:
        client = sdk(sp)

        async def user(i: int) -> None:
            n = 0
            while True:
                n += 1
                text = f"f-{i}-{n}-" + "x" * rng.choice([0, 4000, 30000])
                try:
                    if i % 3 == 0:
                        r = await client.responses.with_raw_response.create(model="assistant", input=text)
                        out, rid = r.parse().output_text, r.parse().id
                    else:
                        headers = {"Idempotency-Key": f"fk-{i}-{n}"} if i % 3 == 1 else None
                        r = await client.chat.completions.with_raw_response.create(
                            model="assistant", messages=[{"role": "user", "content": text}], extra_headers=headers
                        )
                        out, rid = r.parse().choices[0].message.content, None
                    ack = Ack("full", text, r.headers["x-conversation-id"], out, rid)
                    acks.append(ack)
                    if phase["name"] == "lifted":
                        after_full.append(ack)
                except openai.APIStatusError as exc:
                    failures.append((exc.status_code, error_object(exc.response)))
                    await asyncio.sleep(0.005)
                except (openai.APIConnectionError, httpx.TransportError):
                    return
                except Exception as exc:  # noqa: BLE001
                    unexpected.append(f"{text[:20]}: {type(exc).__name__}: {exc}")
                    return

        tasks = [asyncio.create_task(user(i)) for i in range(CLIENTS)]
        deadline = time.monotonic() + 20
        while len(acks) < 50:
            assert time.monotonic() < deadline and not unexpected, unexpected
            await asyncio.sleep(0.01)
        wal = (home / "appserver.db-wal").stat().st_size
        resource.prlimit(sp.proc.pid, resource.RLIMIT_FSIZE, (wal, resource.RLIM_INFINITY))
        phase["name"] = "full"
        deadline = time.monotonic() + 10
        while len(failures) < 20 and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        await asyncio.sleep(rng.uniform(0.0, 0.3))
        resource.prlimit(sp.proc.pid, resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
        phase["name"] = "lifted"
        deadline = time.monotonic() + 10
        while len(after_full) < 30:
            assert time.monotonic() < deadline, "the server did not serve again once the disk had room"
            await asyncio.sleep(0.01)
        kill9(sp)
        await asyncio.wait_for(asyncio.gather(*tasks), 30)
    finally:
        sp.kill()
    assert not unexpected, unexpected
    assert failures, "no request failed while the file size limit held: the attack did not land"
    assert all(status >= 500 for status, _ in failures), Counter((s, e["message"][:60]) for s, e in failures)
    with restarted(home, log) as (sp2, db):
        problems = check_acks(sp2, db, Book(acks=acks))
    assert not problems, f"{len(problems)} of {len(acks)} acknowledged replies lost:\n" + "\n".join(problems[:20])


# ---------------------------------------------------------------- 4. streams cut by kill -9


async def _stream_until_killed(client: openai.AsyncOpenAI, seen: dict[str, Any]) -> None:
    try:
        stream = await client.chat.completions.create(
            model="assistant",
            messages=[{"role": "user", "content": seen["prompt"]}],
            stream=True,
            extra_headers={"X-Conversation-Id": seen["conversation"]},
        )
        assert stream.response.headers["x-conversation-id"] == seen["conversation"]
        seen["text"] = ""
        async for chunk in stream:
            if chunk.choices:
                seen["text"] += chunk.choices[0].delta.content or ""
                if chunk.choices[0].finish_reason is not None:
                    seen["final"] = True
    except (openai.APIConnectionError, httpx.TransportError):
        pass


async def test_streams_cut_by_kill9_keep_their_input_and_settle_consistently(tmp_path: Path) -> None:
    """A stream's first chunk says its input was accepted (a stream does not overlap its accept):
    after a kill -9 mid-stream the turn and its input are stored, settled as interrupted, and the
    text kept (the last checkpoint, `draft_interval_s`) agrees with what the client read: one is a
    prefix of the other."""
    print(f"DURABILITY_ATTACK_SEED={SEED}")
    rng = random.Random(SEED)
    home, log = tmp_path / "home", tmp_path / "serve.log"
    sp = serve(home, log)
    # `/slow N` takes no other text: each stream is told apart by the conversation it pins
    streams = [{"prompt": f"/slow {rng.randint(30, 80)}", "conversation": f"cut-{i}"} for i in range(32)]
    try:
        client = sdk(sp)
        tasks = [asyncio.create_task(_stream_until_killed(client, s)) for s in streams]
        deadline = time.monotonic() + 20
        while sum(len(s.get("text", "")) > 10 for s in streams) < len(streams) // 2:
            assert time.monotonic() < deadline, "the streams did not start"
            await asyncio.sleep(0.01)
        await asyncio.sleep(rng.uniform(0.3, 1.2))  # past a draft checkpoint or two
        kill9(sp)
        await asyncio.wait_for(asyncio.gather(*tasks), 30)
    finally:
        sp.kill()
    started = [s for s in streams if "text" in s and not s.get("final")]
    assert started
    with restarted(home, log) as (_, db):
        stored = Stored(db)
        for s in started:
            turns = stored.turns_with_input(s["prompt"], s["conversation"])
            assert [st for _, st in turns] == ["interrupted"], (s, turns)
            kept = "".join(t for t in stored.replies_of(turns[0][0]) if isinstance(t, str))
            assert s["text"].startswith(kept) or kept.startswith(s["text"]), (s, kept)


async def test_a_responses_stream_cut_by_kill9_can_be_found_by_its_announced_id(tmp_path: Path) -> None:
    home, log = tmp_path / "home", tmp_path / "serve.log"
    sp = serve(home, log)
    announced: list[str] = []
    try:
        client = sdk(sp)

        async def read() -> None:
            with contextlib.suppress(openai.APIConnectionError, httpx.TransportError):
                stream = await client.responses.create(model="assistant", input="/slow 200", stream=True)
                async for event in stream:
                    if event.type == "response.created":
                        announced.append(event.response.id)
                    if event.type == "response.output_text.delta" and "w3" in event.delta:
                        kill9(sp)

        await asyncio.wait_for(read(), 30)
    finally:
        sp.kill()
    assert announced
    with restarted(home, log) as (sp2, _):
        got = httpx.get(f"{sp2.url}/v1/responses/{announced[0]}", timeout=10, verify=SSL)
    assert got.status_code == 200, got.text
    body = got.json()
    assert body["status"] == "failed" and body["error"]["code"] == "server_error", body
