"""Test helpers, imported as the package `tests.helpers` (pytest puts the repository root on sys.path because
tests/ is a package; nothing inserts paths by hand).

- checkpoints.py: tiny random transformers checkpoints for every architecture (the oracle models)
- harness.py: PagedHarness, a model over a real KV pool without the engine
- engines.py: the tiny byte-level tokenizer, assert_idle_and_clean (the teardown accounting check)
- gemma_oracle.py: transformers' greedy continuations of the embedded Gemma-3-270M
- live_server.py: LiveServer, uvicorn on a free port in a thread
- fake_openai.py: scripted OpenAI-compatible endpoints for the frontend's OpenAI backend
"""
