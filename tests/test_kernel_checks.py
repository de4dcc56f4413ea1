"""Every op of our C++ kernels (engine/kernels/csrc, built for the probed ISA: AVX2 in CI's
emulated step) checks its inputs before it touches their memory: a caller's mismatched
tensor (wrong head count, a pool smaller than its block table says, a wrong dtype, a layout
the kernel cannot walk, a bias or residual of another size, an index outside its pool) is a
RuntimeError naming the problem, never a read or write out of bounds. (lora_delta's checks:
tests/test_lora_kernel.py, beside what it computes.)"""

from __future__ import annotations

import pytest
import torch

from engine.kernels import native, native_attention
from engine.model.packed_linear import PackedLinear, can_pack, in_panels, load_few_rows, runs_brgemm

HEADS, BLOCKS, BLOCK_SIZE, HEAD_DIM, ROWS = 4, 8, 16, 16, 3


@pytest.fixture(scope="module", autouse=True)
def kernels() -> None:
    native.load()
    native_attention.load()
    load_few_rows()


# ---- decode_attention ----

def attention_inputs(dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator).to(dtype)

    return {"q": randn(ROWS, HEADS, HEAD_DIM), "k": randn(ROWS, HEADS, HEAD_DIM), "v": randn(ROWS, HEADS, HEAD_DIM),
            "k_cache": randn(HEADS, BLOCKS, BLOCK_SIZE, HEAD_DIM), "v_cache": randn(HEADS, BLOCKS, BLOCK_SIZE, HEAD_DIM),
            "block_tables": torch.tensor([[0, 1], [2, 3], [7, 6]]), "context_lens": torch.tensor([3, 20, 32])}


def attend(**changed: torch.Tensor) -> torch.Tensor:
    inputs = attention_inputs() | changed
    return torch.ops.rayinfer.decode_attention(*inputs.values())


def test_decode_attention_runs_on_the_valid_inputs_these_tests_vary() -> None:
    assert attend().shape == (ROWS, HEADS, HEAD_DIM)


@pytest.mark.parametrize("name", ["k", "v", "k_cache", "v_cache"])
def test_decode_attention_refuses_a_tensor_without_qs_head_count(name: str) -> None:
    tensor = attention_inputs()[name]
    fewer_heads = tensor[:, :2] if name in ("k", "v") else tensor[:2]
    with pytest.raises(RuntimeError, match=f"q's head count {HEADS}"):
        attend(**{name: fewer_heads})


@pytest.mark.parametrize("smaller", ["k_cache", "v_cache"])
def test_decode_attention_checks_block_ids_against_both_pools(smaller: str) -> None:
    """Ids 6 and 7 are in the other pool but past this one's 6 blocks."""
    pool = attention_inputs()[smaller][:, :6]
    with pytest.raises(RuntimeError, match=f"block id 7 at index 4 is outside {smaller}'s blocks of 6"):
        attend(**{smaller: pool})


@pytest.mark.parametrize("ids", [[[0, 1], [2, 3], [7, -1]], [[0, 1], [2, 3], [7, 8]]])
def test_decode_attention_refuses_a_block_id_outside_the_pools(ids: list[list[int]]) -> None:
    with pytest.raises(RuntimeError, match=f"block id {ids[2][1]} at index 5 is outside"):
        attend(block_tables=torch.tensor(ids))


def test_decode_attention_refuses_a_length_past_its_block_table() -> None:
    with pytest.raises(RuntimeError, match="length 33 of row 2 beyond its block table"):
        attend(context_lens=torch.tensor([3, 20, 33]))


@pytest.mark.parametrize("name", ["k", "v", "k_cache", "v_cache"])
def test_decode_attention_refuses_a_tensor_in_another_dtype(name: str) -> None:
    with pytest.raises(RuntimeError, match=f"{name} is BFloat16, q is Float"):
        attend(**{name: attention_inputs()[name].bfloat16()})


@pytest.mark.parametrize("name", ["block_tables", "context_lens"])
def test_decode_attention_refuses_tables_and_lengths_not_in_int64(name: str) -> None:
    with pytest.raises(RuntimeError, match=f"{name} must be Long, got Int"):
        attend(**{name: attention_inputs()[name].int()})


@pytest.mark.parametrize("name", ["q", "k", "k_cache", "v_cache"])
def test_decode_attention_refuses_a_last_dimension_that_is_not_contiguous(name: str) -> None:
    tensor = attention_inputs()[name]
    strided = torch.cat([tensor, tensor], dim=-1)[..., ::2]  # head_dim elements, 2 apart
    with pytest.raises(RuntimeError, match=f"{name}'s last dimension must be head_dim {HEAD_DIM} and contiguous"):
        attend(**{name: strided})


def test_decode_attention_refuses_pools_of_different_block_sizes() -> None:
    with pytest.raises(RuntimeError, match="k_cache's blocks hold 16 tokens, v_cache's 8"):
        attend(v_cache=attention_inputs()["v_cache"][:, :, :8])


def test_decode_attention_refuses_one_table_too_few() -> None:
    with pytest.raises(RuntimeError, match="one table and length per row"):
        attend(block_tables=attention_inputs()["block_tables"][:2])


def test_decode_attention_reads_strided_rows_and_heads_as_the_model_makes_them() -> None:
    """q, k, v are views of one qkv tensor: only the last dimension need be contiguous."""
    inputs = attention_inputs()
    qkv = torch.stack([inputs["q"], inputs["k"], inputs["v"]], dim=1)
    strided = attend(q=qkv[:, 0], k=qkv[:, 1], v=qkv[:, 2])
    torch.testing.assert_close(strided, attend())


# ---- write_kv ----

def write_kv_inputs() -> dict[str, torch.Tensor]:
    rows = torch.zeros(2 * HEADS, BLOCKS * BLOCK_SIZE, HEAD_DIM)
    return {"rows": rows, "new_kv": torch.randn(2 * HEADS, 2, HEAD_DIM), "slot_mapping": torch.tensor([5, 70])}


def write(**changed: torch.Tensor) -> None:
    inputs = write_kv_inputs() | changed
    torch.ops.rayinfer.write_kv(*inputs.values())


def test_write_kv_writes_each_row_to_its_slot() -> None:
    inputs = write_kv_inputs()
    torch.ops.rayinfer.write_kv(*inputs.values())
    torch.testing.assert_close(inputs["rows"][:, [5, 70]], inputs["new_kv"])


@pytest.mark.parametrize("slot", [-1, BLOCKS * BLOCK_SIZE])
def test_write_kv_refuses_a_slot_outside_the_pool(slot: int) -> None:
    with pytest.raises(RuntimeError, match=f"slot {slot} at index 1 is outside the pool's slots of {BLOCKS * BLOCK_SIZE}"):
        write(slot_mapping=torch.tensor([5, slot]))


def test_write_kv_refuses_new_rows_in_another_dtype() -> None:
    with pytest.raises(RuntimeError, match="new_kv is BFloat16, the pool Float"):
        write(new_kv=write_kv_inputs()["new_kv"].bfloat16())


def test_write_kv_refuses_a_pool_that_is_not_contiguous() -> None:
    rows = torch.zeros(2 * HEADS, BLOCKS * BLOCK_SIZE, 2 * HEAD_DIM)[..., ::2]
    with pytest.raises(RuntimeError, match="a contiguous pool"):
        write(rows=rows)


def test_write_kv_refuses_slots_not_in_int64_or_one_too_few() -> None:
    with pytest.raises(RuntimeError, match="slot_mapping must be Long, got Int"):
        write(slot_mapping=torch.tensor([5, 70], dtype=torch.int32))
    with pytest.raises(RuntimeError, match="one slot per new row"):
        write(slot_mapping=torch.tensor([5]))


def test_write_kv_refuses_rows_of_another_head_dim() -> None:
    with pytest.raises(RuntimeError, match=r"rows \[R, slots, D\] and new_kv \[R, B, D\]"):
        write(new_kv=torch.randn(2 * HEADS, 2, HEAD_DIM // 2))


# ---- draw and argmax ----

def test_draw_and_argmax_refuse_logits_they_cannot_walk() -> None:
    logits = torch.randn(2, 10)
    for op in (torch.ops.rayinfer.argmax, lambda x: torch.ops.rayinfer.draw(x, torch.ones(2), torch.zeros(2))):
        with pytest.raises(RuntimeError, match="float32, bf16 or fp16, not Double"):
            op(logits.double())
        with pytest.raises(RuntimeError, match="contiguous rows"):
            op(torch.randn(10, 2).t())
        with pytest.raises(RuntimeError, match=r"logits \[S, V\]"):
            op(logits[0])


def test_draw_refuses_one_temperature_or_uniform_too_few() -> None:
    with pytest.raises(RuntimeError, match="2 rows, 1 temperatures, 2 uniforms"):
        torch.ops.rayinfer.draw(torch.randn(2, 10), torch.ones(1), torch.zeros(2))
    with pytest.raises(RuntimeError, match="2 rows, 2 temperatures, 3 uniforms"):
        torch.ops.rayinfer.draw(torch.randn(2, 10), torch.ones(2), torch.zeros(3))


# ---- linear ----

DTYPES = [pytest.param(dtype, id=str(dtype).removeprefix("torch."), marks=pytest.mark.skipif(
    not can_pack(torch.device("cpu"), dtype), reason="oneDNN cannot pack this dtype on this CPU"))
    for dtype in (torch.float32, torch.bfloat16)]
IN, OUT = 64, 96


def layer(dtype: torch.dtype) -> PackedLinear:
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(OUT, IN, generator=generator).to(dtype)
    return PackedLinear(weight, torch.randn(OUT, generator=generator).to(dtype), few_rows=True)


def linear(module: PackedLinear, x: torch.Tensor, **changed) -> torch.Tensor:
    args = {"packed_weight": module.packed_weight, "weight": module.weight, "bias": module.bias, "epilogue": "none",
            "other": None} | changed
    return torch.ops.rayinfer.linear(x, *args.values())


# 1 row: our kernels' (panels or the plain pass); 80 rows: oneDNN's, which the checks guard too.
@pytest.mark.parametrize("rows", [1, 80])
@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_refuses_a_bias_of_another_size(dtype: torch.dtype, rows: int) -> None:
    module = layer(dtype)
    with pytest.raises(RuntimeError, match=rf"bias \[{OUT}\], got \[{OUT - 1}\]"):
        linear(module, torch.randn(rows, IN).to(dtype), bias=module.bias[:-1])
    with pytest.raises(RuntimeError, match=rf"bias \[{OUT}\], got \[1, {OUT}\]"):
        linear(module, torch.randn(rows, IN).to(dtype), bias=module.bias[None])


@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_refuses_a_bias_in_another_dtype(dtype: torch.dtype) -> None:
    module = layer(dtype)
    with pytest.raises(RuntimeError, match="bias .x's dtype. must be"):
        linear(module, torch.randn(1, IN).to(dtype), bias=module.bias.double())


@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_refuses_x_of_another_width_or_dtype(dtype: torch.dtype) -> None:
    module = layer(dtype)
    with pytest.raises(RuntimeError, match=f"does not end in the weight's {IN} inputs"):
        linear(module, torch.randn(1, IN + 2).to(dtype))
    with pytest.raises(RuntimeError, match="the weight .x's dtype. must be"):
        linear(module, torch.randn(1, IN).double())


@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_refuses_a_residual_of_another_size_or_dtype(dtype: torch.dtype) -> None:
    module = layer(dtype)
    x = torch.randn(2, IN).to(dtype)
    with pytest.raises(RuntimeError, match=f"does not hold y's {2 * OUT} elements"):
        linear(module, x, epilogue="add", other=torch.zeros(1, OUT).to(dtype))
    with pytest.raises(RuntimeError, match="other .x's dtype. must be"):
        linear(module, x, epilogue="add", other=torch.zeros(2, OUT).double())


@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_refuses_a_packed_weight_of_another_shape(dtype: torch.dtype) -> None:
    module, other = layer(dtype), PackedLinear(torch.randn(OUT, IN + 2).to(dtype), None)
    with pytest.raises(RuntimeError, match="packed_weight"):
        linear(module, torch.randn(1, IN).to(dtype), packed_weight=other.packed_weight)


def every_other(t: torch.Tensor) -> torch.Tensor:
    """t's values as a view whose last dimension is strided."""
    return torch.stack([t, torch.zeros_like(t)], dim=-1)[..., 0]


@pytest.mark.parametrize("rows", [1, 2, 80])
@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_reads_a_strided_x_bias_and_residual_as_their_copies(dtype: torch.dtype, rows: int) -> None:
    """oneDNN's linear reads bias and residual as dense whatever their strides: the op hands it copies."""
    module = layer(dtype)
    x, residual = torch.randn(rows, IN).to(dtype), torch.randn(rows, OUT).to(dtype)
    strided = linear(module, every_other(x), bias=every_other(module.bias), epilogue="add", other=every_other(residual))
    tolerance = 1e-4 if dtype == torch.float32 else 5e-2
    torch.testing.assert_close(strided, linear(module, x, epilogue="add", other=residual), atol=tolerance,
                               rtol=tolerance)


@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_refuses_panels_it_cannot_walk(dtype: torch.dtype) -> None:
    module = layer(dtype)
    if not in_panels(torch.zeros(OUT, IN, dtype=dtype)):
        pytest.skip("this build keeps the weight plain for this dtype")
    x = torch.randn(1, IN).to(dtype)
    panels = module.weight
    with pytest.raises(RuntimeError, match="panels must be contiguous"):
        linear(module, x, weight=every_other(panels))
    with pytest.raises(RuntimeError, match="panels"):
        linear(module, x, weight=panels[:, :, :-1].contiguous())


# ---- linear on oneDNN's brgemm ukernel (past max_rows, up to brgemm_rows) ----

def brgemm_layer() -> PackedLinear:
    """A bf16 layer whose small steps run brgemm; skips where they cannot."""
    if not can_pack(torch.device("cpu"), torch.bfloat16):
        pytest.skip("oneDNN does not pack bf16 on this CPU")
    module = layer(torch.bfloat16)
    if not runs_brgemm(module):
        pytest.skip("no bf16 panels here, or oneDNN's brgemm ukernel does not run bf16 (it needs avx512_core)")
    return module


def on_brgemm(module: PackedLinear, x: torch.Tensor, **changed) -> torch.Tensor:
    return linear(module, x, **changed, max_rows=0, brgemm_rows=64)


@pytest.mark.parametrize("rows", [1, 64])
def test_brgemm_refuses_a_bias_or_residual_of_another_size(rows: int) -> None:
    module = brgemm_layer()
    x = torch.randn(rows, IN).bfloat16()
    with pytest.raises(RuntimeError, match=rf"bias \[{OUT}\], got \[{OUT - 1}\]"):
        on_brgemm(module, x, bias=module.bias[:-1])
    with pytest.raises(RuntimeError, match=f"does not hold y's {rows * OUT} elements"):
        on_brgemm(module, x, epilogue="add", other=torch.zeros(rows + 1, OUT).bfloat16())


def test_brgemm_refuses_x_of_another_width_or_dtype() -> None:
    module = brgemm_layer()
    with pytest.raises(RuntimeError, match=f"does not end in the weight's {IN} inputs"):
        on_brgemm(module, torch.randn(1, IN + 2).bfloat16())
    with pytest.raises(RuntimeError, match="the weight .x's dtype. must be"):
        on_brgemm(module, torch.randn(1, IN))


def test_brgemm_refuses_panels_it_cannot_walk() -> None:
    module = brgemm_layer()
    x = torch.randn(2, IN).bfloat16()
    with pytest.raises(RuntimeError, match="panels must be contiguous"):
        on_brgemm(module, x, weight=every_other(module.weight))
    with pytest.raises(RuntimeError, match="panels"):
        on_brgemm(module, x, weight=module.weight[:, :, :-1].contiguous())


@pytest.mark.parametrize("rows", [1, 7, 64])
def test_brgemm_reads_a_strided_x_bias_and_residual_as_their_copies(rows: int) -> None:
    module = brgemm_layer()
    x, residual = torch.randn(rows, IN).bfloat16(), torch.randn(rows, OUT).bfloat16()
    strided = on_brgemm(module, every_other(x), bias=every_other(module.bias), epilogue="add",
                        other=every_other(residual))
    torch.testing.assert_close(strided, on_brgemm(module, x, epilogue="add", other=residual), atol=0, rtol=0)
