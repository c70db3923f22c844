from tests.server.conftest import model_dirs  # noqa: F401  (a tiny local model folder, as `--model` takes it)
