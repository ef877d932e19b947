"""Channels as a service of `serve`: the gateway supervisor, its credential and its readiness.

With channels enabled (`--channels` or `[channels] enabled`), serve runs the gateway child under
`gateway.supervisor.GatewaySupervisor` once its own socket is bound (the child connects to it like
any client). The child's credential is minted here per start: in auth mode `token` a capability
token named `gateway` with the `ws` scope only (its conversations form their own namespace; the
name is reserved and the token marked as the gateway's, so no user token can share it), revoked
when that child ends; in mode `none` the loopback needs none. `/readyz` gets a `channels`
check: ready only when the child runs and every enabled account runs, with per-account detail.

In a cluster, the server vouches for its gateway's intake a moment at a time (`_vouch_forever`),
and says at once when its session is lost: a gateway whose server is stopped, stalled, cut off
from the database or fenced acknowledges no platform message (the platform offers it again, to
the next holder of the account's lease).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import math
import re
import socket
import sqlite3
import time
from collections.abc import AsyncIterator, Callable, Iterator
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from appserver.auth import GATEWAY_TOKEN_NAME, ReservedNameTaken, token_store_for
from appserver.channelconfig import AccountConfig, shared_secrets
from appserver.config import Config
from appserver.readiness import CheckResult, Readiness
from appserver.shown import shown
from gateway.db import (
    CorruptGatewayDB,
    CorruptGatewayDBInUse,
    LedgerFileRefused,
    SchemaTooNew,
    default_path,
    ledger_exists,
    open_db,
)
from gateway.pairing import Pairing, PairingError
from gateway.split import DELIVER_MAX_CHARS, cap_text
from gateway.sqlstore import open_pg
from gateway.supervisor import DELIVER_COMMAND_TIMEOUT_S, Credential, GatewaySupervisor

if TYPE_CHECKING:
    from appserver.store.cluster import Cluster

log = logging.getLogger("appserver.channels")

READINESS_CHECK = "channels"
LEASE_CHECK_S = 1.0  # how often a server of a cluster looks for channel accounts to take over
# A delivery (cron `--deliver`) ends within this, waiting for a starting gateway included: cron
# stops waiting at 110 s (cron/runner.py DELIVER_TIMEOUT_S) and must hear the gateway's verdict.
DELIVER_BUDGET_S = 108.0
# Once the gateway runs it gets at least this long to answer: the child gives a delivery up at
# 90 s (gateway/replies.py DELIVER_GIVE_UP_S) and then says so, so nobody stops waiting earlier.
DELIVER_ANSWER_S = 95.0
# What is left for a gateway that is starting (at serve's start, or restarting): a cron catch-up
# run fired at start can finish before the child is ready, and its reply should still go out.
DELIVER_START_WAIT_S = DELIVER_BUDGET_S - DELIVER_ANSWER_S
START_POLL_S = 0.05
# A server of a cluster tells its gateway every VOUCH_EVERY_S (every heartbeat, when shorter) that
# it may take platform messages for VOUCH_FOR_S more, never past the moment this server would be
# fenced (`Cluster.fenced_in`), from which another server may take the account's lease, and not
# while its database session is away. Stopped (SIGSTOP), its gateway takes nothing from that
# instant (it watches its parent's state: gateway/intake.py `ServerProcess`); cut off from the
# database or judged gone, from the moment the cluster notices (`Cluster.on_cut_off` wakes the
# word); its event loop stalled (a long GC pause, swapping, a blocking call), within VOUCH_FOR_S:
# always before the lease can move. A message taken in a stall that lasts until the lease moves
# is not submitted and stays in this home's ledger, so the word is short: 1 s, renewed 4 times
# in it, so a loop late by up to 0.75 s (already 7 times asyncio's slow-callback mark) pauses
# nothing, where one that loses the lease (late by the timeout less a heartbeat, 28 s at the
# defaults) pauses intake within 1 s of its start.
VOUCH_EVERY_S = 0.25
VOUCH_FOR_S = 1.0
# A stopping server of a cluster waits at most this for its gateway to confirm the pause (the
# child answers within milliseconds; a wedged one is ended by the stop anyway).
PAUSE_WAIT_S = 1.0


def gateway_token_name(config: Config) -> str:
    """The gateway credential's token name: `gateway`, or, when the tokens live in a database
    several servers share, one per home (`gateway@<host>-<hash of the home>`), so one server's
    start never revokes another's gateway."""
    if not config.store.url.strip():
        return GATEWAY_TOKEN_NAME
    where = hashlib.sha256(f"{socket.gethostname()}:{config.home.resolve()}".encode()).hexdigest()[:10]
    host = re.sub(r"[^A-Za-z0-9.-]", "-", socket.gethostname())[:40] or "host"
    return f"{GATEWAY_TOKEN_NAME}@{host}-{where}"


class ChannelsUnavailable(Exception):
    """Channels cannot run with this configuration (said once at start, and by /readyz)."""


def mint_credential(config: Config) -> Credential:
    mode = config.auth.mode
    if mode == "none":
        return Credential(None, lambda: None)
    if mode != "token":
        raise ChannelsUnavailable(
            "channels need auth mode 'none' or 'token' (the gateway gets a capability token); "
            f"this server uses {mode!r}"
        )
    store = token_store_for(config.home, config.store.url)
    name = gateway_token_name(config)
    try:
        # replaces the credential a server of this home left behind when it was killed; marked
        # as the gateway's (a user's token can never carry the gateway's namespace)
        record, plaintext, replaced = store.mint_gateway(name, scopes="ws")
    except ReservedNameTaken as exc:
        # a token an older appserver let someone name `gateway`: never revoked without a word;
        # channels wait for the operator (it keeps working, in a namespace of its own)
        raise ChannelsUnavailable(str(exc)) from None
    if replaced is not None and not replaced.is_gateway:
        log.warning(
            "channels: revoked token %s named %r (scopes ws, every agent, no expiry, created %s): taken for "
            "the credential an older server's gateway left behind; if it was a token of yours, create it "
            "again under another name (the name is reserved for the gateway)",
            replaced.id,
            replaced.name,
            time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(replaced.created_at)),
        )

    def revoke() -> None:
        with contextlib.suppress(KeyError):
            store.revoke(record.id)

    return Credential(plaintext, revoke)


class ChannelService:
    def __init__(
        self, config: Config, readiness: Readiness, cluster: Callable[[], Cluster | None] | None = None
    ) -> None:
        self.config = config
        self.readiness = readiness
        self.accounts = config.channels.enabled_accounts()
        # an account using another's secret runs in state `error` saying so (not a 409 loop), and so
        # does one with a problem found at load (`AccountConfig.problem`): never with defaults
        self.refused = {ref: why for ref, (_owner, why) in shared_secrets(self.accounts, config.home).items()}
        self.refused |= {a.ref: a.problem for a in self.accounts if a.problem is not None}
        # Several servers on one database: each account runs in the gateway of the one server
        # holding its lease (`Cluster.take_channel`); `elsewhere` names the holders of the others.
        self._cluster = cluster
        self.elsewhere: dict[str, str] = {}
        self.supervisor: GatewaySupervisor | None = None
        self._url: asyncio.Future[str] | None = None
        self._problem: str | None = None
        self._task: asyncio.Task[None] | None = None
        # What the intake a server of a cluster vouches for rests on (monotonic times): when its
        # last lease check that found every running account its own began (None: none yet), the
        # last moment it may have been fenced, and the moment it would be fenced, as last seen.
        self._held_since: float | None = None
        self._doubt_at = 0.0
        self._fence_at = math.inf
        self._vouching: asyncio.Task[None] | None = None
        self._stopping = False  # a server of a cluster that is stopping vouches for nothing more

    @property
    def enabled(self) -> bool:
        return bool(self.config.channels.enabled)

    def server_bound(self, url: str) -> None:
        """serve calls this once its socket is bound: the child can connect now."""
        if self._url is not None and not self._url.done():
            self._url.set_result(url)

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        if not self.enabled:
            yield
            return
        self._url = asyncio.get_running_loop().create_future()
        self.readiness.register(READINESS_CHECK, self.check, ttl_s=0.5)
        self._task = asyncio.get_running_loop().create_task(self._start(), name="channels-start")
        try:
            yield
        finally:
            self.readiness.unregister(READINESS_CHECK)
            if self._task is not None:
                self._task.cancel()
                await asyncio.gather(self._task, return_exceptions=True)
            if self.supervisor is not None:
                await self.supervisor.stop()

    async def _start(self) -> None:
        assert self._url is not None
        url = await self._url
        enabled = self.config.channels.enabled
        for channel in enabled:
            if not self.config.channels.accounts.get(channel):
                log.warning(
                    "channel %s is enabled but has no account: add [channels.%s.accounts.NAME] to %s",
                    channel,
                    channel,
                    self.config.config_path,
                )
        for ref, why in self.refused.items():
            log.error("channels: %s is not started: %s", ref, why)
        try:
            mint_credential(self.config).revoke()  # fail early and clearly on a mode that cannot work
        except ChannelsUnavailable as exc:
            self._problem = str(exc)
            log.error("channels: %s", exc)
            return
        cluster = self._cluster() if self._cluster is not None else None
        if cluster is None:
            await self._run_gateway(url, self.accounts)
            return
        await self._follow_leases(url, cluster)

    async def _run_gateway(self, url: str, accounts: list[AccountConfig], cluster: Cluster | None = None) -> None:
        self.supervisor = GatewaySupervisor(
            home=self.config.home,
            url=lambda: url,
            accounts=[
                a.to_json() | ({"problem": self.refused[a.ref]} if a.ref in self.refused else {}) for a in accounts
            ],
            credential=lambda: mint_credential(self.config),
            intake=None if cluster is None else partial(self._intake_until, cluster),
            store=partial(self._store_for_gateway, cluster),
        )
        log.info("channels: starting the gateway for %s", ", ".join(a.ref for a in accounts) or "no accounts")
        await self.supervisor.start()
        ok, detail = self.supervisor.readiness()
        if not ok:
            log.error("channels: not every account is running: %s", _describe(detail))

    def _store_for_gateway(self, cluster: Cluster | None) -> dict[str, Any] | None:
        """What the gateway child is told of the server's store (its start envelope): on PostgreSQL,
        the URL (its tables live there too: gateway/sqlstore.py) and, for an instance of a cluster,
        its id (its writes are fenced by `channel_owners`); None on SQLite (gateway.db in the home)."""
        url = self.config.store.url.strip()
        if not url:
            return None
        return {"url": url, "instance": cluster.instance_id if cluster is not None else None}

    async def _follow_leases(self, url: str, cluster: Cluster) -> None:
        """Run the accounts whose lease this server holds, and take over those of a server that
        is gone: the gateway restarts with the new set whenever it changes. Its intake is vouched
        for meanwhile (`_vouch_forever`), and paused the moment the cluster is cut off."""
        cut_off = asyncio.Event()
        cluster.on_cut_off = cut_off.set
        vouching = asyncio.get_running_loop().create_task(self._vouch_forever(cluster, cut_off), name="channels-vouch")
        self._vouching = vouching
        try:
            await self._check_leases(url, cluster)
        finally:
            cluster.on_cut_off = None
            vouching.cancel()
            await asyncio.gather(vouching, return_exceptions=True)

    async def _check_leases(self, url: str, cluster: Cluster) -> None:
        running: tuple[str, ...] | None = None
        said = ""
        while True:
            began = time.monotonic()
            mine: list[AccountConfig] = []
            others: dict[str, str] = {}
            try:
                if not cluster.lost:
                    for account in self.accounts:
                        holder = await cluster.take_channel(account.ref)
                        if holder is None:
                            mine.append(account)
                        else:
                            others[account.ref] = holder
            except Exception as exc:  # the database is away: keep what runs, look again
                if str(exc) != said:
                    said = str(exc)
                    log.error("channels: cannot check the account leases: %s", exc)
                await asyncio.sleep(LEASE_CHECK_S)
                continue
            said = ""
            self.elsewhere = others
            refs = tuple(a.ref for a in mine)
            if refs != running:
                if self.supervisor is not None:
                    await self.supervisor.stop()
                    self.supervisor = None
                if others:
                    log.info(
                        "channels: %s run in other servers of the cluster",
                        ", ".join(f"{ref} (instance {who})" for ref, who in others.items()),
                    )
                self._lease_confirmed(cluster, began)  # before the start: its first word vouches
                if mine:
                    await self._run_gateway(url, mine, cluster)
                running = refs
            else:
                self._lease_confirmed(cluster, began)
            await asyncio.sleep(LEASE_CHECK_S)

    def _lease_confirmed(self, cluster: Cluster, began: float) -> None:
        """A lease check begun at `began` found every account the gateway runs this server's."""
        if not cluster.lost:
            self._held_since = began

    async def _vouch_forever(self, cluster: Cluster, cut_off: asyncio.Event) -> None:
        """Tell the running gateway, every VOUCH_EVERY_S and at once when the cluster is cut off
        (`cut_off` set), until when it may take messages (`_intake_until`). A stalled server says
        nothing, and its gateway's intake lapses."""
        every = min(VOUCH_EVERY_S, cluster.heartbeat_s)
        while True:
            cut_off.clear()
            until = self._intake_until(cluster)
            supervisor = self.supervisor
            if supervisor is not None and supervisor.view.state in ("running", "unresponsive"):
                try:
                    await supervisor.vouch(until, timeout=every)
                except Exception:  # noqa: BLE001 - ended, this loop would pause the gateway for good
                    log.exception("channels: could not tell the gateway about its intake")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(cut_off.wait(), every)

    async def pause_intake(self) -> None:
        """The server is stopping (SIGTERM, SIGINT): in a cluster its gateway acknowledges nothing
        from now on, before turns drain and leases go. A message it took meanwhile would stay in this
        home's ledger while another server takes the account; refused (503), the platform offers it
        to that server. A server alone on its store keeps taking them: its ledger stays on the same
        home and the restarted server answers what it holds (the gate is open for good there)."""
        if self._vouching is None or self._stopping:
            return
        self._stopping = True  # every later word (`_intake_until`) and a restarted child's first: 0
        # a word computed before this moment and not yet written would reopen the gate: none is sent
        self._vouching.cancel()
        supervisor = self.supervisor
        if supervisor is not None and supervisor.view.state in ("running", "unresponsive"):
            if await supervisor.vouch(0.0, timeout=PAUSE_WAIT_S):
                log.info("channels: stopping: the gateway's intake is paused (another server takes the accounts)")
            else:
                log.warning("channels: stopping: the gateway did not confirm its intake is paused")

    def _intake_until(self, cluster: Cluster) -> float:
        """Until when (monotonic) this server vouches for its gateway's intake; 0: not now. Only
        while it is not fenced and a lease check begun since it last may have been (seen fenced,
        or past the moment it would be, unseen: this process stalled) found the accounts its own:
        meanwhile another server may have taken one."""
        if self._stopping:
            return 0.0
        now = time.monotonic()
        # Its session away at all (`cut_off`), not only past the grace (`fenced`): a message taken
        # meanwhile cannot be submitted, and past the grace another server may take the account,
        # leaving it in this gateway's ledger (the default grace is 5 s).
        if cluster.cut_off or now >= self._fence_at:
            self._doubt_at = now
        left = cluster.fenced_in
        self._fence_at = now + left
        if left <= 0 or self._held_since is None or self._held_since <= self._doubt_at:
            return 0.0
        return now + min(VOUCH_FOR_S, left)

    async def check(self) -> CheckResult:
        if self._problem:
            return CheckResult("fail", self._problem)
        elsewhere = "; ".join(f"{ref} runs in instance {who}" for ref, who in self.elsewhere.items())
        if self.supervisor is None:
            if self.elsewhere and len(self.elsewhere) == len(self.accounts):
                return CheckResult("ok", elsewhere)
            return CheckResult("fail", "the gateway is starting")
        ok, detail = self.supervisor.readiness()
        live = {ref: {"state": a.get("state"), "reason": a.get("reason")} for ref, a in detail["accounts"].items()}
        words = "; ".join(filter(None, [_describe(detail), elsewhere]))
        return CheckResult("ok" if ok else "fail", words, {"gateway": detail["gateway"], "accounts": live})

    async def deliver(self, target: str, text: str) -> list[str]:
        """Send `text` to `channel:account:chat[:thread]` through the gateway (cron `--deliver`).

        A gateway that is starting is waited for (at most DELIVER_START_WAIT_S); one that cannot
        run the target's account (channels off, the account not configured, a setup problem)
        fails at once, saying why. A text over DELIVER_MAX_CHARS is cut there with a note (as the
        child would), so the command stays far below the child's line limit; a command over that
        limit all the same is refused before it is sent (`CommandTooLarge`), failing this delivery
        alone."""
        if len(text) > DELIVER_MAX_CHARS:
            log.warning(
                "channels: delivering the first %d of %d characters to %s", DELIVER_MAX_CHARS, len(text), target
            )
            text = cap_text(text)
        started = time.monotonic()
        supervisor = await self._gateway_for(target)
        waited = time.monotonic() - started
        timeout = min(DELIVER_COMMAND_TIMEOUT_S, DELIVER_BUDGET_S - waited)
        reply = await supervisor.command("deliver", timeout=timeout, target=target, text=text)
        if not reply.get("ok"):
            raise RuntimeError(str(reply.get("error") or "delivery failed"))
        return [str(i) for i in reply.get("remote_ids") or []]

    async def _gateway_for(self, target: str) -> GatewaySupervisor:
        """The running gateway that can deliver to `target`, once it runs."""
        parts = target.split(":")
        if len(parts) < 3:
            raise RuntimeError(f"invalid target {shown(target)}: use channel:account:chat[:thread]")
        channel, ref = parts[0], f"{parts[0]}:{parts[1]}"
        if not self.enabled:
            raise RuntimeError("channels are not enabled in this server")
        if channel not in self.config.channels.enabled:
            raise RuntimeError(f"channel {channel} is not enabled in this server")
        if ref not in {a.ref for a in self.accounts}:
            raise RuntimeError(f"no account {ref} is configured in this server")
        if ref in self.elsewhere:
            raise RuntimeError(f"{ref} runs in instance {self.elsewhere[ref]} of the cluster, not in this server")
        deadline = time.monotonic() + DELIVER_START_WAIT_S
        while True:
            if self._problem:
                raise RuntimeError(self._problem)
            supervisor = self.supervisor
            if supervisor is not None and supervisor.view.state == "running":
                return supervisor
            if self._task is None or (self._task.done() and supervisor is None):
                raise RuntimeError("channels are not running")  # not started, or ended for good
            if time.monotonic() >= deadline:
                state = "not started" if supervisor is None else supervisor.view.state
                if supervisor is not None and supervisor.view.reason:
                    state += f": {supervisor.view.reason}"
                raise RuntimeError(f"the gateway is not running after waiting {DELIVER_START_WAIT_S:g} s ({state})")
            await asyncio.sleep(START_POLL_S)

    async def status(self) -> dict[str, Any]:
        if self.supervisor is None:
            return {"gateway": "stopped", "reason": self._problem, "accounts": {}}
        return self.supervisor.readiness()[1]


class PairingRefused(Exception):
    """A pairing code that cannot be decided (unknown, expired, already decided)."""


class LedgerUnavailable(Exception):
    """gateway.db cannot be used now (corrupt, of a newer appserver, busy, unreadable): the message
    says why and what happened to the file."""


@contextlib.contextmanager
def _ledger(home: Path, store_url: str = "") -> Iterator[sqlite3.Connection]:
    if store_url.strip():  # the gateway's tables are in the server's PostgreSQL database (gateway/sqlstore.py)
        try:
            pg = open_pg(store_url.strip())
        except (sqlite3.Error, ImportError) as exc:
            raise LedgerUnavailable(f"cannot open the gateway tables in the PostgreSQL store: {exc}") from None
        try:
            yield pg  # type: ignore[misc]
        finally:
            pg.close()
        return
    try:
        conn = open_db(default_path(home))
    except CorruptGatewayDB as exc:
        raise LedgerUnavailable(f"{exc}; the gateway starts a new, empty ledger") from None
    except (CorruptGatewayDBInUse, SchemaTooNew, LedgerFileRefused) as exc:  # each names its file
        raise LedgerUnavailable(str(exc)) from None
    except (sqlite3.Error, OSError) as exc:
        raise LedgerUnavailable(f"cannot open {default_path(home)}: {exc}") from None
    try:
        yield conn
    finally:
        conn.close()


def pairing_pending(home: Path, store_url: str = "") -> list[dict[str, Any]]:
    """Pending channel pairing codes (the `pairing_list` frame); gateway.db is read directly (the
    gateway tables, on a PostgreSQL store). A link to nothing is no "no ledger yet" (an empty list
    would hide the codes on its disk)."""
    if store_url.strip():
        with _ledger(home, store_url) as conn:
            return [p.to_json() for p in Pairing(conn).pending()]
    try:
        if not ledger_exists(default_path(home)):
            return []
    except LedgerFileRefused as exc:
        raise LedgerUnavailable(str(exc)) from None
    with _ledger(home) as conn:
        return [p.to_json() for p in Pairing(conn).pending()]


def pairing_decide(home: Path, code: str, decision: str, store_url: str = "") -> dict[str, Any]:
    """Approve or deny a code (the `pairing_decide` frame); a running gateway acts within a second."""
    with _ledger(home, store_url) as conn:
        pairing = Pairing(conn)
        try:
            decided = pairing.approve(code) if decision == "approve" else pairing.deny(code)
        except PairingError as exc:
            raise PairingRefused(str(exc)) from None
        return decided.to_json()


def _describe(detail: dict[str, Any]) -> str:
    accounts = detail.get("accounts") or {}
    parts = [
        f"{ref} {a.get('state')}" + (f" ({a.get('reason')})" if a.get("reason") and a.get("state") != "running" else "")
        for ref, a in accounts.items()
    ]
    head = f"gateway {detail.get('gateway')}" + (f" ({detail['reason']})" if detail.get("reason") else "")
    return "; ".join([head, *parts])
