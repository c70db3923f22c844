"""Configuration: the engine's settings declared once (engine_config.py, in sections, by settings.py's
`setting`), and the command-line flags generated from them (flags.py). `EngineConfig` is re-exported here, where
it lived before the package was split (`from prefixrt.config import EngineConfig` keeps working)."""

from prefixrt.config.engine_config import EngineConfig

__all__ = ["EngineConfig"]
