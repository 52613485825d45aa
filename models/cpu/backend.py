"""The CPU wing's one entry point, ``CpuBackend.apply``: packed matmuls, the greedy screen, the
layer program and in-place attention, each falling back where this CPU lacks it (``describe``)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn

from models.attention.backend import AttentionBackend
from models.attention.metadata import StepMetadata
from models.backend import ModelBackend
from models.cpu.attention import CpuAttentionBackend
from models.cpu.greedy_head import GreedyHead
from models.cpu.linear import CpuPacker, PanelUse, PanelWeight
from models.cpu.program import LayerProgram
from models.cpu.row_ops import CpuRowOps
from models.eagle import EagleHead
from models.llama import LlamaModel
from models.parallel import ServedLinear, VocabParallelEmbedding
from models.quant import QuantizedWeight


def pack_linear(packer: CpuPacker, m: ServedLinear) -> bool:
    """False where this CPU has no path for a plain weight's dtype."""
    if isinstance(m.kernel, QuantizedWeight):
        packed_q = packer.pack_quantized(m.kernel)
        if packed_q is not None:
            m.serve(packed_q)
        return True
    if m.kernel is not None:
        return True
    packed = packer.pack(m.weight.data)
    if packed is None:
        return False
    m.serve(packed)
    return True


def pack_logits(packer: CpuPacker, head: VocabParallelEmbedding) -> bool:
    if isinstance(head.kernel, QuantizedWeight):
        packed_q = packer.pack_quantized(head.kernel)
        if packed_q is not None:
            head.serve_logits(packed_q)
        return True
    packed = packer.pack(head.weight.data)
    if packed is None:
        return False
    head.serve_logits(packed)
    return True


def pack_module(packer: CpuPacker, module: nn.Module) -> bool:
    done = [pack_linear(packer, m) for m in module.modules() if isinstance(m, ServedLinear)]
    return all(done)


def pack_eagle_head(head: EagleHead) -> bool:
    """After loading and quantizing (the head can then no longer be saved)."""
    if head.device.type != "cpu":
        return False
    packer = CpuPacker()
    layer = pack_module(packer, head.layer)
    if isinstance(head.fc_kernel, QuantizedWeight) and isinstance(
        head.head_kernel, QuantizedWeight
    ):
        fc_q = packer.pack_quantized(head.fc_kernel)
        head_q = packer.pack_quantized(head.head_kernel)
        head.fc_kernel = fc_q or head.fc_kernel
        head.head_kernel = head_q or head.head_kernel
        return layer
    head.fc_kernel = packer.pack(head.fc.weight.data)
    head.head_kernel = packer.pack(head.lm_head.weight.data)
    return layer and head.fc_kernel is not None and head.head_kernel is not None


class CpuBackend(ModelBackend):
    """``packed``: every matmul found a packed path."""

    def __init__(
        self,
        model: LlamaModel,
        attention: AttentionBackend,
        packer: CpuPacker,
        packed: bool,
        screen: GreedyHead | None,
        program: LayerProgram | None,
    ) -> None:
        super().__init__(model, attention)
        self.packer = packer
        self.packed = packed
        self.screen = screen
        self.program = program

    @classmethod
    def apply(
        cls, model: LlamaModel, attention: AttentionBackend, use: PanelUse | None = None
    ) -> CpuBackend:
        """``use``: when matmuls take the panel kernel (default ``$TANDEM_CPU_PANEL``)."""
        packer = CpuPacker() if use is None else CpuPacker(use=use)
        layers = pack_module(packer, model)
        head = pack_logits(packer, model.lm_head)
        screen = None
        if isinstance(model.lm_head.kernel, PanelWeight) and model.tp.world_size == 1:
            screen = GreedyHead.build(model.lm_head.weight.data, model.lm_head.kernel)
        if isinstance(model.norm.ops, CpuRowOps):
            model.norm.ops.ready()
        kernel = attention.kernel if isinstance(attention, CpuAttentionBackend) else None
        if kernel is not None:
            kernel.ready()
        program = LayerProgram.build(model, kernel, packer.kernel)  # last: it keeps pointers
        return cls(model, attention, packer, layers and head, screen, program)

    @torch.inference_mode()
    def forward(
        self, input_ids: torch.Tensor, kv_pool: torch.Tensor, meta: StepMetadata
    ) -> tuple[torch.Tensor, torch.Tensor]:
        model, program = self.model, self.program
        if program is None or model.feature_layers:
            return model.forward_with_features(input_ids, kv_pool, meta)
        x = model.embed(input_ids)
        if program.run(x, kv_pool, meta):
            out: torch.Tensor = model.norm(x)
            return out, out
        return model.run_layers(x, kv_pool, meta)

    @torch.inference_mode()
    def head(
        self, hidden: torch.Tensor, argmax_only: Sequence[bool]
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Argmax-only rows go through the screen when it takes them; their logits read NaN."""
        screen, model = self.screen, self.model
        n = hidden.shape[0]
        if screen is None or not any(argmax_only) or not screen.takes(sum(argmax_only)):
            return model.logits(hidden), None
        only = torch.tensor(list(argmax_only), dtype=torch.bool)
        tokens = torch.empty(n, dtype=torch.long)
        tokens[only] = screen.argmax(hidden[only])
        vocab = model.cfg.vocab_size
        if bool(only.all()):
            return torch.full((1, vocab), math.nan).expand(n, -1), tokens
        full = (~only).nonzero().flatten()
        logits = torch.full((n, vocab), math.nan)
        logits[full] = model.logits(hidden[full])
        tokens[full] = logits[full].argmax(dim=-1)
        return logits, tokens

    def layers_path(self) -> str:
        if self.program is not None and not self.model.feature_layers:
            return "program"
        kernel = self.attention.kernel if isinstance(self.attention, CpuAttentionBackend) else None
        why = LayerProgram.why_not(self.model, kernel, packed=True)
        return f"modules ({why or 'the program could not be built'})"

    def matmul_path(self) -> str:
        screen = self.screen
        if screen is None:
            return self.packer.describe()
        return (
            f"{self.packer.describe()}; greedy rows' argmax by a bf16 screen "
            f"({screen.screened} rows, {screen.fallbacks} fell back)"
        )

    def describe(self) -> dict[str, str | int]:
        return {
            "attention": self.attention.describe(),
            "attention_fallbacks": self.attention.fallbacks,
            "matmul": self.matmul_path(),
            "layers": self.layers_path(),
        }
