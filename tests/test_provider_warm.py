"""`ProviderRegistry.warm`: a serving server creates its agents' providers at start, so the first
model call pays no imports; a model string that does not resolve is left to the request."""

from __future__ import annotations

from pathlib import Path

from appserver.config import load_config
from appserver.providers.openai_compat import OpenAICompatProvider
from appserver.providers.registry import ProviderRegistry


def test_warm_creates_the_named_providers_and_skips_bad_strings(tmp_path: Path) -> None:
    config = load_config(tmp_path / "home", environ={"APPSERVER_PROVIDERS__LOCAL__BASE_URL": "http://127.0.0.1:9/v1"})
    registry = ProviderRegistry(config)
    registry.warm(["echo", "no colon", "unknown:model", "local:llama", "openai:gpt-4o-mini"])
    assert isinstance(registry._instances["local"], OpenAICompatProvider)
    assert isinstance(registry._instances["openai"], OpenAICompatProvider)
    assert set(registry._instances) == {"echo", "local", "openai"}
    provider, name = registry.resolve("local:llama")
    assert provider is registry._instances["local"] and name == "llama"  # the warmed instance is the one used
