"""What every section of the run configuration shares, at the bottom of the package so that a component can keep its
own section beside itself (torchtitan's pattern: `parallel/config.py` holds the engines' section).

    ConfigError      a bad configuration; the message names the dotted key
    Section          the base of a section dataclass: `check(prefix)` holds its own range checks
    require(ok, key, message)   ConfigError "config key '<key>' <message>" unless ok
    refuse_set(section, prefix, names, why)   a choice owns its keys: ConfigError for a key set that `why` leaves idle

train/config.py builds the sections from YAML (types, `Literal` choices) and runs the checks across sections.
"""

from __future__ import annotations

__all__ = ["ConfigError", "Section", "refuse_set", "require"]


class ConfigError(ValueError):
    """A bad configuration; the message names the key."""


def require(ok: bool, key: str, message: str) -> None:
    if not ok:
        raise ConfigError(f"config key '{key}' {message}")


class Section:
    def check(self, prefix: str) -> None:
        """Range checks of this section; `prefix` is its dotted name ('model', 'model.lora', ...)."""

    def is_set(self, name: str) -> bool:
        """Whether field `name` holds a value other than its default (`key=null` in a config puts it back). A key
        given at its default changes nothing, so it counts as unset: a saved config.yaml names every key."""
        return getattr(self, name) != getattr(type(self)(), name)


def refuse_set(section: Section, prefix: str, names, why: str) -> None:
    """A choice owns its keys: the first of `names` set in `section` (`prefix` its dotted name) is refused, `why`
    saying which choice leaves it without effect, so no key is accepted that does nothing."""
    for name in names:
        if section.is_set(name):
            raise ConfigError(f"config key '{prefix}.{name}' is set, but {why}: unset it ({prefix}.{name}=null)")
