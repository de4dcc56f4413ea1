"""A step's LoRA updates, each row under its own adapter's slot: every form
(engine/lora/lora_linear.py) computes x[t] @ A[slot t] @ B[slot t], our C++ op
(engine/kernels/csrc/lora_delta.cpp) included, for rows of several slots and the base
model's (slot 0, zeros) in any order, at ranks that fill no whole vector, and in both dtypes
the engine runs on CPU; the op refuses mismatched inputs by name and never reads past them."""

from __future__ import annotations

import re

import pytest
import torch

from engine.lora.lora_linear import LoraBatch, load_kernel

NUM_SLOTS = 5


def slot_weights(fan_in: int, fan_out: int, rank: int, dtype: torch.dtype, seed: int = 0):
    """Stacked slots in engine/lora/slots.py's layout, a [in, S, R] and b [S, R, out], slot 0 zeros."""
    generator = torch.Generator().manual_seed(seed)
    a = torch.randn(fan_in, NUM_SLOTS, rank, generator=generator) / fan_in ** 0.5
    b = torch.randn(NUM_SLOTS, rank, fan_out, generator=generator)
    a[:, 0], b[0] = 0, 0
    return a.to(dtype), b.to(dtype)


def reference(x: torch.Tensor, slots: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Row by row, in float64."""
    x, a, b = x.double(), a.double(), b.double()
    return torch.stack([x[t] @ a[:, s] @ b[s] for t, s in enumerate(slots.tolist())])


def delta(form: str, x: torch.Tensor, slots: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The update of one linear (kind "attn_qkv"), as a step's LoraBatch computes it in `form`."""
    stacks = tuple(t.unsqueeze(0) for t in (a, b)) + tuple(torch.zeros(1, 1, NUM_SLOTS, 1) for _ in range(6))
    return LoraBatch.of(slots, stacks, form).layer(0).delta("attn_qkv", x)


@pytest.fixture(scope="module")
def kernel() -> None:
    try:
        load_kernel()
    except Exception as exc:  # noqa: BLE001
        pytest.skip(f"our C++ kernels do not build here: {exc!r}")


TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("form", ["kernel", "per_row", "dense"])
@pytest.mark.parametrize("rows, rank, fan_in, fan_out", [(1, 16, 64, 96), (7, 8, 48, 100), (33, 20, 96, 72)])
def test_every_form_is_each_row_s_own_adapter_s_update(request, form, dtype, rows, rank, fan_in, fan_out):
    """Slots drawn at random over the rows (the base model's among them), a rank and output
    width that fill no whole vector (20, 100, 72): every row's update is its own slot's."""
    if form == "kernel":
        request.getfixturevalue("kernel")
    a, b = slot_weights(fan_in, fan_out, rank, dtype)
    generator = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, fan_in, generator=generator).to(dtype)
    slots = torch.randint(0, NUM_SLOTS, (rows,), generator=generator)
    slots[0] = 0 if rows > 1 else 3
    expected = reference(x, slots, a, b)
    ours = delta(form, x, slots, a, b)
    assert ours.dtype == dtype and ours.shape == (rows, fan_out)
    scale = expected.abs().max().item()
    assert (ours.double() - expected).abs().max().item() <= TOLERANCE[dtype] * scale
    assert torch.equal(ours[slots == 0], torch.zeros_like(ours[slots == 0]))


def test_the_kernel_reads_a_slot_once_for_all_its_rows_whatever_their_order(kernel):
    """Rows of one slot spread over the step, many of each (groups of several rows share each
    load): the same as each row alone, in fp32."""
    a, b = slot_weights(64, 80, 16, torch.float32, seed=1)
    x = torch.randn(40, 64)
    slots = torch.tensor([1, 2, 1, 0, 4, 1, 1, 1, 2, 3] * 4)
    together = torch.ops.rayinfer.lora_delta(x, slots, a, b)
    alone = torch.cat([torch.ops.rayinfer.lora_delta(x[t:t + 1], slots[t:t + 1], a, b) for t in range(40)])
    assert torch.allclose(together, alone, atol=1e-6)
    assert torch.allclose(together.double(), reference(x, slots, a, b), atol=1e-5)


@pytest.mark.parametrize("change, named", [
    (lambda x, s, a, b: (x, torch.tensor([0, 1, NUM_SLOTS]), a, b), "outside the adapters' slots"),
    (lambda x, s, a, b: (x, torch.tensor([0, -1, 1]), a, b), "outside the adapters' slots"),
    (lambda x, s, a, b: (x, s[:2], a, b), "slots [T]"),
    (lambda x, s, a, b: (x, s.int(), a, b), "slots must be Long"),
    (lambda x, s, a, b: (x[:, :10], s, a, b), "not the slots of x's"),
    (lambda x, s, a, b: (x, s, a, b[:, :4]), "not the slots of x's"),
    (lambda x, s, a, b: (x, s, a, b[:3]), "not the slots of x's"),
    (lambda x, s, a, b: (x, s, a.bfloat16(), b), "a (x's dtype)"),
    (lambda x, s, a, b: (x.double(), s, a.double(), b.double()), "bfloat16 or float32"),
    (lambda x, s, a, b: (x, s, a.transpose(1, 2), b), "not the slots of x's"),
    (lambda x, s, a, b: (x, s, a, b.transpose(0, 1).contiguous().transpose(0, 1)), "contiguous"),
    (lambda x, s, a, b: (x[0], s, a, b), "x [T, K]"),
], ids=["slot-too-high", "slot-negative", "slots-short", "slots-int32", "x-width", "b-rank", "b-slots", "a-dtype",
        "float64", "a-rank-width", "b-strided", "x-1d"])
def test_the_kernel_refuses_mismatched_inputs_by_name(kernel, change, named):
    a, b = slot_weights(32, 48, 8, torch.float32)
    x, slots = torch.randn(3, 32), torch.tensor([0, 1, 2])
    with pytest.raises(RuntimeError, match=re.escape(named)):
        torch.ops.rayinfer.lora_delta(*change(x, slots, a, b))
