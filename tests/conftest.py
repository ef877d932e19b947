"""Shared fixtures: a fresh home per test, the CLI as a real subprocess, a real `serve` on loopback.

The helpers behind them live in tests/support/ so that bench/ and examples can use them without pytest."""

from __future__ import annotations

import compileall
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support import zygote_client
from tests.support.cli import FAST_WAITS, ROOT, CLIResult, run_cli
from tests.support.net import share_default_ssl_context
from tests.support.serve import ServeProcess, serving

# Most of the suite's time is `appserver` subprocesses, and most of a subprocess's start is imports.
# With PYTHONDONTWRITEBYTECODE set (as some shells and CI images do) no subprocess may cache its
# bytecode, so every one of them compiled the package again (~35 % of a CLI call's CPU). The suite's
# processes (xdist workers and everything they start) write and read the cache like any install.
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)

# Most of what is left of an `appserver` subprocess's start is Python starting and importing the CLI
# and the server: the suite forks its CLI calls and `serve` processes from a zygote that imported
# them once per worker (tests/support/zygote.py); bench/ keeps starting real interpreters.
zygote_client.enabled = True

# Every httpx client the tests make (openai.OpenAI(), httpx.get, polling loops) used to read the CA
# bundle into a new SSL context, ~25-50 ms of CPU each; they share one made the same way.
share_default_ssl_context()

# The platform waits the loopback fakes need not pay (tests/support/cli.py), for in-process adapters
# as for the `serve` subprocesses (whose environment is built from this one).
for _name, _value in FAST_WAITS.items():
    os.environ.setdefault(_name, _value)


# `make test` runs files on 6 xdist workers (--dist loadfile), so one long file bounds the wall time
# when it starts last. These files (real `serve` processes, kill -9, restarts) take longest; they are
# handed out first, longest first, and the quick files fill in around them. Only the order changes.
# (Every file of at least 12 s in a full run's junit times, longest first; a new slow file joins it.)
SLOW_FILES_FIRST = (
    "test_cluster.py",
    "test_cluster_b.py",
    "test_cluster_outage_s19.py",
    "test_cluster_s28l.py",
    "test_postgres_serve_attack.py",
    "test_cluster_fixes_s18.py",
    "test_telegram_s22.py",
    "test_gateway_fixes_s18.py",
    "test_webhook_fixes_s21.py",
    "test_state_fixes_s19.py",
    "test_cli_s23_owner.py",
    "test_ws_direct_attack.py",
    "test_cron_deliver_failover_s20.py",
    "test_discord_s28r.py",
    "test_pg_tokens_s21.py",
    "test_channels_deliver_start.py",
    "test_cluster_answers_s31i.py",
    "test_gw_telegram_prompts_e2e.py",
    "test_cluster_s33d.py",
    "test_edge_send_timeout.py",
    "test_gateway_access_s25b.py",
    "test_cron_failover_s20.py",
    "test_cluster_s28s.py",
    "test_gateway_s28k.py",
    "test_cron_s22.py",
    "test_gateway_cluster_s36d.py",
    "test_gateway_cluster_s37b.py",
    "test_gateway_cluster_s37i.py",
    "test_cron_s37e.py",
    "test_gateway_s37d.py",
    "test_schedule_tool_s37f.py",
    "test_gateway_cluster_pg_state.py",
    "test_cron_s38j.py",
    "test_openai_s38i.py",
    "test_store_full_s38e.py",
    "test_schedule_tool_s38h.py",
    "test_gateway_s38g.py",
    "test_ws_s36h.py",
    "test_cluster_s36c.py",
    "test_cluster_s36j.py",
    "test_idempotency_s36a.py",
    "test_idempotency_s36i.py",
    "test_gateway_revoke_s35p.py",
    "test_pairing_revoke_s35f.py",
    "test_cron_cli_s35n.py",
    "test_gateway_debounce.py",
    "test_telegram_e2e.py",
    "test_store_locks_s22.py",
    "test_cluster_s27h.py",
    "test_cluster_fixes_s18_b.py",
    "test_slack_send_once.py",
    "test_slack_send_once_e2e.py",
    "test_discord.py",
    "test_gateway_turn_lookup_s31g.py",
    "test_gateway_ledger_busy_s30a.py",
    "test_edge_pipelining.py",
    "test_cron_lease_expiry.py",
    "test_discord_e2e.py",
    "test_ws_fanout.py",
    "test_providers_s31d.py",
    "test_opencap_s26f_pg.py",
    "test_ws_edge_s28t.py",
    "test_gateway_fixes_s20.py",
    "test_kernel_memory.py",
    "test_cron_fixes_s18.py",
    "test_gateway_cancel_new_s30q.py",
    "test_ws_keepalive_draining_s30l.py",
    "test_gateway_access.py",
    "test_gateway_attack.py",
    "test_discord_s34k.py",
    "test_channel_config_s35g.py",
    "test_discord_s35a.py",
    "test_discord_s33n.py",
    "test_ws_s24.py",
    "test_telegram_s29m2.py",
    "test_serve_signals_s25.py",
    "test_gateway_chatops.py",
    "test_chat_stream_key_freed_s30j.py",
    "test_edge_fair_eviction.py",
    "test_telegram_s29l.py",
    "test_client_failover.py",
    "test_durability_attack.py",
    "test_channel_media_order_e2e.py",
    "test_chat_fixes_s21.py",
    "test_gateway_approvals_s24.py",
    "test_edge_pipelined_refusals.py",
)


def pytest_configure(config: pytest.Config) -> None:
    """Compile the packages once, in the controller, before workers and subprocesses race to do it;
    and let the collection order below decide which file a worker gets next (xdist otherwise
    reorders files by their number of tests, which says nothing of how long they take)."""
    if hasattr(config, "workerinput"):
        return
    for package in ("appserver", "cron", "gateway", "plugins"):
        if (ROOT / package).is_dir():
            compileall.compile_dir(ROOT / package, quiet=2, workers=1)
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The slow files first (see SLOW_FILES_FIRST), every file's tests in their own order."""
    rank = {name: i for i, name in enumerate(SLOW_FILES_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep their order


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    h = tmp_path / "home"
    monkeypatch.setenv("APPSERVER_HOME", str(h))
    monkeypatch.setenv("APPSERVER_LIMITS__RETRY_BASE_MS", "10")
    return h


@pytest.fixture
def cli(home: Path):  # type: ignore[no-untyped-def]
    def _cli(*args: str, **kw) -> CLIResult:  # type: ignore[no-untyped-def]
        return run_cli(home, *args, **kw)

    return _cli


@pytest.fixture
def serve(home: Path) -> Iterator[ServeProcess]:
    with serving(home, graceful=False) as sp:
        yield sp


CONFORMANCE_SKIP = "conformance data not found"


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """Skips for missing conformance data are loud (issue 14.11): those tests validate every HTTP
    shape against OpenAI's published schema, and a clone without ../shared/conformance skips them."""
    skipped = [
        r for r in terminalreporter.stats.get("skipped", []) if CONFORMANCE_SKIP in str(getattr(r, "longrepr", ""))
    ]
    if skipped:
        terminalreporter.write_sep(
            "!",
            f"WARNING: {len(skipped)} tests skipped: {CONFORMANCE_SKIP} (../shared/conformance beside the repo); "
            "HTTP shapes were NOT validated",
            red=True,
            bold=True,
        )
