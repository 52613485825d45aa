"""A checkpoint folder's tensors as the loader reads them: plain ones lazily, pre-quantized ones
(picked by ``quantization_config``) dequantized as read, and a multimodal Gemma 3's language
model under a causal LM's names."""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from models.block_fp8 import BlockFp8Checkpoint
from models.compressed import CompressedCheckpoint
from models.gptq import GptqCheckpoint
from models.prequantized import PrequantizedCheckpoint
from models.weights import Sliceable, open_checkpoint


def open_weights(folder: Path) -> Mapping[str, Sliceable]:
    """A checkpoint's tensors by dense name: pre-quantized ones dequantized as read."""
    cfg = json.loads((folder / "config.json").read_text())
    if cfg.get("model_type") == "gemma3":  # a multimodal folder: its language model alone
        inner = _open(folder, cfg.get("quantization_config"))
        if isinstance(inner, PrequantizedCheckpoint) and any(
            inner.quantizes_input(m) for m in inner.quantized
        ):
            raise ValueError("activation-quantized multimodal Gemma 3 folders are not implemented")
        return TextOnly(inner)
    return _open(folder, cfg.get("quantization_config"))


def _open(folder: Path, qcfg: dict[str, Any] | None) -> Mapping[str, Sliceable]:
    if qcfg is None:
        return open_checkpoint(folder)
    if qcfg.get("quant_method") == "fp8":
        return BlockFp8Checkpoint(folder, qcfg)
    if qcfg.get("quant_method") in ("gptq", "awq"):
        return GptqCheckpoint(folder, qcfg)
    return CompressedCheckpoint(folder, qcfg)


class TextOnly(Mapping[str, Sliceable]):
    """A multimodal checkpoint's language model under a causal LM's names (``model.*``,
    ``lm_head.*``), whichever of the two layouts transformers has saved it in."""

    def __init__(self, weights: Mapping[str, Sliceable]) -> None:
        self.weights = weights

    def _stored(self, name: str) -> str | None:
        inner = name.removeprefix("model.")
        for candidate in (f"language_model.{name}", f"model.language_model.{inner}"):
            if candidate in self.weights:
                return candidate
        return None

    def __getitem__(self, name: str) -> Sliceable:
        stored = self._stored(name)
        if stored is None:
            raise KeyError(name)
        return self.weights[stored]

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and self._stored(name) is not None

    def __iter__(self) -> Iterator[str]:
        for n in self.weights:
            if n.startswith("language_model."):
                yield n.removeprefix("language_model.")
            elif n.startswith("model.language_model."):
                yield "model." + n.removeprefix("model.language_model.")

    def __len__(self) -> int:
        return sum(1 for _ in self)
