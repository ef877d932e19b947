"""The one `Config` object: home directory, config.toml, environment overrides.

Every key is documented in docs/configuration.md. Environment variables override the file:
`APPSERVER_<SECTION>__<KEY>` (and `APPSERVER_PROVIDERS__<NAME>__<KEY>` for providers).
"""

from __future__ import annotations

import os
import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from appserver.fsutil import atomic_write_text, ensure_private_dir, move_aside

DEFAULT_LISTEN = "127.0.0.1:8770"

DEFAULT_CONFIG_TOML = """\
# appserver configuration. Every key is documented in docs/configuration.md.

[server]
# listen = "127.0.0.1:8770"
# allowed_origins = []            # browser origins allowed to call the server
# allowed_hosts = []              # extra Host names besides loopback and the listen address

[limits]
# queue_max = 32                  # queued inputs per conversation (429 / error beyond)
# approval_timeout_s = 600
# client_tool_timeout_s = 300
# max_steps = 24

# [providers.openai]              # built in: base_url https://api.openai.com/v1, OPENAI_API_KEY
# [providers.ollama]
# kind = "openai"
# base_url = "http://127.0.0.1:11434/v1"
# [providers.claude]
# kind = "anthropic"
# api_key_env = "ANTHROPIC_API_KEY"
"""


class ConfigError(Exception):
    """The configuration cannot be used; the message names the key."""


@dataclass(slots=True)
class ProviderConfig:
    name: str
    kind: str = "openai"  # openai | anthropic
    base_url: str = "https://api.openai.com/v1"
    api_key_env: str | None = "OPENAI_API_KEY"
    timeout_s: float = 300.0
    connect_timeout_s: float = 10.0
    max_attempts: int = 4
    headers: dict[str, str] = field(default_factory=dict)
    context_windows: dict[str, int] = field(default_factory=dict)  # model → tokens
    transport: str = "lean"  # lean (providers/fasttransport.py) | httpx (httpx's own transport)

    def api_key(self) -> str | None:
        return os.environ.get(self.api_key_env) if self.api_key_env else None


@dataclass(slots=True)
class ServerConfig:
    listen: str = DEFAULT_LISTEN
    allowed_origins: list[str] = field(default_factory=list)
    allowed_hosts: list[str] = field(default_factory=list)
    tls_cert: str | None = None
    tls_key: str | None = None


@dataclass(slots=True)
class LimitsConfig:
    queue_max: int = 32
    body_max_bytes: int = 20 * 1024 * 1024
    ws_frame_max_bytes: int = 4 * 1024 * 1024
    ws_outbound_max: int = 256
    ws_ping_interval_s: float = 30.0
    ws_ping_timeout_s: float = 90.0
    ws_send_timeout_s: float = 30.0  # a WebSocket frame not accepted by the client within this is a slow consumer
    connections_per_client: int = 256
    approval_timeout_s: float = 600.0
    client_tool_timeout_s: float = 300.0
    max_steps: int = 24
    idle_evict_s: float = 60.0
    shell_timeout_s: float = 60.0
    shell_output_max_bytes: int = 64 * 1024
    draft_interval_s: float = 0.5  # how often a running turn's visible text is checkpointed
    retry_base_ms: int = 500  # first provider retry backoff; doubles per attempt, capped at 20 s
    sse_keepalive_s: float = 15.0  # SSE keepalive comment interval on the OpenAI routes
    context_reserve_tokens: int = 0  # room kept for the reply; 0 = a quarter of the window, at most 8,192


@dataclass(slots=True)
class AuthConfig:
    mode: str = "none"  # none | token | jwt
    jwt_algorithms: list[str] = field(default_factory=list)
    jwt_secret_file: str | None = None
    jwt_public_key_file: str | None = None
    jwt_issuer: str | None = None
    jwt_audience: str | None = None
    jwt_leeway_s: float = 30.0


@dataclass(slots=True)
class CronConfig:
    enabled: bool = True
    tick_s: float = 60.0


@dataclass(slots=True)
class Config:
    home: Path
    server: ServerConfig = field(default_factory=ServerConfig)
    limits: LimitsConfig = field(default_factory=LimitsConfig)
    auth: AuthConfig = field(default_factory=AuthConfig)
    cron: CronConfig = field(default_factory=CronConfig)
    providers: dict[str, ProviderConfig] = field(default_factory=dict)

    @property
    def db_path(self) -> Path:
        return self.home / "appserver.db"

    @property
    def server_json(self) -> Path:
        return self.home / "server.json"

    @property
    def config_path(self) -> Path:
        return self.home / "config.toml"

    def workspace(self, agent_id: str) -> Path:
        return self.home / "workspaces" / agent_id


def default_home() -> Path:
    env = os.environ.get("APPSERVER_HOME")
    return Path(env).expanduser() if env else Path.home() / ".appserver"


def _coerce(value: Any, current: Any, key: str) -> Any:
    """Coerce an environment string (or TOML value) to the type of the default."""
    if isinstance(value, str) and not isinstance(current, str) and current is not None:
        if isinstance(current, bool):
            low = value.strip().lower()
            if low in ("1", "true", "yes", "on"):
                return True
            if low in ("0", "false", "no", "off"):
                return False
            raise ConfigError(f"{key}: expected a boolean, got {value!r}")
        if isinstance(current, int):
            try:
                return int(value)
            except ValueError:
                raise ConfigError(f"{key}: expected an integer, got {value!r}") from None
        if isinstance(current, float):
            try:
                return float(value)
            except ValueError:
                raise ConfigError(f"{key}: expected a number, got {value!r}") from None
        if isinstance(current, list):
            return [v.strip() for v in value.split(",") if v.strip()]
    if isinstance(current, float) and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    return value


def _apply_section(obj: Any, data: dict[str, Any], section: str) -> None:
    known = {f.name for f in fields(obj)}
    for key, value in data.items():
        if key not in known or key == "name":
            raise ConfigError(f"unknown key [{section}] {key} in config.toml")
        setattr(obj, key, _coerce(value, getattr(obj, key), f"[{section}] {key}"))


def _env_overrides(environ: dict[str, str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, value in environ.items():
        if not name.startswith("APPSERVER_") or "__" not in name:
            continue
        path = [p.lower() for p in name[len("APPSERVER_") :].split("__")]
        cur = out
        for part in path[:-1]:
            cur = cur.setdefault(part, {})
        cur[path[-1]] = value
    return out


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(base.get(k), dict):
            _merge(base[k], v)
        else:
            base[k] = v
    return base


def builtin_providers() -> dict[str, ProviderConfig]:
    return {"openai": ProviderConfig(name="openai")}


def load_config(home: Path | None = None, environ: dict[str, str] | None = None, *, create: bool = True) -> Config:
    """Read `home/config.toml` (created with commented defaults on first use) plus env overrides."""
    home = (home or default_home()).expanduser().resolve()
    environ = dict(os.environ) if environ is None else environ
    if create:
        ensure_private_dir(home)
    path = home / "config.toml"
    data: dict[str, Any] = {}
    if path.exists():
        try:
            data = tomllib.loads(path.read_text("utf-8"))
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
            raise ConfigError(str(move_aside(path, f"invalid TOML: {exc}"))) from None
    elif create:
        atomic_write_text(path, DEFAULT_CONFIG_TOML)
    data = _merge(data, _env_overrides(environ))

    cfg = Config(home=home, providers=builtin_providers())
    for section, target in (("server", cfg.server), ("limits", cfg.limits), ("auth", cfg.auth), ("cron", cfg.cron)):
        raw = data.pop(section, {})
        if not isinstance(raw, dict):
            raise ConfigError(f"[{section}] must be a table")
        _apply_section(target, raw, section)
    if environ.get("APPSERVER_DISABLE_CRON") == "1":
        cfg.cron.enabled = False
    if "APPSERVER_CRON_TICK_S" in environ:
        cfg.cron.tick_s = _coerce(environ["APPSERVER_CRON_TICK_S"], 1.0, "APPSERVER_CRON_TICK_S")

    for name, raw in (data.pop("providers", {}) or {}).items():
        if not isinstance(raw, dict):
            raise ConfigError(f"[providers.{name}] must be a table")
        prov = cfg.providers.get(name) or ProviderConfig(name=name)
        kind = raw.get("kind", prov.kind)
        if kind not in ("openai", "anthropic"):
            raise ConfigError(f"[providers.{name}] kind must be 'openai' or 'anthropic', got {kind!r}")
        if name not in cfg.providers:
            if kind == "anthropic":
                prov.base_url, prov.api_key_env = "https://api.anthropic.com", "ANTHROPIC_API_KEY"
            elif "base_url" in raw:
                prov.api_key_env = None  # a local OpenAI-compatible server needs no key unless named
        _apply_section(prov, raw, f"providers.{name}")
        if prov.transport not in ("lean", "httpx"):
            raise ConfigError(f"[providers.{name}] transport must be 'lean' or 'httpx', got {prov.transport!r}")
        if name == "echo":
            raise ConfigError("[providers.echo] is built in and cannot be configured")
        cfg.providers[name] = prov
    if data:
        raise ConfigError(f"unknown section(s) in config.toml: {', '.join(sorted(data))}")
    return cfg
