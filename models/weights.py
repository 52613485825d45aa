"""Finding and reading checkpoints: HF folders, the local hub cache (nothing downloads), and
GGUF files, dequantized once and cached as HF folders."""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import torch
from safetensors import safe_open
from safetensors.torch import load_file

log = logging.getLogger(__name__)


def default_cache_dir() -> Path:
    env = os.environ.get("TANDEM_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "tandem"


class Sliceable(Protocol):
    @property
    def shape(self) -> Sequence[int]: ...

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor: ...


class LazyTensor:
    """A safetensors tensor read only as far as narrowed, so no rank holds the whole file."""

    def __init__(self, handle: Any, name: str) -> None:
        self._handle = handle
        self._name = name
        self._slice = handle.get_slice(name)
        self.shape = torch.Size(self._slice.get_shape())
        self.dtype: str = self._slice.get_dtype()  # safetensors' name, e.g. "BF16"

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        index = (slice(None),) * dim + (slice(start, start + length),)
        out: torch.Tensor = self._slice[index]
        return out


class Rows:
    """Rows ``start .. start + length`` of a fused tensor (Phi-3's qkv_proj and gate_up_proj),
    read only as far as narrowed."""

    def __init__(self, whole: Sliceable, start: int, length: int) -> None:
        self._whole, self._start = whole, start
        self.shape = torch.Size([length, *whole.shape[1:]])

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        if dim == 0:
            return self._whole.narrow(0, self._start + start, length)
        return self._whole.narrow(0, self._start, self.shape[0]).narrow(dim, start, length)


def split_rows(whole: Sliceable, sizes: Sequence[int]) -> list[Sliceable]:
    """``whole`` [sum(sizes), ...] as consecutive row ranges."""
    if sum(sizes) != whole.shape[0]:
        raise ValueError(f"a fused tensor of {whole.shape[0]} rows does not split into {sizes}")
    out: list[Sliceable] = []
    at = 0
    for n in sizes:
        out.append(Rows(whole, at, n))
        at += n
    return out


INDEX = "model.safetensors.index.json"


def safetensors_files(folder: Path) -> list[Path]:
    index = folder / INDEX
    if not index.exists():
        return sorted(folder.glob("*.safetensors"))
    weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
    files = [folder / name for name in sorted(set(weight_map.values()))]
    missing = [f.name for f in files if not f.exists()]
    if missing:
        raise FileNotFoundError(f"{index} names shards that are not in {folder}: {missing}")
    return files


# safetensors' names of the dtypes a plain checkpoint stores its weights in
PLAIN_DTYPES = ("F64", "F32", "F16", "BF16")
_TORCH_NAMES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
}


def check_plain(name: str, dtype: str) -> None:
    """Raises ValueError for a quantized tensor (fp8, packed ints) in a checkpoint that declares
    no ``quantization_config``: copied into a float weight it would lose its scales silently."""
    if dtype not in PLAIN_DTYPES:
        raise ValueError(
            f"checkpoint tensor {name!r} is stored as {dtype}, but the checkpoint declares no "
            "quantization_config: quantized weights without their scheme are refused"
        )


def lazy_tensors(folder: Path) -> dict[str, LazyTensor]:
    """Every tensor of a folder's safetensors files, read only as far as narrowed."""
    out: dict[str, LazyTensor] = {}
    for f in safetensors_files(folder):
        handle = safe_open(str(f), framework="pt")
        for name in handle.keys():  # noqa: SIM118 - a safetensors handle, not a dict
            out[name] = LazyTensor(handle, name)
    return out


def open_checkpoint(folder: Path) -> dict[str, LazyTensor | torch.Tensor]:
    if not safetensors_files(folder):
        tensors = load_state_dict(folder)
        for name, t in tensors.items():
            check_plain(name, _TORCH_NAMES.get(t.dtype, str(t.dtype)))
        return dict(tensors)
    lazy = lazy_tensors(folder)
    for name, part in lazy.items():
        check_plain(name, part.dtype)
    return dict(lazy)


def whole(t: Sliceable) -> torch.Tensor:
    return t.narrow(0, 0, t.shape[0])


def load_state_dict(folder: Path) -> dict[str, torch.Tensor]:
    files = safetensors_files(folder)
    if files:
        out: dict[str, torch.Tensor] = {}
        for f in files:
            out.update(load_file(str(f)))
        return out
    bins = sorted(folder.glob("pytorch_model*.bin"))
    if not bins:
        raise FileNotFoundError(f"{folder} holds no *.safetensors or pytorch_model*.bin weights")
    out = {}
    for f in bins:
        out.update(torch.load(f, map_location="cpu", weights_only=True))
    return out


def _hub_cache_lookup(model_id: str) -> Path | None:
    try:
        from huggingface_hub import snapshot_download
    except ImportError:  # pragma: no cover - transformers depends on it
        return None
    try:
        return Path(snapshot_download(model_id, local_files_only=True))
    except Exception:
        return None


def convert_gguf(gguf: Path, cache_dir: Path) -> Path:
    """The cached fp32 HF folder of ``gguf``; concurrent callers serialize on a file lock, and
    the folder is renamed into place, so no reader sees half a checkpoint."""
    st = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()
    target = cache_dir / "gguf" / f"{gguf.stem}-{key[:12]}"
    if (target / "config.json").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (target / "config.json").exists():
            return target
        log.info("dequantizing %s into %s (once; later starts load the cache)", gguf, target)
        from transformers import AutoTokenizer, LlamaForCausalLM

        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = LlamaForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, dtype=torch.float32
        )
        setattr(model, "hf_quantizer", None)  # noqa: B010 - the weights are plain tensors now
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".tmp-"))
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        (tmp / "tandem_source.json").write_text(json.dumps({"gguf": str(gguf.resolve())}))
        if target.exists():
            shutil.rmtree(target)
        tmp.rename(target)
    return target


def resolve_checkpoint(spec: str, cache_dir: Path | None = None) -> Path:
    """``"embedded"``, an HF folder, a ``.gguf`` file or a locally cached HF id -> an HF folder."""
    cache = cache_dir or default_cache_dir()
    if spec == "embedded":
        from models.embedded import embedded_gguf_path

        return convert_gguf(embedded_gguf_path(), cache)
    path = Path(spec).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return convert_gguf(path, cache)
    if path.is_dir():
        if not (path / "config.json").exists():
            raise FileNotFoundError(f"model folder {path} has no config.json")
        return path
    found = _hub_cache_lookup(spec)
    if found is not None:
        return found
    raise FileNotFoundError(
        f"model {spec!r} is neither a local folder, a .gguf file, nor an HF id in the local hub "
        "cache; tandem never downloads weights at serve time (fetch it first with "
        "`huggingface-cli download`)"
    )
