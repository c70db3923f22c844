from tests.server.conftest import engine  # noqa: F401  (the tiny llama engine whose template and tokenizer test_cache_lowering.py uses)
