"""The default models: their names are written once (prefixrt/default_models.py), and both are embedded catalogue
entries."""

from __future__ import annotations

import ast
from pathlib import Path

from prefixrt.default_models import BASE_MODEL, CHAT_MODEL
from prefixrt.hub.catalogue import ENTRIES

REPO = Path(__file__).resolve().parents[1]
HOME = REPO / "prefixrt" / "default_models.py"


def test_defaults_are_embedded_catalogue_entries():
    for name in (BASE_MODEL, CHAT_MODEL):
        assert name in ENTRIES and ENTRIES[name].kind == "embedded", name


def test_names_are_written_only_in_their_home():
    """No string constant in the package's code equals a default model's name outside default_models.py (text
    that mentions one, such as a docstring, is not a constant equal to it)."""
    written = []
    for folder in ("prefixrt", "adapters", "kernels"):
        for path in sorted((REPO / folder).rglob("*.py")):
            if path == HOME:
                continue
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Constant) and node.value in (BASE_MODEL, CHAT_MODEL):
                    written.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert not written, f"use prefixrt.default_models' constants: {written}"
