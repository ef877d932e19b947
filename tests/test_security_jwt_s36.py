"""A JWT `agents` claim that mixes `*` with agent names (an outside finding, session 36).

It was read as "all agents": `/v1/models` listed every agent and a chat to any other agent
answered 200, while `appserver token create --agents 'bob,*'` refuses the same value and
docs/security.md said such a value is never read as "all". An identity provider that builds the
claim from group names could widen a credential for one agent to all of them. Now 401."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import jwt
import pytest

from appserver.auth import Authenticator, AuthError
from appserver.config import Config

SECRET = "s" * 40


def _auth(tmp_path: Path) -> Authenticator:
    (tmp_path / "jwt.secret").write_text(SECRET)
    cfg = Config(home=tmp_path)
    cfg.auth.mode = "jwt"
    cfg.auth.jwt_algorithms = ["HS256"]
    cfg.auth.jwt_secret_file = "jwt.secret"
    return Authenticator(cfg)


def _token(agents: Any) -> str:
    now = int(time.time())
    return "Bearer " + jwt.encode({"sub": "alice", "iat": now, "exp": now + 300, "agents": agents}, SECRET, "HS256")


@pytest.mark.parametrize("agents", ["bob,*", "* bob", ["bob", "*"], ["*", "*", "bob"]])
def test_star_beside_agent_names_is_refused(tmp_path: Path, agents: Any) -> None:
    with pytest.raises(AuthError) as info:
        _auth(tmp_path).authenticate(_token(agents))
    assert info.value.status == 401
    assert "mixes '*'" in str(info.value)


@pytest.mark.parametrize("agents", ["*", ["*"], ["*", "*"], " * "])
def test_star_alone_is_every_agent(tmp_path: Path, agents: Any) -> None:
    assert _auth(tmp_path).authenticate(_token(agents)).agents is None


def test_names_alone_limit_the_credential(tmp_path: Path) -> None:
    p = _auth(tmp_path).authenticate(_token(["bob", "carol"]))
    assert p.agents == frozenset({"bob", "carol"}) and p.allows_agent("bob") and not p.allows_agent("dave")
