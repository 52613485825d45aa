"""What a worker loads: the target model and, optionally, what drafts for it."""

from __future__ import annotations

import enum
import hashlib
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from models.checkpoint import open_weights
from models.config import DTYPES, LlamaConfig
from models.host_memory import large_blocks_mapped
from models.layers import RowOps
from models.llama import LlamaModel
from models.parallel import TPContext
from models.prequantized import PrequantizedCheckpoint
from models.quant import Quant, check_supported
from models.weights import safetensors_files

log = logging.getLogger(__name__)


class DraftKind(enum.Enum):
    NONE = "none"
    NGRAM = "ngram"
    DRAFT_MODEL = "draft_model"
    EAGLE = "eagle"


def served_dtype(requested: str, folder: Path, device: str) -> str:
    """``requested``, or for ``auto``: float32 on a CPU, else the checkpoint's dtype."""
    if requested != "auto":
        return requested
    if not device.startswith("cuda"):
        return "float32"
    cfg = json.loads((folder / "config.json").read_text())
    named = cfg.get("torch_dtype") or cfg.get("dtype")
    return str(named) if named in DTYPES else "bfloat16"


@dataclass(frozen=True)
class ModelSpec:
    folder: str
    dtype: str = "float32"
    quantization: str = "none"

    def __post_init__(self) -> None:
        Quant(self.quantization)

    @property
    def quant(self) -> Quant:
        return Quant(self.quantization)

    def fingerprint(self) -> str:
        """Identifies the weights as served, quantization included (it changes KV and tokens)."""
        folder = Path(self.folder)
        h = hashlib.sha256((folder / "config.json").read_bytes())
        for f in sorted(folder.glob("*.safetensors")) + sorted(folder.glob("*.bin")):
            h.update(f"{f.name}:{f.stat().st_size}".encode())
        if self.quant is not Quant.NONE:
            h.update(f"quantization:{self.quantization}".encode())
        return h.hexdigest()[:16]

    def config(self) -> LlamaConfig:
        return LlamaConfig.from_folder(Path(self.folder))

    def load(
        self,
        device: torch.device | str = "cpu",
        tp: TPContext | None = None,
        ops: RowOps | None = None,
    ) -> LlamaModel:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype {self.dtype!r} is not one of {sorted(DTYPES)}")
        check_supported(self.quant, device)
        t0 = time.perf_counter()
        folder = Path(self.folder)
        shards = len(safetensors_files(folder)) or len(list(folder.glob("pytorch_model*.bin")))
        rank = "" if tp is None or tp.world_size == 1 else f" (TP rank {tp.rank}/{tp.world_size})"
        log.info(
            "loading %s%s: %d weight files, %s, quantization %s, on %s",
            folder.name,
            rank,
            shards,
            self.dtype,
            self.quantization,
            device,
        )
        with large_blocks_mapped():  # what a layer-by-layer quantization frees is returned
            dtype = DTYPES[self.dtype]
            model = LlamaModel(self.config(), tp=tp, dtype=dtype, device=device, ops=ops)
            weights = open_weights(folder)
            quant = self.quant
            if isinstance(weights, PrequantizedCheckpoint):
                if quant is not Quant.NONE:
                    raise ValueError(
                        f"quantization={self.quantization} with a pre-quantized checkpoint: "
                        "serve it as stored (quantization: none)"
                    )
                quant = served_kernel(weights, device)
            model.load_weights(weights, quant=quant, progress=_progress)
        log.info("loaded %s%s in %.1f s", folder.name, rank, time.perf_counter() - t0)
        return model.eval()


def served_kernel(weights: PrequantizedCheckpoint, device: torch.device | str) -> Quant:
    """On a GPU that has the kernel, the format's own kind; else NONE (dequantized, exact)."""
    kind = weights.kernel_quant()
    if kind is Quant.NONE or torch.device(device).type != "cuda":
        return Quant.NONE
    try:
        check_supported(kind, device)
    except ValueError:  # fp8 below compute capability 8.9: dequantized
        return Quant.NONE
    log.info("serving the checkpoint's %s weights in tandem's %s kernels", kind.value, kind.value)
    return kind


def _progress(done: int, total: int) -> None:
    """A line at every tenth of the layers (and the last)."""
    if done == total or done * 10 // total != (done - 1) * 10 // total:
        log.info("loaded %d/%d layers", done, total)


@dataclass(frozen=True)
class DraftSpec:
    kind: DraftKind = DraftKind.NONE
    model: ModelSpec | None = None
    num_speculative_tokens: int = 4  # k: draft tokens verified per step (the most, if adaptive)
    adaptive: bool = True  # choose k per request per step for goodput; False pins k
    ngram_max: int = 4
    ngram_min: int = 1
    lookup_first: bool = False  # n-gram lookup proposes where it matches, the model elsewhere
    tree_width: int = 1  # > 1 (eagle): greedy requests verify draft trees this wide per depth
    early_stop: bool = False  # eagle chains stop per position on the head's confidence

    def __post_init__(self) -> None:
        needs_model = self.kind in (DraftKind.DRAFT_MODEL, DraftKind.EAGLE)
        if needs_model != (self.model is not None):
            raise ValueError("a draft checkpoint is required exactly for draft_model and eagle")
        if self.lookup_first and not needs_model:
            raise ValueError("lookup_first puts n-gram lookup before a draft model or EAGLE head")
        if self.tree_width < 1 or (self.tree_width > 1 and self.kind is not DraftKind.EAGLE):
            raise ValueError("tree_width is at least 1, and above 1 only for an EAGLE head")
        if self.early_stop and (self.kind is not DraftKind.EAGLE or not self.adaptive):
            raise ValueError("early_stop stops an adaptive EAGLE head's chains on its confidence")

    def identity(self) -> str:
        """What both pools must agree on about the draft (part of the KV compatibility hash)."""
        ident: dict[str, object] = {"kind": self.kind.value}
        if self.model is not None:
            ident.update(fingerprint=self.model.fingerprint(), dtype=self.model.dtype)
        return json.dumps(ident, sort_keys=True)
