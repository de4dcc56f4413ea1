"""One CPU probe decides every ISA-dependent path: it reports what torch and oneDNN will
run, RAYINFER_CPU_ISA can only lower it, and the engine logs the path it took."""

from __future__ import annotations

import logging

import pytest
import torch

from engine import LLM, EngineConfig
from engine.kernels import cpu
from engine.kernels.inductor import inductor_options


@pytest.fixture
def isa_cap(monkeypatch):
    """Set RAYINFER_CPU_ISA for one test; the probe is re-read before and after."""

    def cap(level: str) -> cpu.CpuFeatures:
        monkeypatch.setenv(cpu.ISA_ENV, level)
        cpu.cpu_features.cache_clear()
        return cpu.cpu_features()

    yield cap
    monkeypatch.delenv(cpu.ISA_ENV, raising=False)
    cpu.cpu_features.cache_clear()


def test_probe_reports_what_torch_and_onednn_run(isa_cap):
    features = isa_cap("")
    assert features.aten_capability == torch.backends.cpu.get_cpu_capability()
    assert features.onednn_bf16 == (torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())
    assert features.avx512 == features.aten_capability.startswith("AVX512")
    assert not features.has_fast_bf16 or features.onednn_bf16


def test_isa_cap_at_avx2_turns_off_every_avx512_path(isa_cap):
    features = isa_cap("avx2")
    assert not (features.avx512 or features.avx512_bf16 or features.amx or features.onednn_bf16)
    assert features.isa in ("baseline", "avx2")
    assert not features.can_pack(torch.bfloat16)
    assert EngineConfig(dtype="auto", device="cpu").torch_dtype == torch.float32


def test_isa_cap_never_raises_what_the_cpu_reports(isa_cap):
    real = isa_cap("")
    assert isa_cap("amx") == real


def test_unknown_isa_cap_is_an_error_naming_the_variable(isa_cap):
    with pytest.raises(ValueError, match=cpu.ISA_ENV):
        isa_cap("avx9000")


def test_dtype_auto_is_bf16_exactly_where_bf16_is_native(isa_cap):
    features = isa_cap("")
    expected = torch.bfloat16 if features.has_fast_bf16 else torch.float32
    assert EngineConfig(dtype="auto", device="cpu").torch_dtype == expected


def test_engine_logs_the_cpu_and_linear_path_once_at_startup(tiny_gpt2_dir, caplog):
    with caplog.at_level(logging.INFO, logger="engine.core.llm_engine"):
        LLM(str(tiny_gpt2_dir), weights="pretrained", dtype="float32", device="cpu", compile_decode=False)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("CPU: ")]
    assert len(lines) == 1
    assert cpu.cpu_features().isa in lines[0] and "linears: " in lines[0]


def test_compiled_kernels_are_tiled_for_the_width_the_probe_allows(isa_cap):
    real = isa_cap("")
    if not real.avx2:
        pytest.skip(f"no x86 vector ISA to cap ({real.summary()})")
    assert inductor_options(torch.device("cpu")) == {"cpp.simdlen": 512 if real.avx512 else 256}
    isa_cap("avx2")
    assert inductor_options(torch.device("cpu")) == {"cpp.simdlen": 256}
    assert inductor_options(torch.device("meta")) == {}
