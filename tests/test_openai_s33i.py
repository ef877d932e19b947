"""OpenAI surface fixes from an outside tester's findings (session 33, helper i), through a real
`appserver serve` on loopback (token auth, echo agents `alpha` and `beta`) with httpx and the real
`openai` SDK.

1. An error object's `param` is capped as its `message` is: a megabyte unknown key (top-level, in
   `reasoning`, `input[0]`, `moderation`; chat's `logit_bias` token id) came back as a megabyte
   `param`.
2. `moderation.policy` is typed as OpenAI's `ModerationPolicyParam` (`input` / `output`: null or
   `{mode: score|block}`, `mode` required) on both routes, its unknown keys refused on Responses;
   `mode: "block"`, which a server running no moderation cannot honour, is refused, never dropped.
3. `X-Conversation-Id` beside `previous_response_id` or `conversation` naming another conversation
   is a 400 `conflicting_parameters` (it was dropped for the body's choice); naming the same one is
   fine.
4. Chat's legacy `function_call: {"name": …}` without `functions` is a 400 `invalid_tool_choice`
   (it was ignored: a plain reply); `"none"` / `"auto"` without `functions` stay accepted.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.openai_schema import require_conformance, validate
from tests.support.cli import cli_env, run_cli
from tests.support.serve import serving

pytestmark = pytest.mark.timeout(90)

HUGE = 1_000_000
CHAT = {"model": "alpha", "messages": [{"role": "user", "content": "hi"}]}
RESP = {"model": "alpha", "input": "hi"}


class Env:
    def __init__(self, url: str, token: str) -> None:
        self.url, self.token = url, token

    def http(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {self.token}"}, timeout=30)

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=self.token, max_retries=0, timeout=30)


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    require_conformance()
    home: Path = tmp_path_factory.mktemp("s33i") / "home"
    home.mkdir()
    (home / "config.toml").write_text('[auth]\nmode = "token"\n')
    cli = cli_env(home)
    for name in ("alpha", "beta"):
        made = run_cli(home, "agents", "create", "--name", name, env=cli)
        assert made.code == 0, made.err
    minted = run_cli(home, "token", "create", "--name", "tester", "--json", env=cli)
    assert minted.code == 0, minted.err
    with serving(home, env=cli) as sp:
        yield Env(sp.url, str(minted.json()["token"]))


def refused(r: httpx.Response, code: str, param: str | None) -> dict[str, Any]:
    assert r.status_code == 400, r.text[:500]
    validate("ErrorResponse", r.json())
    err: dict[str, Any] = r.json()["error"]
    assert (err["code"], err["param"]) == (code, param), err
    return err


def post(http: httpx.Client, path: str, body: dict[str, Any], **headers: str) -> httpx.Response:
    return http.post(path, content=json.dumps(body), headers={"Content-Type": "application/json", **headers})


# ---------------------------------------------------------------- 1. a bounded `param`

BIG_KEY = "k" * HUGE
BIG_PARAMS = [
    ("/v1/responses", {**RESP, BIG_KEY: 1}, BIG_KEY),
    ("/v1/responses", {**RESP, "reasoning": {BIG_KEY: 1}}, f"reasoning.{BIG_KEY}"),
    ("/v1/responses", {**RESP, "input": [{"role": "user", "content": "hi", BIG_KEY: 1}]}, f"input[0].{BIG_KEY}"),
    ("/v1/responses", {**RESP, "moderation": {"model": "m", BIG_KEY: 1}}, f"moderation.{BIG_KEY}"),
    ("/v1/chat/completions", {**CHAT, "logit_bias": {"1" * HUGE: "x"}}, "logit_bias." + "1" * HUGE),
]


@pytest.mark.parametrize(("path", "body", "full"), BIG_PARAMS, ids=["top", "reasoning", "input", "moderation", "bias"])
def test_a_megabyte_key_is_no_megabyte_param(env: Env, path: str, body: dict[str, Any], full: str) -> None:
    with env.http() as http:
        r = post(http, path, body)
    assert r.status_code == 400, r.text[:300]
    validate("ErrorResponse", r.json())
    param = r.json()["error"]["param"]
    assert len(r.content) < 12_000, len(r.content)
    assert len(param) < 400 and param.startswith(full[:200]) and f"({len(full)} characters)" in param, param[:400]
    with env.http() as http:  # a path of ordinary length stays whole
        refused(
            post(http, "/v1/responses", {**RESP, "reasoning": {"bogus": 1}}), "unknown_parameter", "reasoning.bogus"
        )


# ---------------------------------------------------------------- 2. moderation.policy

MOD = "omni-moderation-latest"
BOTH_ROUTES = [
    ({"input": 5}, "invalid_type", "moderation.policy.input"),
    ({"output": "x"}, "invalid_type", "moderation.policy.output"),
    ({"input": {"mode": "bogus"}}, "invalid_value", "moderation.policy.input.mode"),
    ({"output": {}}, "missing_required_parameter", "moderation.policy.output.mode"),
    ({"output": {"mode": None}}, "invalid_type", "moderation.policy.output.mode"),
    ({"input": {"mode": "block"}}, "unsupported_value", "moderation.policy.input.mode"),
    ({"input": None, "output": {"mode": "block"}}, "unsupported_value", "moderation.policy.output.mode"),
]


@pytest.mark.parametrize("route", ["chat", "responses"])
@pytest.mark.parametrize(("policy", "code", "param"), BOTH_ROUTES)
def test_moderation_policy_is_typed(env: Env, route: str, policy: Any, code: str, param: str) -> None:
    path, base = ("/v1/chat/completions", CHAT) if route == "chat" else ("/v1/responses", RESP)
    with env.http() as http:
        err = refused(post(http, path, {**base, "moderation": {"model": MOD, "policy": policy}}), code, param)
    if code == "unsupported_value":
        assert "no moderation" in err["message"], err


@pytest.mark.parametrize(
    ("policy", "param"),
    [({"foo": 1}, "moderation.policy.foo"), ({"input": {"mode": "score", "foo": 1}}, "moderation.policy.input.foo")],
)
def test_moderation_policy_unknown_keys_are_refused_on_responses(env: Env, policy: Any, param: str) -> None:
    with env.http() as http:
        refused(
            post(http, "/v1/responses", {**RESP, "moderation": {"model": MOD, "policy": policy}}),
            "unknown_parameter",
            param,
        )
        ok = post(http, "/v1/chat/completions", {**CHAT, "moderation": {"model": MOD, "policy": policy}})
    assert ok.status_code == 200, ok.text  # chat accepts unknown nested keys, as it does elsewhere
    scoring = {"input": {"mode": "score"}, "output": None}  # typed right, asking no block: accepted
    client = env.client()
    made = client.responses.create(
        model="alpha", input="hi", extra_body={"moderation": {"model": MOD, "policy": scoring}}
    )
    assert made.status == "completed"
    chat = client.chat.completions.create(
        model="alpha",
        messages=[{"role": "user", "content": "hi"}],
        extra_body={"moderation": {"model": MOD, "policy": {"output": {"mode": "score"}}}},
    )
    assert chat.choices[0].message.content


# ---------------------------------------------------------------- 3. X-Conversation-Id beside the body's choice


def test_header_naming_another_conversation_than_the_body_is_refused(env: Env) -> None:
    with env.http() as http:
        root = post(http, "/v1/responses", {"model": "alpha", "input": "root"})
        assert root.status_code == 200, root.text
        pinned = post(http, "/v1/responses", {"model": "alpha", "input": "pinned"}, **{"X-Conversation-Id": "pinhdr"})
        assert pinned.status_code == 200, pinned.text
        pinned_id = pinned.headers["x-conversation-id"]
        follow = {"model": "alpha", "input": "/recall", "previous_response_id": root.json()["id"]}
        for header in ("pinhdr", pinned_id, "new", "default"):
            refused(
                post(http, "/v1/responses", follow, **{"X-Conversation-Id": header}),
                "conflicting_parameters",
                "X-Conversation-Id",
            )
        by_conv = {"model": "alpha", "input": "/recall", "conversation": pinned_id}
        refused(
            post(http, "/v1/responses", by_conv, **{"X-Conversation-Id": "other-name"}),
            "conflicting_parameters",
            "X-Conversation-Id",
        )
        # a handoff to beta from alpha's response, with beta's own pinned conversation: refused too
        beta = post(http, "/v1/responses", {"model": "beta", "input": "b"}, **{"X-Conversation-Id": "betapin"})
        assert beta.status_code == 200, beta.text
        handoff = {"model": "beta", "input": "/recall", "previous_response_id": root.json()["id"]}
        refused(
            post(http, "/v1/responses", handoff, **{"X-Conversation-Id": "betapin"}),
            "conflicting_parameters",
            "X-Conversation-Id",
        )

        # the same conversation named both ways: accepted, and it goes there
        for header in ("pinhdr", pinned_id):
            same = post(http, "/v1/responses", by_conv, **{"X-Conversation-Id": header})
            assert same.status_code == 200, same.text
            assert same.headers["x-conversation-id"] == pinned_id
        chained = {"model": "alpha", "input": "/recall", "previous_response_id": same.json()["id"]}
        after = post(http, "/v1/responses", chained, **{"X-Conversation-Id": "pinhdr"})
        assert after.status_code == 200, after.text
        assert after.headers["x-conversation-id"] == pinned_id
        assert after.json()["output"][0]["content"][0]["text"] == "pinned | /recall | /recall"
        default = post(
            http,
            "/v1/responses",
            {"model": "alpha", "input": "d", "conversation": "default"},
            **{"X-Conversation-Id": "default"},
        )
        assert default.status_code == 200, default.text


# ---------------------------------------------------------------- 4. chat's legacy function_call without functions


def test_legacy_function_call_naming_a_function_needs_functions(env: Env) -> None:
    with env.http() as http:
        err = refused(
            post(http, "/v1/chat/completions", {**CHAT, "function_call": {"name": "nope"}}),
            "invalid_tool_choice",
            "function_call",
        )
        assert "'functions'" in err["message"], err
        for harmless in ("none", "auto"):
            ok = post(http, "/v1/chat/completions", {**CHAT, "function_call": harmless})
            assert ok.status_code == 200, ok.text
    with pytest.raises(openai.BadRequestError) as caught:
        env.client().chat.completions.create(
            model="alpha", messages=[{"role": "user", "content": "hi"}], function_call={"name": "nope"}
        )
    assert caught.value.code == "invalid_tool_choice"
