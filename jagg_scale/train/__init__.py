"""Config, trainer loop and logging."""

from .config import Config, ConfigError, load_config
from .trainer import Trainer, summarize

__all__ = ["Config", "ConfigError", "load_config", "Trainer", "summarize"]
