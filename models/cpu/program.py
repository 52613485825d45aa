"""A CPU step's decoder layers in one C call (``csrc/layer_program.c``): the module path's
kernels in the same order, so every value keeps its bits. Models (``why_not``) and steps it does
not take run the modules."""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from models.attention.metadata import StepMetadata
from models.cpu import native
from models.cpu.linear import CpuLinear, PanelKind, PanelWeight
from models.cpu.paged import DTYPES, CpuPagedAttention, NativeGroup
from models.cpu.row_ops import CpuRowOps
from models.kv_layout import slabs_in_place
from models.layers import RMSNorm
from models.llama import LlamaDecoderLayer, LlamaMLP, LlamaModel

log = logging.getLogger(__name__)

SOURCE = native.CSRC / "layer_program.c"
FLAGS = ("-O2", "-fPIC", "-shared")

_i64, _p, _f32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float


class _Weight(ctypes.Structure):
    _fields_ = [("kind", _i64), ("data", _p), ("scale", _p)]


class _Layer(ctypes.Structure):
    _fields_ = [
        ("input_norm", _p),
        ("post_norm", _p),
        ("qkv", _Weight),
        ("o", _Weight),
        ("gate_up", _Weight),
        ("down", _Weight),
    ]


class _Model(ctypes.Structure):
    _fields_ = [
        *((name, _p) for name in ("norm", "rope", "silu_mul", "add", "linear", "write", "attend")),
        *((name, _i64) for name in ("dtype", "hidden", "inter", "hq", "hkv", "d")),
        ("eps", _f32),
        ("scale", _f32),
        ("linear_side", _p),
    ]


class _Step(ctypes.Structure):
    _fields_ = [
        ("t", _i64),
        *((name, _p) for name in ("x", "n", "qkv", "qk", "att", "o", "gu", "act")),
        *((name, _p) for name in ("cos", "sin", "slot_blocks", "slot_offsets", "pool")),
        *((name, _i64) for name in ("layer_bytes", "block_stride", "nb", "bs")),
        *((name, _p) for name in ("tables", "q_start", "q_len", "cached", "tree_base")),
        ("tree_mask", _p),
        *((name, _i64) for name in ("nbmax", "tree_width", "b", "window")),
        ("sides", _p),
    ]


def c_layout(lib: ctypes.CDLL) -> list[int]:
    fn = lib.tandem_layer_program_layout
    fn.restype = _i64
    fn.argtypes = [ctypes.POINTER(_i64), _i64]
    out = (_i64 * 64)()
    n = fn(out, 64)
    return list(out[: min(n, 64)])


def py_layout() -> list[int]:
    sizes = [ctypes.sizeof(t) for t in (_Weight, _Layer, _Model, _Step)]
    offsets = [getattr(t, name).offset for t in (_Model, _Step) for name, *_ in t._fields_]
    return sizes + offsets


def _address(fn: object) -> int:
    address = ctypes.cast(fn, ctypes.c_void_p).value  # type: ignore[arg-type]
    assert address is not None
    return int(address)


def _weight(w: object, dtype: torch.dtype) -> _Weight | None:
    """None unless the panel kernel takes activations of the model's dtype."""
    if not isinstance(w, PanelWeight) or w.out_dtype != dtype:
        return None
    act = torch.bfloat16 if w.kind in (PanelKind.BF16, PanelKind.INT8_DIGITS) else torch.float32
    if act != dtype:
        return None
    scale = None if w.scale is None else w.scale.data_ptr()
    return _Weight(int(w.kind), w.data.data_ptr(), scale)


@dataclass
class LayerProgram:
    """Holds the weights' pointers: the model must outlive it, its weights unmoved."""

    model: LlamaModel
    _fn: Callable[..., int]
    _model: _Model
    _layers: ctypes.Array[_Layer]
    steps: int = 0
    declined: int = 0
    # prefetch the next layer's KV during the MLP (off: it did not pay, docs/cpu-kernels.md)
    fetch_next_kv: bool = False
    _lib: ctypes.CDLL | None = field(default=None, repr=False)

    @staticmethod
    def why_not(model: LlamaModel, attention: CpuPagedAttention | None, packed: bool) -> str | None:
        cfg = model.cfg
        reasons = {
            "not on a CPU": model.device.type != "cpu",
            f"no CPU kernels for {model.dtype}": model.dtype not in DTYPES,
            "not packed for the CPU": not packed,
            "tensor-parallel": model.tp.world_size > 1,
            "attention biases": cfg.qkv_bias or cfg.o_bias,
            "q/k norms": cfg.qk_norm,
            "mixture of experts": cfg.moe is not None,
            "Gemma 3's layer shape": cfg.gemma is not None,
            "per-layer windows": cfg.layer_windows is not None,
            "activation quantization": any(
                getattr(m, "input_quant", None) is not None for m in model.modules()
            ),
            "the drafter reads inner layers": bool(model.feature_layers),
            "no in-place attention kernel": attention is None or not attention.ready(),
        }
        found = [why for why, yes in reasons.items() if yes]
        if found:
            return ", ".join(found)
        ops = model.norm.ops
        if not isinstance(ops, CpuRowOps) or not ops.ready():
            return "no row-ops kernel"
        for layer in model.layers:
            assert isinstance(layer, LlamaDecoderLayer) and isinstance(layer.mlp, LlamaMLP)
            attn, mlp = layer.self_attn, layer.mlp
            parts = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
            if any(_weight(m.kernel, model.dtype) is None for m in parts):
                return "a matmul outside the panel kernel at the model's dtype"
        return None

    @classmethod
    def build(
        cls, model: LlamaModel, attention: CpuPagedAttention | None, linear: CpuLinear
    ) -> LayerProgram | None:
        reason = cls.why_not(model, attention, packed=True)
        if reason is not None:
            log.info("decoder layers run as modules: %s", reason)
            return None
        assert attention is not None and isinstance(model.norm.ops, CpuRowOps)
        rows = model.norm.ops.lib
        assert rows is not None
        try:
            lib = ctypes.CDLL(str(native.build_library(SOURCE, FLAGS)))
        except Exception as e:
            log.error("the layer program is unavailable, layers run as modules: %s", e)
            return None
        if c_layout(lib) != py_layout():
            log.error("the layer program's structs differ from their ctypes mirrors")
            return None
        fn = lib.tandem_layer_program
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.POINTER(_Model), ctypes.POINTER(_Layer), _i64, ctypes.POINTER(_Step)]
        first = model.layers[0]
        assert isinstance(first, LlamaDecoderLayer) and isinstance(first.mlp, LlamaMLP)
        cfg = model.cfg
        spec = _Model(
            _address(rows.tandem_rms_norm),
            _address(rows.tandem_rope),
            _address(rows.tandem_silu_mul),
            _address(rows.tandem_add),
            _address(linear.function()),
            _address(attention.functions()[1]),
            _address(attention.functions()[0]),
            DTYPES[model.dtype],
            cfg.hidden_size,
            first.mlp.local_inter,
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
            cfg.rms_norm_eps,
            first.self_attn.scale,
            _address(linear.side_function()),
        )
        table = (_Layer * len(model.layers))()
        for i, layer in enumerate(model.layers):
            assert isinstance(layer, LlamaDecoderLayer) and isinstance(layer.mlp, LlamaMLP)
            attn, mlp = layer.self_attn, layer.mlp
            weights = [
                _weight(m.kernel, model.dtype)
                for m in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
            ]
            norm = layer.input_layernorm
            assert isinstance(norm, RMSNorm)
            table[i] = _Layer(
                norm.weight.data_ptr(),
                layer.post_attention_layernorm.weight.data_ptr(),
                *weights,
            )
        return cls(model, fn, spec, table, _lib=lib)

    def run(self, x: torch.Tensor, kv_pool: torch.Tensor, meta: StepMetadata) -> bool:
        """Every layer over ``x`` [T, hidden], in place, for a step whose attention is one
        in-place group over all its rows; False, having done nothing, for any other step."""
        group = meta.groups[0] if len(meta.groups) == 1 else None
        if (
            meta.write_rows is not None
            or not isinstance(group, NativeGroup)
            or group.rows is not None
            or not slabs_in_place(kv_pool[0])
            or kv_pool.dtype != self.model.dtype
            or not x.is_contiguous()
        ):
            self.declined += 1
            return False
        m = self._model
        t = x.shape[0]
        widths = (  # the scratch rows: n, qkv, qk, att, o, gu, act
            m.hidden,
            (m.hq + 2 * m.hkv) * m.d,
            (m.hq + m.hkv) * m.d,
            m.hq * m.d,
            m.hidden,
            2 * m.inter,
            m.inter,
        )
        scratch = x.new_empty(t * sum(widths))
        base, size = scratch.data_ptr(), scratch.element_size()
        starts = [0]
        for width in widths[:-1]:
            starts.append(starts[-1] + t * width)
        cos = meta.cos.contiguous()
        sin = meta.sin.contiguous()
        blocks = meta.slot_blocks.contiguous()
        offsets = meta.slot_offsets.contiguous()
        sides = torch.empty(group.tables.numel(), dtype=torch.long)
        step = _Step(
            t,
            x.data_ptr(),
            *(base + at * size for at in starts),
            cos.data_ptr(),
            sin.data_ptr(),
            blocks.data_ptr(),
            offsets.data_ptr(),
            kv_pool.data_ptr(),
            kv_pool.stride(0) * kv_pool.element_size(),
            kv_pool.stride(1),
            kv_pool.shape[1],
            kv_pool.shape[4],
            group.tables.data_ptr(),
            group.q_start.data_ptr(),
            group.q_len.data_ptr(),
            group.cached.data_ptr(),
            group.tree_base.data_ptr(),
            group.tree_mask.data_ptr(),
            group.tables.shape[1],
            group.tree_mask.shape[1],
            group.cached.shape[0],
            group.window,
            sides.data_ptr() if self.fetch_next_kv else None,
        )
        rc = self._fn(
            ctypes.byref(self._model), self._layers, len(self.model.layers), ctypes.byref(step)
        )
        if rc != 0:
            raise RuntimeError(f"the layer program stopped at layer {rc // 256} (code {rc % 256})")
        self.steps += 1
        group.kernel.calls += len(self.model.layers)
        return True
