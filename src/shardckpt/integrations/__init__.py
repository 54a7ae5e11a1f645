"""Optional integrations with training frameworks.

Each submodule imports its framework when it is imported itself, never
before: ``import shardckpt`` (and ``import shardckpt.integrations``) import
no framework. ``shardckpt.integrations.hf`` (Hugging Face ``Trainer``,
``accelerate`` loops, torchdata's ``StatefulDataLoader``; ``pip install
"shardckpt[hf]"``), ``shardckpt.integrations.lightning`` (``pip install "shardckpt[lightning]"``) and
``shardckpt.integrations.torchtitan`` (``pip install "shardckpt[torchtitan]"``) are the ones there are.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any


def __getattr__(name: str) -> Any:
    # A submodule on first access (``shardckpt.integrations.hf``), so that
    # importing this package imports none of the frameworks.
    if not name.startswith("_") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'shardckpt.integrations' has no attribute {name!r}")
