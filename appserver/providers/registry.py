"""Model strings (`echo`, `PROVIDER:MODEL`) to provider instances, one instance per configured provider."""

from __future__ import annotations

from collections.abc import Iterable

from appserver.config import Config
from appserver.providers.base import Provider
from appserver.providers.echo import EchoProvider


class ModelStringError(ValueError):
    pass


def parse_model(model: str, config: Config) -> tuple[str, str]:
    """Split and validate a model string: returns (provider name, model name)."""
    model = (model or "").strip()
    if model == "echo":
        return "echo", "echo"
    if ":" not in model:
        raise ModelStringError(
            f"invalid model {model!r}: use 'echo' or PROVIDER:MODEL (providers: {', '.join(sorted(config.providers))})"
        )
    provider, name = model.split(":", 1)
    if provider == "echo":
        return "echo", name or "echo"
    if not provider or not name or any(c.isspace() for c in model):
        raise ModelStringError(f"invalid model {model!r}: use PROVIDER:MODEL, e.g. openai:gpt-4o-mini")
    if provider not in config.providers:
        raise ModelStringError(
            f"unknown provider {provider!r} in model {model!r} "
            f"(configured: echo, {', '.join(sorted(config.providers))})"
        )
    return provider, name


class ProviderRegistry:
    """Owns provider instances (and their HTTP connection pools) for one Server."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self._instances: dict[str, Provider] = {"echo": EchoProvider()}

    def resolve(self, model: str) -> tuple[Provider, str]:
        provider_name, model_name = parse_model(model, self.config)
        inst = self._instances.get(provider_name)
        if inst is None:
            inst = self._create(provider_name)
            self._instances[provider_name] = inst
        return inst, model_name

    def warm(self, models: Iterable[str]) -> None:
        """Create the providers these model strings name now (their modules imported, HTTP stack
        included): a server's first model call then pays no imports, and what a server holds after
        its first requests is not mostly modules it loaded late. A model string that does not
        resolve is left to the request that uses it, which reports it."""
        for model in models:
            try:
                self.resolve(model)
            except Exception:  # reported by the request that uses it
                continue

    def _create(self, name: str) -> Provider:
        cfg = self.config.providers[name]
        if cfg.kind == "anthropic":
            from appserver.providers.anthropic import AnthropicProvider

            return AnthropicProvider(cfg)
        from appserver.providers.openai_compat import OpenAICompatProvider

        return OpenAICompatProvider(cfg)

    async def aclose(self) -> None:
        for inst in self._instances.values():
            await inst.aclose()
