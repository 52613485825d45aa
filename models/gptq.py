"""GPTQ and AWQ int4 checkpoints (``quant_method: gptq`` / ``awq``, AutoGPTQ's and AutoAWQ's
layouts), dequantized as read like the other pre-quantized formats; weight-only, so no input
quantization. GPTQ packs eight 4-bit rows of ``qweight`` [in / 8, out] per int32 (its zero
points one less than stored in the v1 format); AWQ packs eight columns of [in, out / 8]
interleaved (``AWQ_PACK``)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from models.prequantized import PrequantizedCheckpoint, whole_tensor
from models.weights import Sliceable, lazy_tensors

# AutoAWQ packs column AWQ_PACK[i] of each eight into nibble i; column j is in nibble AWQ_READ[j]
AWQ_PACK = (0, 2, 4, 6, 1, 3, 5, 7)
AWQ_READ = (0, 4, 1, 5, 2, 6, 3, 7)
PARTS = ("qweight", "qzeros", "scales", "g_idx", "bias")


def check_config(qcfg: dict[str, Any]) -> None:
    method = qcfg["quant_method"]
    bits = int(qcfg.get("bits", qcfg.get("w_bit", 4)))
    if bits != 4:
        raise ValueError(f"unsupported quantization_config.bits {bits} for {method}: 4 only")
    if method == "awq":
        version = str(qcfg.get("version", "gemm")).lower()
        if version != "gemm":
            raise ValueError(f"unsupported quantization_config.version {version!r}: AWQ gemm only")
        if not qcfg.get("zero_point", True):
            raise ValueError("unsupported quantization_config.zero_point false for awq")
        return
    fmt = qcfg.get("checkpoint_format", "gptq")
    if fmt not in ("gptq", "gptq_v2"):
        raise ValueError(f"unsupported quantization_config.checkpoint_format {fmt!r}")


def unpack_rows(packed: torch.Tensor) -> torch.Tensor:
    """[n / 8, m] int32 -> [n, m]: row 8i + k is nibble k (low bits first)."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32).view(1, 8, 1)
    nibbles = (packed.unsqueeze(1) >> shifts) & 0xF  # [n / 8, 8, m]
    return nibbles.reshape(-1, packed.shape[1])


def unpack_columns(packed: torch.Tensor, order: tuple[int, ...] | None) -> torch.Tensor:
    """[n, m / 8] int32 -> [n, m]: column 8i + j is nibble ``order[j]`` (else j)."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32).view(1, 1, 8)
    nibbles = (packed.unsqueeze(2) >> shifts) & 0xF  # [n, m / 8, 8]
    if order is not None:
        nibbles = nibbles[:, :, list(order)]
    return nibbles.reshape(packed.shape[0], -1)


class GptqCheckpoint(PrequantizedCheckpoint):
    def __init__(self, folder: Path, qcfg: dict[str, Any]) -> None:
        check_config(qcfg)
        self.awq = qcfg["quant_method"] == "awq"
        self.v1 = not self.awq and qcfg.get("checkpoint_format", "gptq") == "gptq"
        self.group = int(qcfg.get("group_size", qcfg.get("q_group_size", 128)))
        self._raw = lazy_tensors(folder)
        self.quantized = frozenset(
            n.removesuffix(".qweight") for n in self._raw if n.endswith(".qweight")
        )

    def _part(self, name: str) -> bool:
        module, _, leaf = name.rpartition(".")
        return module in self.quantized and leaf in PARTS[:4]

    def __getitem__(self, name: str) -> Sliceable:
        module = name.removesuffix(".weight")
        if name.endswith(".weight") and module in self.quantized:
            return self._dequantized(module)
        if self._part(name):
            raise KeyError(name)
        return self._raw[name]

    def __iter__(self) -> Iterator[str]:
        dense = (n for n in self._raw if not self._part(n))
        return iter(sorted([*dense, *(m + ".weight" for m in self.quantized)]))

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def _dequantized(self, module: str) -> torch.Tensor:
        """[out, in] float32: (q - zero) * scale per group of input features."""

        def read(leaf: str) -> torch.Tensor:
            return whole_tensor(self._raw[f"{module}.{leaf}"])

        scales = read("scales").float()  # [in / g, out]
        if self.awq:
            q = unpack_columns(read("qweight"), AWQ_READ)  # [in, out]
            zeros = unpack_columns(read("qzeros"), AWQ_READ)  # [in / g, out]
            groups = torch.arange(q.shape[0]) // self.group
        else:
            q = unpack_rows(read("qweight"))  # [in, out]
            zeros = unpack_columns(read("qzeros"), None) + (1 if self.v1 else 0)
            name = f"{module}.g_idx"
            given = whole_tensor(self._raw[name]).long() if name in self._raw else None
            groups = torch.arange(q.shape[0]) // self.group if given is None else given
        w = (q - zeros[groups]).float() * scales[groups]  # [in, out]
        return w.t().contiguous()

    def quantizes_input(self, module: str) -> bool:
        return False

    def input_quant(self, layer_prefix: str, matmul: str) -> None:
        return None
