"""How decode steps are bucketed for CUDA graphs (engine/model/cuda_graphs.py), and the config
rules that choose them; the graphs themselves replay on a GPU only (tests/test_gpu.py)."""

from __future__ import annotations

import pytest

from engine.config import EngineConfig
from engine.model.cuda_graphs import bucket, row_buckets, width_buckets


def test_row_buckets_are_vllms_spacing_thinned_past_64_rows_and_end_at_max_num_seqs():
    assert row_buckets(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert row_buckets(5) == [1, 2, 4, 5]
    assert row_buckets(1) == [1]
    assert row_buckets(256)[-9:] == [64, 80, 96, 112, 128, 160, 192, 224, 256]
    assert row_buckets(100)[-3:] == [80, 96, 100]


def test_width_buckets_are_powers_of_two_up_to_the_longest_context():
    assert width_buckets(64) == [1, 2, 4, 8, 16, 32, 64]
    assert width_buckets(5) == [1, 2, 4, 5]
    assert width_buckets(1) == [1]


def test_a_compiled_steps_buckets_start_at_two():
    assert row_buckets(64, smallest=2) == [2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert width_buckets(64, smallest=2) == [2, 4, 8, 16, 32, 64]
    assert row_buckets(1, smallest=2) == width_buckets(1, smallest=2) == [2]


def test_a_step_takes_the_smallest_bucket_that_holds_it_and_never_one_past_the_largest():
    rows = row_buckets(64)
    assert [bucket(rows, n) for n in (1, 3, 8, 9, 33, 64)] == [1, 4, 8, 16, 40, 64]
    with pytest.raises(ValueError, match="past the largest"):
        bucket(rows, 65)


def test_cuda_graphs_resolve_to_off_on_cpu_and_an_explicit_true_there_is_refused():
    assert EngineConfig(device="cpu").decode_graphed is False
    assert EngineConfig(device="cpu", cuda_graphs=False).decode_graphed is False
    with pytest.raises(ValueError, match="cuda_graphs: true needs a CUDA device"):
        _ = EngineConfig(device="cpu", cuda_graphs=True).decode_graphed


def test_cuda_graphs_true_with_lora_on_is_refused_naming_what_to_set():
    with pytest.raises(ValueError, match="cuda_graphs: true does not take LoRA rows yet: set max_loras: 0"):
        _ = EngineConfig(device="cpu", cuda_graphs=True, max_loras=2).decode_graphed
    assert EngineConfig(device="cpu", max_loras=2).decode_graphed is False


def test_an_engine_on_cpu_refuses_cuda_graphs_true_before_it_loads_weights(tiny_gpt2_dir):
    from engine import LLM

    with pytest.raises(ValueError, match="cuda_graphs: true needs a CUDA device, not cpu"):
        LLM(str(tiny_gpt2_dir), weights="pretrained", device="cpu", cuda_graphs=True, compile_decode=False)
    with pytest.raises(ValueError, match="cuda_graphs must be true, false or auto"):
        EngineConfig(cuda_graphs="yes")

