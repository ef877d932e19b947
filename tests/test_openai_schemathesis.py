"""Check 10: schemathesis (positive mode, fixed seed, ~25 examples per operation) over
listModels, createChatCompletion and createResponse: no 5xx and no schema violation.

Requests are generated from OpenAI's own schema; `model` is pointed at the real agent so the
calls reach the kernel, and `stream` is forced off (streams are validated chunk by chunk in
test_openai_http.py). Everything else is as generated.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest

from tests.conftest import ServeProcess, cli_env, run_cli, start_serve
from tests.openai_schema import document, require_conformance, validate

schemathesis = pytest.importorskip("schemathesis")

OPERATIONS = {("GET", "/models"): "listModels", ("POST", "/chat/completions"): "createChatCompletion", ("POST", "/responses"): "createResponse"}
RESPONSE_SCHEMA = {"listModels": "ListModelsResponse", "createChatCompletion": "CreateChatCompletionResponse", "createResponse": "Response"}


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    require_conformance()
    home = tmp_path_factory.mktemp("schemathesis") / "home"
    env = cli_env(home, APPSERVER_LIMITS__QUEUE_MAX="1000")
    assert run_cli(home, "agents", "list", env=env).code == 0
    sp = start_serve(home, env=env)
    try:
        yield sp
    finally:
        sp.stop()


@pytest.mark.timeout(120)
def test_schemathesis_positive(srv: ServeProcess) -> None:
    from hypothesis import HealthCheck, Phase, given, seed, settings

    raw = document("openai-openapi.json")
    paths = {p: {m: op for m, op in item.items() if (m.upper(), p) in OPERATIONS} for p, item in raw["paths"].items()}
    spec = dict(raw, paths={p: ops for p, ops in paths.items() if ops}, servers=[{"url": srv.url + "/v1"}])
    schema = schemathesis.openapi.from_dict(spec)
    failures: list[str] = []
    counts: dict[str, int] = {}
    statuses: dict[str, int] = {}
    with httpx.Client(base_url=srv.url + "/v1", timeout=30) as client:

        def make(op_id: str):  # type: ignore[no-untyped-def]
            operation = schema.find_operation_by_id(op_id)

            @seed(20260830)
            @settings(max_examples=25, deadline=None, database=None, phases=[Phase.generate], suppress_health_check=list(HealthCheck))
            @given(case=operation.as_strategy())
            def run(case):  # type: ignore[no-untyped-def]
                body = case.body if isinstance(case.body, dict) else None
                if body is not None and op_id != "listModels":
                    body["model"] = "assistant"
                    body["stream"] = False
                    body.pop("background", None)
                method = case.method.upper()
                r = client.request(method, case.formatted_path if hasattr(case, "formatted_path") else case.path, json=body)
                counts[op_id] = counts.get(op_id, 0) + 1
                statuses[f"{op_id}:{r.status_code}"] = statuses.get(f"{op_id}:{r.status_code}", 0) + 1
                if r.status_code >= 500:
                    failures.append(f"{op_id}: {r.status_code} {r.text[:300]} for {json.dumps(body)[:500]}")
                    return
                try:
                    payload = r.json()
                except ValueError:
                    failures.append(f"{op_id}: non-JSON {r.status_code}")
                    return
                try:
                    validate(RESPONSE_SCHEMA[op_id] if r.status_code == 200 else "ErrorResponse", payload)
                except AssertionError as exc:
                    failures.append(f"{op_id}: {exc}")

            return run

        for op_id in OPERATIONS.values():
            make(op_id)()
    print("schemathesis statuses:", statuses)
    assert not failures, "\n".join(failures[:5])
    assert all(counts.get(op, 0) >= 10 for op in OPERATIONS.values()), counts
