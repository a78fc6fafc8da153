"""Errors keelrl raises on bad input, each naming the bad field or value."""

from __future__ import annotations


class ConfigError(ValueError):
    """A bad configuration value, raised before any work starts.

    `field` is the dotted path of the offending field (``algo.eps_high``); nested configs
    prepend their own name as the error travels up, so the user sees the full path.
    """

    def __init__(self, field: str, message: str) -> None:
        self.field = field
        self.message = message
        super().__init__(f"{field}: {message}" if field else message)

    def with_prefix(self, prefix: str) -> "ConfigError":
        return ConfigError(f"{prefix}.{self.field}" if self.field else prefix, self.message)
