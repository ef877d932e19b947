"""Versioned schema migrations. Append a new entry; never edit a released one."""

from __future__ import annotations

import sqlite3
from collections.abc import Callable

MIGRATIONS: list[tuple[int, str]] = [
    (
        1,
        """
        CREATE TABLE agents (
            id TEXT PRIMARY KEY,
            name TEXT NOT NULL,
            model TEXT NOT NULL,
            system TEXT NOT NULL DEFAULT '',
            tools TEXT NOT NULL DEFAULT '{}',
            params TEXT NOT NULL DEFAULT '{}',
            created_at REAL NOT NULL,
            updated_at REAL NOT NULL
        );
        CREATE INDEX agents_name ON agents(name);

        CREATE TABLE conversations (
            id TEXT PRIMARY KEY,
            agent_id TEXT NOT NULL REFERENCES agents(id) ON DELETE CASCADE,
            is_default INTEGER NOT NULL DEFAULT 0,
            title TEXT NOT NULL DEFAULT '',
            user TEXT,
            namespace TEXT,
            forked_from TEXT,
            metadata TEXT NOT NULL DEFAULT '{}',
            created_at REAL NOT NULL,
            updated_at REAL NOT NULL
        );
        CREATE INDEX conversations_agent ON conversations(agent_id, updated_at);
        CREATE UNIQUE INDEX conversations_default ON conversations(agent_id) WHERE is_default = 1;

        CREATE TABLE turns (
            id TEXT PRIMARY KEY,
            conversation_id TEXT NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
            agent_id TEXT NOT NULL,
            status TEXT NOT NULL,
            stop_reason TEXT,
            error TEXT,
            idempotency_key TEXT,
            source TEXT,
            input TEXT NOT NULL DEFAULT '{}',
            input_committed INTEGER NOT NULL DEFAULT 0,
            client_tools TEXT NOT NULL DEFAULT '[]',
            options TEXT NOT NULL DEFAULT '{}',
            owner TEXT,
            draft TEXT,
            usage TEXT NOT NULL DEFAULT '{}',
            revision INTEGER NOT NULL DEFAULT 0,
            iteration INTEGER NOT NULL DEFAULT 0,
            seq INTEGER NOT NULL DEFAULT 0,
            created_at REAL NOT NULL,
            started_at REAL,
            ended_at REAL
        );
        CREATE INDEX turns_conversation ON turns(conversation_id, seq);
        CREATE INDEX turns_open ON turns(status) WHERE status IN ('queued', 'running', 'awaiting');

        CREATE TABLE messages (
            id INTEGER PRIMARY KEY AUTOINCREMENT,
            conversation_id TEXT NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
            turn_id TEXT,
            iteration INTEGER NOT NULL DEFAULT 0,
            role TEXT NOT NULL,
            content TEXT NOT NULL,
            tool_calls TEXT,
            tool_call_id TEXT,
            name TEXT,
            is_error INTEGER NOT NULL DEFAULT 0,
            reasoning TEXT,
            provider_state TEXT,
            completion_status TEXT NOT NULL DEFAULT 'completed',
            source TEXT,
            created_at REAL NOT NULL
        );
        CREATE INDEX messages_conversation ON messages(conversation_id, id);

        CREATE TABLE pending_calls (
            conversation_id TEXT NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
            call_id TEXT NOT NULL,
            turn_id TEXT NOT NULL,
            name TEXT NOT NULL,
            arguments TEXT NOT NULL,
            kind TEXT NOT NULL,
            status TEXT NOT NULL DEFAULT 'pending',
            output TEXT,
            is_error INTEGER NOT NULL DEFAULT 0,
            reason TEXT,
            decided_by TEXT,
            created_at REAL NOT NULL,
            expires_at REAL,
            PRIMARY KEY (conversation_id, call_id)
        );
        CREATE INDEX pending_turn ON pending_calls(turn_id);
        CREATE INDEX pending_open ON pending_calls(status, expires_at) WHERE status = 'pending';

        CREATE TABLE idempotency_keys (
            scope TEXT NOT NULL,
            key TEXT NOT NULL,
            turn_id TEXT NOT NULL,
            conversation_id TEXT NOT NULL,
            created_at REAL NOT NULL,
            PRIMARY KEY (scope, key)
        );
        CREATE INDEX idempotency_age ON idempotency_keys(created_at);
        """,
    ),
    (
        2,
        """
        CREATE TABLE responses (
            id TEXT PRIMARY KEY,
            agent_id TEXT NOT NULL,
            conversation_id TEXT NOT NULL,
            turn_id TEXT,
            previous_response_id TEXT,
            namespace TEXT,
            last_message_id INTEGER NOT NULL DEFAULT 0,
            body TEXT NOT NULL,
            input_items TEXT NOT NULL DEFAULT '[]',
            stored INTEGER NOT NULL DEFAULT 1,
            created_at REAL NOT NULL
        );
        CREATE INDEX responses_conversation ON responses(conversation_id, created_at);

        CREATE TABLE http_idempotency (
            scope TEXT NOT NULL,
            key TEXT NOT NULL,
            body_hash TEXT NOT NULL,
            state TEXT NOT NULL DEFAULT 'pending',
            status_code INTEGER,
            content_type TEXT,
            body TEXT,
            conversation_id TEXT,
            created_at REAL NOT NULL,
            PRIMARY KEY (scope, key)
        );
        CREATE INDEX http_idempotency_age ON http_idempotency(created_at);

        CREATE TABLE history_points (
            agent_id TEXT NOT NULL,
            prefix_hash TEXT NOT NULL,
            conversation_id TEXT NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
            last_message_id INTEGER NOT NULL,
            created_at REAL NOT NULL,
            PRIMARY KEY (agent_id, prefix_hash, conversation_id)
        );
        CREATE INDEX history_points_conversation ON history_points(conversation_id);
        """,
    ),
    (
        3,
        """
        -- Context management: an assistant message's measured context size, a compaction's extent.
        ALTER TABLE messages ADD COLUMN meta TEXT;
        """,
    ),
    (
        4,
        """
        -- The process (pid:starttime) that claimed an HTTP Idempotency-Key: a pending key of a dead
        -- process is released at the next start instead of blocking retries until it expires.
        ALTER TABLE http_idempotency ADD COLUMN owner TEXT;
        """,
    ),
    (
        5,
        """
        -- A namespaced credential lists its own conversations in one indexed read.
        CREATE INDEX conversations_namespace ON conversations(namespace, updated_at);
        """,
    ),
    (
        6,
        """
        -- A cancel acknowledged for an open turn, saved before the acknowledgement: a restart
        -- after a crash ends that turn cancelled, not interrupted (runtime/settle.py `cancel_ack`).
        ALTER TABLE turns ADD COLUMN cancel_ack TEXT;
        """,
    ),
    (
        7,
        """
        -- A history point keeps its conversation's owner, so a prefix match reads the newest few
        -- points of the caller's own (or, for admin, of everyone's) in one indexed read, however
        -- many other conversations reached the same history (store/base.py `history_points_read`).
        ALTER TABLE history_points ADD COLUMN namespace TEXT;
        UPDATE history_points SET namespace = (
            SELECT c.namespace FROM conversations c WHERE c.id = history_points.conversation_id
        );
        CREATE INDEX history_points_recent ON history_points(agent_id, prefix_hash, created_at);
        CREATE INDEX history_points_owner ON history_points(agent_id, prefix_hash, namespace, created_at);
        """,
    ),
    (
        8,
        """
        -- A page of conversations reads its own index entries and rows only, wherever it is: one
        -- index in the list's whole order (updated_at DESC, id) for each filter (owner, owner and
        -- agent, agent, none), holding the agent the owner's and everyone's are filtered by. The
        -- page's ids come off the index alone, so rows skipped to reach it are never read (5's
        -- index lacked id: every row before the page was read and sorted, store/base.py
        -- `conversation_page_ids`).
        CREATE INDEX conversations_namespace_recent ON conversations(namespace, updated_at DESC, id, agent_id);
        CREATE INDEX conversations_namespace_agent ON conversations(namespace, agent_id, updated_at DESC, id);
        CREATE INDEX conversations_agent_recent ON conversations(agent_id, updated_at DESC, id);
        CREATE INDEX conversations_recent ON conversations(updated_at DESC, id, agent_id);
        """,
    ),
    (
        9,
        """
        -- 8's indexes begin with the columns of these two (an equality on the first, a range or an
        -- order on updated_at, either direction), so they served no read that 8's could not. Yet
        -- every new conversation and every turn's end (updated_at) wrote both: about 5 % of a chat
        -- request's CPU (bench/ab.py).
        DROP INDEX conversations_agent;
        DROP INDEX conversations_namespace;
        """,
    ),
]


class SchemaTooNew(Exception):
    """The store was written by a newer appserver."""


class SchemaMismatch(Exception):
    """The store's recorded schema version is older than its tables: not something to upgrade."""


class SchemaUpgradeRefused(Exception):
    """The store is older than this code, and a running server (or cluster) of the older version
    uses it: not for this command to upgrade (see `upgrade_refused`)."""


def upgrade_refused(current: int, known: int, why: str, advice: str) -> SchemaUpgradeRefused:
    """One line: the store at `current` is older than this code (`known`) and `why` it is not
    upgraded now. A command's upgrade under a live server of the older version gave that server
    a schema it was never written for, and refused its own CLI and its restart ("newer than this
    appserver"), all from a command meant only to read."""
    return SchemaUpgradeRefused(
        f"its schema (version {current}) is older than this appserver's ({known}), and {why}: a command "
        f"other than `serve` does not upgrade a store in use; {advice} (until then the running version's "
        "own commands work on it)"
    )


def migrate(db: sqlite3.Connection, before_upgrade: Callable[[int, int], None] | None = None) -> int:
    """Bring `db` (autocommit connection) to the newest schema, one transaction per migration;
    returns the version it had (0: it had none). `before_upgrade(current, known)` is asked first
    when an existing store is older than this code; it raises (SchemaUpgradeRefused) to leave the
    store as it is."""
    db.execute("CREATE TABLE IF NOT EXISTS schema_version (version INTEGER NOT NULL)")
    current = db.execute("SELECT MAX(version) FROM schema_version").fetchone()[0] or 0
    known = max(v for v, _ in MIGRATIONS)
    if current > known:
        raise SchemaTooNew(
            f"database schema version {current} is newer than this appserver ({known}); upgrade appserver"
        )
    if 0 < current < known and before_upgrade is not None:
        before_upgrade(current, known)
    for version, script in MIGRATIONS:
        if version <= current:
            continue
        db.execute("BEGIN IMMEDIATE")
        try:
            for statement in script.split(";"):
                if statement.strip():
                    db.execute(statement)
            db.execute("INSERT INTO schema_version(version) VALUES (?)", (version,))
        except sqlite3.OperationalError as exc:
            db.execute("ROLLBACK")
            if "duplicate column" in str(exc) or "already exists" in str(exc):
                # the change this migration makes is there already: the recorded version is older
                # than the tables (schema_version edited, or rows of it lost), not a store to upgrade
                raise SchemaMismatch(
                    f"the database says it has schema version {current}, but its tables already have what version "
                    f"{version} adds ({exc}): its schema_version table was changed or damaged; restore the store "
                    "from a backup"
                ) from None
            raise
        except BaseException:
            db.execute("ROLLBACK")
            raise
        db.execute("COMMIT")
    return int(current)
