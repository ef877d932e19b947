"""Validate bodies against ../shared/conformance (OpenAI's OpenAPI document, Open Responses)."""

from __future__ import annotations

import copy
import json
import re
from functools import cache
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
CONFORMANCE = ROOT.parent / "shared" / "conformance"


def require_conformance() -> Path:
    if not (CONFORMANCE / "openai-openapi.json").exists():
        pytest.skip(f"conformance data not found at {CONFORMANCE} (expected ../shared/conformance beside the repo)")
    return CONFORMANCE


def rewrite_nullable(node: Any) -> Any:
    """OpenAPI 3.0 `nullable: true` → JSON Schema `type: [T, "null"]` (and null in any enum)."""
    if isinstance(node, dict):
        out = {k: rewrite_nullable(v) for k, v in node.items()}
        if out.pop("nullable", False) is True:
            t = out.get("type")
            if isinstance(t, str):
                out["type"] = [t, "null"]
            elif isinstance(t, list) and "null" not in t:
                out["type"] = [*t, "null"]
            elif t is None:
                out = {"anyOf": [out, {"type": "null"}]}
            if isinstance(out.get("enum"), list) and None not in out["enum"]:
                out["enum"] = [*out["enum"], None]
        return out
    if isinstance(node, list):
        return [rewrite_nullable(v) for v in node]
    return node


@cache
def document(name: str) -> dict[str, Any]:
    return rewrite_nullable(json.loads((require_conformance() / name).read_text()))


@cache
def _validator(name: str, schema_name: str) -> Any:
    from jsonschema import Draft202012Validator
    from referencing import Registry, Resource
    from referencing.jsonschema import DRAFT202012

    doc = document(name)
    uri = f"urn:{name}"
    registry = Registry().with_resource(uri, Resource.from_contents(doc, default_specification=DRAFT202012))
    return Draft202012Validator({"$ref": f"{uri}#/components/schemas/{schema_name}"}, registry=registry)


def _event_schema(event_type: str) -> str | None:
    schemas = document("openai-openapi.json")["components"]["schemas"]
    for ref in schemas["ResponseStreamEvent"]["anyOf"]:
        name = ref["$ref"].rsplit("/", 1)[-1]
        if event_type in (schemas[name].get("properties", {}).get("type", {}).get("enum") or []):
            return name
    return None


def validate(schema_name: str, body: Any, doc: str = "openai-openapi.json") -> None:
    if schema_name == "ResponseStreamEvent" and isinstance(body, dict):
        specific = _event_schema(str(body.get("type")))
        assert specific is not None, f"unknown Responses event type {body.get('type')!r}"
        validate(specific, body)
    errors = sorted(
        _validator(doc, schema_name).iter_errors(copy.deepcopy(body)), key=lambda e: len(list(e.absolute_path))
    )
    if errors:
        best = errors[0]
        raise AssertionError(
            f"{schema_name} violation at {list(best.absolute_path)}: {best.message[:500]}\n"
            f"body: {json.dumps(body)[:1500]}"
        )


def sse_payloads(lines: list[str]) -> list[str]:
    return [line[len("data: ") :] for line in lines if line.startswith("data: ")]


def sse_lines(body: bytes) -> list[str]:
    """The lines of an SSE body as the SSE spec splits them: at CRLF, LF or CR only. (httpx's
    `iter_lines` follows str.splitlines and also breaks at U+0085, U+2028 and U+2029, which JSON
    data may carry unescaped.)"""
    return re.split(r"\r\n|\r|\n", body.decode("utf-8"))
