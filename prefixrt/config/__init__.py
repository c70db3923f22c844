"""Configuration: the engine's settings declared once (engine_config.py, in sections, by settings.py's
`setting`), and the command-line flags generated from them (flags.py). This package re-exports nothing."""
