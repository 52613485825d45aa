"""Quantized weights (models.quant): what is stored, what the matmuls compute, that a quantized
model serves exactly its dequantized weights (up to the int8 kernel's bf16 activations), that
every TP layout serves the same weights, and that what cannot be served is refused by name."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from cluster.config import TandemConfig
from models.kv_layout import kv_pool_shape
from models.llama import LlamaModel
from models.parallel import ServedLinear
from models.quant import FP8, Quant, QuantizedWeight, quantize, row_absmax
from models.spec import ModelSpec
from runtime.backends import exact_attention
from runtime.runner import LocalRunner, SeqInput, StepResult
from tests.helpers import assert_verification_equals_decodes
from tests.models.test_tensor_parallel import check_tp2_matches_tp1, on_two_ranks

BS = 16


def _weight(out: int = 48, inp: int = 64, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out, inp, generator=g)
    w[3] *= 20  # rows of very different ranges: each needs its own scale
    return w


def test_int8_rows_have_their_own_scale_and_round_to_nearest() -> None:
    w = _weight()
    q = quantize(w, Quant.INT8, row_absmax(w))
    assert q.data.dtype == torch.int8 and q.data.shape == w.shape
    top = q.data.abs().amax(1)  # [out]: each row spans the int8 range (its scale rounded up)
    assert bool((top >= 125).all()) and bool((top <= 127).all())
    scale = q.scale.float().unsqueeze(1)  # [out, 1], as stored (bf16)
    err = (q.dequantized() - w).abs()
    assert bool((err <= scale * (0.5 + 1e-5)).all())  # round to nearest on the stored scale
    assert float(err.max()) > 0  # it really is quantized


@pytest.mark.parametrize("kind", [Quant.INT8, Quant.FP8])
def test_quantized_matmul_multiplies_by_the_dequantized_weight(kind: Quant) -> None:
    w = _weight()
    q = quantize(w, kind, row_absmax(w))
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(1))
    y = q.matmul(x)
    assert y.dtype == torch.float32 and y.shape == (5, 48)
    if kind is Quant.INT8:  # activations in bf16, float32 accumulation, bf16 output
        want = x.bfloat16().float() @ q.dequantized().T
        tol = 2**-7 * float(want.abs().max())
    else:  # activations quantized per token to e4m3, then an exact float32 product
        assert q.data.dtype == FP8
        xs = x.abs().amax(1, keepdim=True) / 448
        want = ((x / xs).to(FP8).float() * xs) @ q.dequantized().T
        tol = 1e-4 * float(want.abs().max())
    assert float((y - want).abs().max()) <= tol
    assert float((y - x @ w.T).abs().max()) > float((y - want).abs().max())


def test_widths_the_kernels_cannot_take_are_refused() -> None:
    w = torch.randn(32, 40)
    with pytest.raises(ValueError, match=r"multiples of 16.*\[32, 40\]"):
        quantize(w, Quant.INT8, row_absmax(w))
    w = torch.randn(40, 32)
    quantize(w, Quant.INT8, row_absmax(w))  # int8 takes any number of outputs
    with pytest.raises(ValueError, match=r"fp8.*\[40, 32\]"):
        quantize(w, Quant.FP8, row_absmax(w))


def _steps(model: LlamaModel) -> list[StepResult]:
    """A prompt step of two sequences, then a verification step of 5 and a decode of 1."""
    c = model.cfg
    pool = torch.zeros(kv_pool_shape(8, c.num_kv_heads, c.num_layers, BS, c.head_dim))
    g = torch.Generator().manual_seed(0)
    a = torch.randint(3, c.vocab_size, (40,), generator=g).tolist()
    b = torch.randint(3, c.vocab_size, (23,), generator=g).tolist()
    batches = [
        [SeqInput([0, 1, 2], 0, a[:35], [30, 34]), SeqInput([3, 4], 0, b[:20], [19])],
        [SeqInput([0, 1, 2], 35, a[35:40], list(range(5))), SeqInput([3, 4], 20, b[20:21], [0])],
    ]
    return [LocalRunner(model, pool, BS).run(batch) for batch in batches]


def _bf16(x: torch.Tensor) -> torch.Tensor:
    return x.bfloat16().float()


def _dequantized_copy(spec: ModelSpec, quantized: LlamaModel) -> LlamaModel:
    """The unquantized model with every layer's matmul weight replaced by ``quantized``'s
    weight as it multiplies it, its inputs and outputs rounded to bf16 as the int8 kernel's
    are (the tied table stays: the lookup reads it plain)."""
    plain = ModelSpec(spec.folder, spec.dtype).load()
    served = dict(quantized.named_modules())
    for name, m in plain.named_modules():
        if isinstance(m, ServedLinear):
            q = served[name].kernel
            assert isinstance(q, QuantizedWeight)
            m.weight.data.copy_(q.dequantized())
            m.register_forward_pre_hook(lambda _m, args: (_bf16(args[0]),))
            m.register_forward_hook(lambda _m, _args, out: _bf16(out))
    return plain


def test_int8_model_serves_its_dequantized_weights(tiny_folder: Path) -> None:
    spec = ModelSpec(str(tiny_folder), quantization="int8")
    model = spec.load()
    assert all(m.weight.numel() == 0 for m in model.modules() if isinstance(m, ServedLinear))
    head = model.lm_head.kernel
    assert (
        isinstance(head, QuantizedWeight) and model.embed_tokens.weight.numel() > 0
    )  # tied: lookup plain
    got = _steps(model)
    ref = _steps(_dequantized_copy(spec, model))
    want = [_bf16(_bf16(r.hidden) @ head.dequantized().T) for r in ref]
    fp32 = _steps(ModelSpec(str(tiny_folder)).load())
    for g, w, f in zip(got, want, fp32, strict=True):
        # The same arithmetic but for float32 summation order, where a bf16 rounding may
        # flip: a few bf16 steps of the largest logit at most ...
        assert float((g.logits - w).abs().max()) <= 2**-5 * float(w.abs().max())
        # ... and far closer to it than to the unquantized model: the weights really are int8.
        assert float((g.logits - w).abs().mean()) <= 0.2 * float((g.logits - f.logits).abs().mean())


def _served_weights(model: LlamaModel) -> dict[str, torch.Tensor]:
    out = {}
    for name, m in model.named_modules():
        if isinstance(m, ServedLinear):
            assert isinstance(m.kernel, QuantizedWeight)
            out[name] = m.kernel.dequantized()
    return out


def test_quantizing_each_layer_as_it_loads_serves_the_weights_of_quantizing_after(
    tiny_folder: Path,
) -> None:
    """``load_weights(quant=...)`` quantizes layer by layer so that the full-precision model
    is never in memory at once; it must end with exactly the weights (and the head) that
    quantizing the whole loaded model gives, and an unquantized load must stay unquantized."""
    spec = ModelSpec(str(tiny_folder), quantization="int8")
    at_load = spec.load()
    after = ModelSpec(str(tiny_folder)).load()
    assert after.quant is Quant.NONE and after.lm_head.kernel is None
    after.quantize(Quant.INT8)
    assert at_load.quant is Quant.INT8
    want, got = _served_weights(after), _served_weights(at_load)
    assert want.keys() == got.keys() and len(got) == 4 * after.cfg.num_layers
    for name, w in want.items():
        assert torch.equal(got[name], w), name
    a, b = at_load.lm_head.kernel, after.lm_head.kernel
    assert isinstance(a, QuantizedWeight) and isinstance(b, QuantizedWeight)
    assert torch.equal(a.dequantized(), b.dequantized())


def test_int8_tp2_serves_the_tp1_weights(tiny_folder: Path) -> None:
    """Row scales are a max over the TP group, so both layouts multiply by the same weights:
    each rank's rows (column-parallel) or columns (row-parallel) of TP = 1's, bit for bit.
    The logits then differ only where the bf16 partial sums are rounded."""
    spec = ModelSpec(str(tiny_folder), quantization="int8")
    whole = _served_weights(spec.load())
    ranks = on_two_ranks(lambda tp: _served_weights(spec.load(tp=tp)))
    for name, w in whole.items():
        dim = 1 if name.endswith(("o_proj", "down_proj")) else 0  # row- or column-parallel
        if name.endswith("qkv_proj"):  # q, k and v are each split, then concatenated
            c = spec.config()
            sizes = [c.q_size // 2, c.kv_size // 2, c.kv_size // 2]
            parts = [r[name].split(sizes) for r in ranks]
            joined = torch.cat([torch.cat(p) for p in zip(*parts, strict=True)])
        elif name.endswith("gate_up_proj"):
            parts = [r[name].chunk(2) for r in ranks]
            joined = torch.cat([torch.cat(p) for p in zip(*parts, strict=True)])
        else:
            joined = torch.cat([r[name] for r in ranks], dim)
        assert torch.equal(joined, w), name
    check_tp2_matches_tp1(spec, tol=0.05)


def test_quantization_the_device_cannot_serve_is_refused(tiny_folder: Path) -> None:
    with pytest.raises(ValueError, match=r"fp8 needs a CUDA GPU.*cpu"):
        ModelSpec(str(tiny_folder), quantization="fp8").load("cpu")
    with pytest.raises(ValueError, match="int4"):
        ModelSpec(str(tiny_folder), quantization="int4")
    with pytest.raises(ValidationError, match=r"model\.quantization=fp8.*decode\.device is cpu"):
        TandemConfig.model_validate({"model": {"quantization": "fp8"}, "decode": {"device": "cpu"}})
    with pytest.raises(ValidationError, match=r"draft\.quantization=int8 needs a draft checkpoint"):
        TandemConfig.model_validate({"draft": {"kind": "ngram", "quantization": "int8"}})
    with pytest.raises(ValidationError, match="quantization"):
        TandemConfig.model_validate({"model": {"quantization": "int4"}})


def test_quantization_changes_the_fingerprint(tiny_folder: Path) -> None:
    plain, int8 = ModelSpec(str(tiny_folder)), ModelSpec(str(tiny_folder), quantization="int8")
    assert plain.fingerprint() != int8.fingerprint()
    assert plain.fingerprint() == ModelSpec(str(tiny_folder), quantization="none").fingerprint()


def test_int8_verification_rounds_exactly_like_one_token_decodes(tiny_folder: Path) -> None:
    """Greedy speculation is token-identical to plain decoding only if verifying k + 1 tokens
    gives each row the logits a one-token decode gives it, bit for bit: the int8 kernel's bf16
    activations would amplify attention's call-shape rounding, so attention runs in float64."""
    model = ModelSpec(str(tiny_folder), quantization="int8").load()
    assert exact_attention(model)
    assert_verification_equals_decodes(model, n=300, k=8, blocks=20)
