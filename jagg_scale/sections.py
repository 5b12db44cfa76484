"""What every section of the run configuration shares, at the bottom of the package so that a component can keep its
own section beside itself (torchtitan's pattern: `parallel/config.py` holds the engines' section).

    ConfigError      a bad configuration; the message names the dotted key
    Section          the base of a section dataclass: `check(prefix)` holds its own range checks
    require(ok, key, message)   ConfigError "config key '<key>' <message>" unless ok

train/config.py builds the sections from YAML (types, `Literal` choices) and runs the checks across sections.
"""

from __future__ import annotations

__all__ = ["ConfigError", "Section", "require"]


class ConfigError(ValueError):
    """A bad configuration; the message names the key."""


def require(ok: bool, key: str, message: str) -> None:
    if not ok:
        raise ConfigError(f"config key '{key}' {message}")


class Section:
    def check(self, prefix: str) -> None:
        """Range checks of this section; `prefix` is its dotted name ('model', 'model.lora', ...)."""
