"""A mixture-of-experts MLP block (Qwen3-MoE, Qwen2-MoE's shared expert, Mixtral, gpt-oss's
biases and clamped SwiGLU): a replicated router picks each token's top-k experts; each expert is
an MLP split by TP like a dense one (columns of gate/up, rows of down), so a rank sums its partial
outputs over every expert and reduces once. On a GPU the experts are stacked and run as two
grouped matmuls (``torch._grouped_mm``) with no host sync, so a step captures in a CUDA graph;
elsewhere (and quantized) each expert runs over its tokens."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from models.layers import RowOps
from models.moe_config import MoEConfig
from models.parallel import ColumnParallelLinear, RowParallelLinear, ServedLinear, TPContext
from models.quant import Quant
from models.weights import Sliceable, whole


class Router(ServedLinear):
    """[E, H] on every rank, served like any matmul (a CPU's packed kernel is the same for one
    row as for many, which keeps verification bit-identical to decoding); never quantized, as
    vLLM keeps it."""

    def __init__(
        self,
        hidden: int,
        experts: int,
        dtype: torch.dtype,
        device: torch.device,
        bias: bool = False,
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(
            torch.empty(experts, hidden, dtype=dtype, device=device), requires_grad=False
        )
        self.bias: nn.Parameter | None = (
            nn.Parameter(torch.empty(experts, dtype=dtype, device=device), requires_grad=False)
            if bias
            else None
        )

    def quantize(self, kind: Quant, group: Any = None) -> None:
        return None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, self.bias)  # [T, H] -> [T, E]


class Expert(nn.Module):
    def __init__(
        self,
        hidden: int,
        inter: int,
        tp: TPContext,
        dtype: torch.dtype,
        device: torch.device,
        bias: bool = False,
    ) -> None:
        super().__init__()
        self.local_inter = tp.shard(inter, "moe_intermediate_size")
        self.gate_up_proj = ColumnParallelLinear(
            hidden, [inter, inter], tp, dtype, device, bias=bias
        )
        # its bias, if any, is added after the block's reduction (SparseMoE.down_bias)
        self.down_proj = RowParallelLinear(inter, hidden, tp, dtype, device)


class SparseMoE(nn.Module):
    def __init__(
        self,
        hidden: int,
        moe: MoEConfig,
        tp: TPContext,
        dtype: torch.dtype,
        device: torch.device,
        ops: RowOps | None = None,
    ) -> None:
        super().__init__()
        self.moe, self.tp = moe, tp
        self.ops = ops or RowOps()
        self.gate = Router(hidden, moe.num_experts, dtype, device, bias=moe.biases)
        inter = moe.expert_intermediate_size
        self.experts = nn.ModuleList(
            Expert(hidden, inter, tp, dtype, device, moe.biases) for _ in range(moe.num_experts)
        )
        # [E, H] each expert's down-projection bias (gpt-oss), weighted after the reduction
        self.down_bias: torch.Tensor | None = (
            torch.zeros(moe.num_experts, hidden, dtype=dtype, device=device) if moe.biases else None
        )
        self.local_inter = tp.shard(inter, "moe_intermediate_size")
        self.shared_expert: Expert | None = None
        self.shared_expert_gate: Router | None = None
        if moe.shared_intermediate_size is not None:
            self.shared_expert = Expert(hidden, moe.shared_intermediate_size, tp, dtype, device)
            self.shared_expert_gate = Router(hidden, 1, dtype, device)
        # stack_experts(): [E, 2 * I_local, H] and [E, H, I_local], the experts' weights moved in
        self.gate_up: torch.Tensor | None = None
        self.down: torch.Tensor | None = None
        self.gate_up_bias: torch.Tensor | None = None  # [E, 2 * I_local]

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [T, H] -> each token's top-k expert weights [T, k] (x's dtype) and ids [T, k]."""
        logits = self.gate(x)  # [T, E]
        if self.moe.softmax_after_top_k:
            top, ids = torch.topk(logits, self.moe.top_k, dim=-1)
            return torch.softmax(top, dim=-1), ids
        probs = torch.softmax(logits.float(), dim=-1)
        weights, ids = torch.topk(probs, self.moe.top_k, dim=-1)
        if self.moe.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), ids

    def stack_experts(self) -> None:
        """Move every expert's weights into two stacked tensors (the grouped path)."""
        experts = [e for e in self.experts if isinstance(e, Expert)]  # not the shared one
        self.gate_up = torch.stack([e.gate_up_proj.weight.data for e in experts])
        self.down = torch.stack([e.down_proj.weight.data for e in experts])
        biases = [e.gate_up_proj.bias for e in experts]
        if all(b is not None for b in biases):
            self.gate_up_bias = torch.stack([b.data for b in biases if b is not None])
        for e in experts:
            for linear in (e.gate_up_proj, e.down_proj):
                linear.weight = nn.Parameter(linear.weight.data.new_empty(0), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up is not None and self.down is not None:
            return self.forward_grouped(x, self.gate_up, self.down)
        # x: [T, H]; each expert runs over the rows routed to it, in expert order
        weights, ids = self.route(x)
        k = self.moe.top_k
        flat = ids.reshape(-1)  # [T * k]
        order = torch.argsort(flat, stable=True)
        rows = order // k  # [T * k] the token of each routed row, grouped by expert
        scale = weights.reshape(-1)[order].unsqueeze(1)  # [T * k, 1]
        counts = torch.bincount(flat, minlength=self.moe.num_experts).tolist()
        out = torch.zeros_like(x)
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            expert = self.experts[e]
            assert isinstance(expert, Expert)
            take = rows[start : start + n]
            act = self._act(expert.gate_up_proj(x[take]), expert.local_inter)
            out.index_add_(0, take, expert.down_proj.matmul(act) * scale[start : start + n])
            start += n
        return self._biased(self.tp.all_reduce(self._shared(x, out)), weights, ids)

    def _act(self, gate_up: torch.Tensor, inter: int) -> torch.Tensor:
        """[N, 2 * I] -> [N, I]: SwiGLU, or gpt-oss's clamped one."""
        limit = self.moe.swiglu_limit
        if limit is None:
            return self.ops.silu_mul(gate_up, inter)
        gate, up = gate_up.split(inter, dim=-1)
        gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
        act: torch.Tensor = (up + 1) * (gate * torch.sigmoid(gate * self.moe.swiglu_alpha))
        return act

    def _biased(self, out: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """out plus each token's experts' down-projection biases, weighted, added once."""
        if self.down_bias is None:
            return out
        return out + (weights.unsqueeze(-1) * self.down_bias[ids]).sum(1)

    def _shared(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """out plus the shared expert's (partial) output, gated per token; before the reduce."""
        e, gate = self.shared_expert, self.shared_expert_gate
        if e is None or gate is None:
            return out
        act = self.ops.silu_mul(e.gate_up_proj(x), e.local_inter)
        return out + torch.sigmoid(gate(x)) * e.down_proj.matmul(act)

    def _load_stacked(self, w: Callable[[str], Sliceable], at: str) -> None:
        """gpt-oss: gate_up_proj [E, H, 2 * I] with gate and up interleaved, down_proj
        [E, I, H], and their biases."""
        gate_up, down = whole(w(at + "gate_up_proj")), whole(w(at + "down_proj"))
        gate_up_bias, down_bias = (
            whole(w(at + "gate_up_proj_bias")),
            whole(w(at + "down_proj_bias")),
        )
        for e, expert in enumerate(self.experts):
            assert isinstance(expert, Expert)
            gu, b = gate_up[e], gate_up_bias[e]
            expert.gate_up_proj.load([gu[:, 0::2].t(), gu[:, 1::2].t()], [b[0::2], b[1::2]])
            expert.down_proj.load(down[e].t())
        assert self.down_bias is not None
        self.down_bias.copy_(down_bias)

    def forward_grouped(
        self, x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor
    ) -> torch.Tensor:
        """x: [T, H]; the routed rows sorted by expert, each group's matmuls in one call, with
        device ops only (no count leaves the device)."""
        weights, ids = self.route(x)
        k, e = self.moe.top_k, self.moe.num_experts
        flat = ids.reshape(-1)  # [T * k]
        order = torch.argsort(flat, stable=True)
        rows = order // k
        counts = torch.zeros(e, dtype=torch.int32, device=x.device)
        counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
        ends = torch.cumsum(counts, 0, dtype=torch.int32)  # [E] each group's end row
        gu = torch._grouped_mm(x[rows], gate_up.transpose(1, 2), offs=ends)  # [T * k, 2 * I]
        if self.gate_up_bias is not None:
            gu = gu + self.gate_up_bias[flat[order]]
        act = self._act(gu, self.local_inter)
        y = torch._grouped_mm(act, down.transpose(1, 2), offs=ends)  # [T * k, H]
        y = y * weights.reshape(-1)[order].unsqueeze(1)
        out = self.tp.all_reduce(self._shared(x, torch.zeros_like(x).index_add_(0, rows, y)))
        return self._biased(out, weights, ids)

    def load(self, w: Callable[[str], Sliceable], prefix: str) -> None:
        """``prefix``: the layer's block, e.g. ``model.layers.3.mlp.``."""
        router = prefix + self.moe.router
        self.gate.weight.data.copy_(whole(w(router + ".weight")))
        if self.gate.bias is not None:
            self.gate.bias.data.copy_(whole(w(router + ".bias")))
        if self.moe.stacked:
            self._load_stacked(w, prefix + "experts.")
            return
        gate, up, down = self.moe.names
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            at = f"{prefix}shared_expert."
            self.shared_expert.gate_up_proj.load(
                [w(f"{at}gate_proj.weight"), w(f"{at}up_proj.weight")]
            )
            self.shared_expert.down_proj.load(w(f"{at}down_proj.weight"))
            self.shared_expert_gate.weight.data.copy_(
                whole(w(prefix + "shared_expert_gate.weight"))
            )
        for e, expert in enumerate(self.experts):
            assert isinstance(expert, Expert)
            at = f"{prefix}experts.{e}."
            expert.gate_up_proj.load([w(f"{at}{gate}.weight"), w(f"{at}{up}.weight")])
            expert.down_proj.load(w(f"{at}{down}.weight"))
