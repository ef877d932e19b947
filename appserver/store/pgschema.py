"""Versioned PostgreSQL schema migrations (the SQLite ones are in migrations.py). Append a new
entry; never edit a released one.

The migrations due run in ONE transaction (`postgres.migrate`): a failure leaves the database as
it was. So a migration must be transactional DDL: no `CREATE INDEX CONCURRENTLY`, `VACUUM`,
`ALTER SYSTEM`, `CREATE DATABASE` or `ALTER TYPE … ADD VALUE` used in the same script (a test
refuses the first four).

The tables mirror the SQLite schema at its newest version, column for column, so that `store copy`
moves rows across unchanged and both stores hand out the same records. Differences, each for the
same observable behaviour:

- JSON values stay TEXT (not jsonb): jsonb reorders object keys, and a stored response body or
  tool arguments must come back exactly as they were written.
- Identifiers are `COLLATE "C"`: ordering by id (agents, conversations) is by bytes, as in SQLite,
  whatever the database's default collation.
- `turns.seq` and `pending_calls.seq` are identities: the insertion order SQLite's `rowid` gives.
- `messages.id` is an identity BY DEFAULT, so `store copy` keeps message ids (responses and history
  points refer to them) and then moves the sequence past them.
- `store_probe`: the one row `check_writable` updates.
- Version 2, the cluster (appserver/store/cluster.py): `instances` (a row per running server, its
  heartbeat and the key of its session lock), `conversation_owners` (which instance holds a
  conversation's runtime), `conversation_followers` (which
  instances follow a conversation another holds), `channel_owners` (which instance's gateway runs a
  channel account),
  `cluster_mail` (notification payloads too large for NOTIFY),
  `cron_state` (the cron tasks document, cron/pgstore.py), `tokens` and `token_state` (capability
  tokens, auth/pgtokens.py).
- Version 4: `turns.revision` is a BIGINT (SQLite's INTEGER holds 64 bits already): a turn a
  restart or a takeover goes on with counts from a clock revision (runtime/restore.py).
- Version 5 (SQLite's 6): `turns.cancel_ack`, a cancel acknowledged before the turn settled.
- Version 6 (SQLite's 7): `history_points.namespace`, its conversation's owner, and the indexes a
  prefix match reads the newest points of one history by (store/base.py `history_points_read`).
- Version 7 (SQLite's 8): `conversations_namespace_agent`, a credential's conversations of one
  agent in the list's order. SQLite's 8 adds three more that the tables here had from version 1 and 3
  (in the list's order, with id: `conversations_agent`, `conversations_recent`,
  `conversations_namespace`).
- Version 8: `instances.heartbeat_s` and `instances.instance_timeout_s`, the timings each server
  is judged by (NULL: a row of an older version, judged by the judging server's own).
"""

from __future__ import annotations

MIGRATIONS: list[tuple[int, str]] = [
    (
        1,
        """
        CREATE TABLE agents (
            id TEXT COLLATE "C" PRIMARY KEY,
            name TEXT COLLATE "C" NOT NULL,
            model TEXT NOT NULL,
            system TEXT NOT NULL DEFAULT '',
            tools TEXT NOT NULL DEFAULT '{}',
            params TEXT NOT NULL DEFAULT '{}',
            created_at DOUBLE PRECISION NOT NULL,
            updated_at DOUBLE PRECISION NOT NULL
        );
        CREATE INDEX agents_name ON agents(name);
        CREATE INDEX agents_order ON agents(created_at, id);

        CREATE TABLE conversations (
            id TEXT COLLATE "C" PRIMARY KEY,
            agent_id TEXT COLLATE "C" NOT NULL REFERENCES agents(id) ON DELETE CASCADE,
            is_default BOOLEAN NOT NULL DEFAULT FALSE,
            title TEXT NOT NULL DEFAULT '',
            "user" TEXT,
            namespace TEXT,
            forked_from TEXT,
            metadata TEXT NOT NULL DEFAULT '{}',
            created_at DOUBLE PRECISION NOT NULL,
            updated_at DOUBLE PRECISION NOT NULL
        );
        CREATE INDEX conversations_agent ON conversations(agent_id, updated_at DESC, id);
        CREATE INDEX conversations_recent ON conversations(updated_at DESC, id);
        CREATE UNIQUE INDEX conversations_default ON conversations(agent_id) WHERE is_default;

        CREATE TABLE turns (
            seq BIGINT GENERATED ALWAYS AS IDENTITY,
            id TEXT COLLATE "C" PRIMARY KEY,
            conversation_id TEXT COLLATE "C" NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
            agent_id TEXT COLLATE "C" NOT NULL,
            status TEXT NOT NULL,
            stop_reason TEXT,
            error TEXT,
            idempotency_key TEXT,
            source TEXT,
            input TEXT NOT NULL DEFAULT '{}',
            input_committed BOOLEAN NOT NULL DEFAULT FALSE,
            client_tools TEXT NOT NULL DEFAULT '[]',
            options TEXT NOT NULL DEFAULT '{}',
            owner TEXT,
            draft TEXT,
            usage TEXT NOT NULL DEFAULT '{}',
            revision INTEGER NOT NULL DEFAULT 0,
            iteration INTEGER NOT NULL DEFAULT 0,
            created_at DOUBLE PRECISION NOT NULL,
            started_at DOUBLE PRECISION,
            ended_at DOUBLE PRECISION
        );
        CREATE INDEX turns_conversation ON turns(conversation_id, seq);
        CREATE INDEX turns_agent ON turns(agent_id);
        CREATE INDEX turns_open ON turns(status, seq) WHERE status IN ('queued', 'running', 'awaiting');

        CREATE TABLE messages (
            id BIGINT GENERATED BY DEFAULT AS IDENTITY PRIMARY KEY,
            conversation_id TEXT COLLATE "C" NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
            turn_id TEXT,
            iteration INTEGER NOT NULL DEFAULT 0,
            role TEXT NOT NULL,
            content TEXT NOT NULL,
            tool_calls TEXT,
            tool_call_id TEXT,
            name TEXT,
            is_error BOOLEAN NOT NULL DEFAULT FALSE,
            reasoning TEXT,
            provider_state TEXT,
            completion_status TEXT NOT NULL DEFAULT 'completed',
            source TEXT,
            created_at DOUBLE PRECISION NOT NULL,
            meta TEXT
        );
        CREATE INDEX messages_conversation ON messages(conversation_id, id);

        CREATE TABLE pending_calls (
            seq BIGINT GENERATED ALWAYS AS IDENTITY,
            conversation_id TEXT COLLATE "C" NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
            call_id TEXT COLLATE "C" NOT NULL,
            turn_id TEXT COLLATE "C" NOT NULL,
            name TEXT NOT NULL,
            arguments TEXT NOT NULL,
            kind TEXT NOT NULL,
            status TEXT NOT NULL DEFAULT 'pending',
            output TEXT,
            is_error BOOLEAN NOT NULL DEFAULT FALSE,
            reason TEXT,
            decided_by TEXT,
            created_at DOUBLE PRECISION NOT NULL,
            expires_at DOUBLE PRECISION,
            PRIMARY KEY (conversation_id, call_id)
        );
        CREATE INDEX pending_turn ON pending_calls(turn_id, created_at, seq);
        CREATE INDEX pending_open ON pending_calls(expires_at, seq) WHERE status = 'pending';

        CREATE TABLE idempotency_keys (
            scope TEXT COLLATE "C" NOT NULL,
            key TEXT COLLATE "C" NOT NULL,
            turn_id TEXT NOT NULL,
            conversation_id TEXT NOT NULL,
            created_at DOUBLE PRECISION NOT NULL,
            PRIMARY KEY (scope, key)
        );
        CREATE INDEX idempotency_age ON idempotency_keys(created_at);

        CREATE TABLE responses (
            id TEXT COLLATE "C" PRIMARY KEY,
            agent_id TEXT NOT NULL,
            conversation_id TEXT NOT NULL,
            turn_id TEXT,
            previous_response_id TEXT,
            namespace TEXT,
            last_message_id BIGINT NOT NULL DEFAULT 0,
            body TEXT NOT NULL,
            input_items TEXT NOT NULL DEFAULT '[]',
            stored BOOLEAN NOT NULL DEFAULT TRUE,
            created_at DOUBLE PRECISION NOT NULL
        );
        CREATE INDEX responses_conversation ON responses(conversation_id, created_at);

        CREATE TABLE http_idempotency (
            scope TEXT COLLATE "C" NOT NULL,
            key TEXT COLLATE "C" NOT NULL,
            body_hash TEXT NOT NULL,
            state TEXT NOT NULL DEFAULT 'pending',
            status_code INTEGER,
            content_type TEXT,
            body TEXT,
            conversation_id TEXT,
            created_at DOUBLE PRECISION NOT NULL,
            owner TEXT,
            PRIMARY KEY (scope, key)
        );
        CREATE INDEX http_idempotency_age ON http_idempotency(created_at);
        CREATE INDEX http_idempotency_pending ON http_idempotency(scope, key) WHERE state = 'pending';

        CREATE TABLE history_points (
            agent_id TEXT COLLATE "C" NOT NULL,
            prefix_hash TEXT COLLATE "C" NOT NULL,
            conversation_id TEXT COLLATE "C" NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
            last_message_id BIGINT NOT NULL,
            created_at DOUBLE PRECISION NOT NULL,
            PRIMARY KEY (agent_id, prefix_hash, conversation_id)
        );
        CREATE INDEX history_points_conversation ON history_points(conversation_id);

        CREATE TABLE store_probe (
            id INTEGER PRIMARY KEY CHECK (id = 1),
            writes BIGINT NOT NULL DEFAULT 0,
            written_at DOUBLE PRECISION NOT NULL DEFAULT 0
        );
        INSERT INTO store_probe(id) VALUES (1);
        """,
    ),
    (
        2,
        """
        CREATE TABLE instances (
            id TEXT COLLATE "C" PRIMARY KEY,
            host TEXT NOT NULL,
            pid INTEGER NOT NULL,
            address TEXT NOT NULL DEFAULT '',
            lock_key BIGINT NOT NULL,
            started_at DOUBLE PRECISION NOT NULL,
            heartbeat_at DOUBLE PRECISION NOT NULL
        );

        CREATE TABLE conversation_owners (
            conversation_id TEXT COLLATE "C" PRIMARY KEY,
            instance_id TEXT COLLATE "C" NOT NULL,
            token TEXT NOT NULL,
            since DOUBLE PRECISION NOT NULL
        );
        CREATE INDEX conversation_owners_instance ON conversation_owners(instance_id);

        CREATE TABLE conversation_followers (
            conversation_id TEXT COLLATE "C" NOT NULL,
            instance_id TEXT COLLATE "C" NOT NULL,
            until DOUBLE PRECISION NOT NULL,
            PRIMARY KEY (conversation_id, instance_id)
        );

        CREATE TABLE channel_owners (
            account TEXT COLLATE "C" PRIMARY KEY,
            instance_id TEXT COLLATE "C" NOT NULL,
            since DOUBLE PRECISION NOT NULL
        );

        CREATE TABLE cluster_mail (
            id TEXT COLLATE "C" PRIMARY KEY,
            body TEXT NOT NULL,
            created_at DOUBLE PRECISION NOT NULL
        );

        CREATE TABLE tokens (
            id TEXT COLLATE "C" PRIMARY KEY,
            name TEXT COLLATE "C" NOT NULL UNIQUE,
            hash TEXT NOT NULL,
            agents TEXT,
            scopes TEXT NOT NULL,
            created_at DOUBLE PRECISION NOT NULL,
            expires_at DOUBLE PRECISION
        );
        CREATE TABLE token_state (
            id INTEGER PRIMARY KEY CHECK (id = 1),
            version BIGINT NOT NULL
        );

        CREATE TABLE cron_state (
            id INTEGER PRIMARY KEY CHECK (id = 1),
            doc TEXT NOT NULL,
            version BIGINT NOT NULL
        );
        """,
    ),
    (
        3,
        """
        -- A namespaced credential lists its own conversations in one indexed read.
        CREATE INDEX conversations_namespace ON conversations(namespace, updated_at DESC, id);
        """,
    ),
    (
        4,
        """
        -- A turn another process held goes on from a clock revision (microseconds since 1970,
        -- runtime/restore.py), stored as it is published: 64 bits, as SQLite's INTEGER.
        ALTER TABLE turns ALTER COLUMN revision TYPE BIGINT;
        """,
    ),
    (
        5,
        """
        -- A cancel acknowledged for an open turn, saved before the acknowledgement: a restart
        -- after a crash ends that turn cancelled, not interrupted (runtime/settle.py `cancel_ack`).
        ALTER TABLE turns ADD COLUMN cancel_ack TEXT;
        """,
    ),
    (
        6,
        """
        -- A history point keeps its conversation's owner, so a prefix match reads the newest few
        -- points of the caller's own (or, for admin, of everyone's) in one indexed read, however
        -- many other conversations reached the same history (store/base.py `history_points_read`).
        ALTER TABLE history_points ADD COLUMN namespace TEXT;
        UPDATE history_points p SET namespace = c.namespace FROM conversations c WHERE c.id = p.conversation_id;
        CREATE INDEX history_points_recent ON history_points(agent_id, prefix_hash, created_at);
        CREATE INDEX history_points_owner ON history_points(agent_id, prefix_hash, namespace, created_at);
        """,
    ),
    (
        7,
        """
        -- A credential's page of one agent's conversations comes off one index in the list's order
        -- (store/base.py `conversation_page_ids`), however many conversations of its other agents
        -- it holds: 3's index (namespace, updated_at DESC, id) walked past every one of those.
        CREATE INDEX conversations_namespace_agent ON conversations(namespace, agent_id, updated_at DESC, id);
        """,
    ),
    (
        8,
        """
        -- Each server records the timings it keeps (cluster.py `LIVE_SINCE`): the others judge it by
        -- its own heartbeat period and timeout, not theirs, so servers with different `[store]`
        -- timings never judge a healthy one gone. NULL in a row an older version wrote.
        ALTER TABLE instances ADD COLUMN heartbeat_s DOUBLE PRECISION;
        ALTER TABLE instances ADD COLUMN instance_timeout_s DOUBLE PRECISION;
        """,
    ),
]

# The data tables, parents first (the order `store copy` fills them and an emptiness check reads them).
DATA_TABLES: tuple[str, ...] = (
    "agents",
    "conversations",
    "turns",
    "messages",
    "pending_calls",
    "idempotency_keys",
    "responses",
    "http_idempotency",
    "history_points",
)

# Serialises migrations of one database across processes (pg_advisory_xact_lock key: "appsrvsc").
MIGRATION_LOCK = 0x61707073_72767363


_CONSTRAINTS = frozenset({"PRIMARY", "UNIQUE", "FOREIGN", "CHECK", "CONSTRAINT", "EXCLUDE"})


def expected_columns(upto: int | None = None) -> dict[str, tuple[str, ...]]:
    """The tables and columns the migrations create (those up to version `upto`, all by default),
    read from their `CREATE TABLE` and `ALTER TABLE … ADD COLUMN` statements (checked at start:
    before migrating, that the recorded version's are there, `postgres.migrate`; after it, all of
    them, `postgres.check_schema`; a test compares it with a migrated database, so it cannot drift
    from them)."""
    import re

    tables: dict[str, list[str]] = {}
    for version, text in MIGRATIONS:
        if upto is not None and version > upto:
            break
        script = re.sub(r"--[^\n]*", "", text)
        for name, body in re.findall(r"CREATE TABLE (?:IF NOT EXISTS )?(\w+)\s*\((.*?)\n\s*\);", script, re.S):
            columns = tables.setdefault(name, [])
            depth = 0
            item = ""
            for ch in body + ",":
                if ch == "," and depth == 0:
                    words = item.split()
                    if words and words[0].upper() not in _CONSTRAINTS:
                        columns.append(words[0].strip('"'))
                    item = ""
                    continue
                depth += (ch == "(") - (ch == ")")
                item += ch
        for name, column in re.findall(r"ALTER TABLE (\w+) ADD COLUMN (?:IF NOT EXISTS )?(\w+)", script):
            tables.setdefault(name, []).append(column)
    return {name: tuple(columns) for name, columns in tables.items()}
