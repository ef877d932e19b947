"""The composition root's product: the long-lived services `serve` builds around one `Server`.
Typed fields, not a string-keyed bag: `serve` builds them once (`build_services`) and hands each
front end only what it uses — the OpenAI routes get `metrics`, the WebSocket routes the `hub` and
`cron` (the `cron_run` frame), both the open-turn `places` they count in together, serve's signal
handler the `hub` (it tells clients it is stopping). `running()` runs the background services for
the app's lifespan; a service that has a readiness check registers it with `Server.readiness` while
it runs. `channels` runs the gateway supervisor when channels are enabled.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

from appserver.channels import ChannelService
from appserver.http.metrics import Metrics
from appserver.security.limits import TurnPlaces
from appserver.server import Server
from appserver.ws.hub import Hub
from cron.service import CronService, cron_background


@dataclass(frozen=True, slots=True)
class Services:
    hub: Hub
    metrics: Metrics
    cron: CronService
    channels: ChannelService
    places: TurnPlaces  # the open-turn count the OpenAI routes and the WebSocket share

    @asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        """The background services while the app serves (the scheduler, the channel gateway),
        stopped in reverse order."""
        async with cron_background(self.cron), self.channels.running():
            yield


def build_services(server: Server) -> Services:
    channels = ChannelService(server.config, server.readiness, cluster=lambda: getattr(server.store, "cluster", None))
    cron = CronService(server, deliver=channels.deliver if channels.enabled else None)
    # before the server opens: the queued cron runs its start takes up are checked by the kernel
    # itself (cron's outcome recovery runs later, once a queue may have begun them)
    server.kernel.hold_back_queued(cron.held_back)
    return Services(
        hub=Hub(server),
        metrics=Metrics(server),
        cron=cron,
        channels=channels,
        places=TurnPlaces(server),
    )
