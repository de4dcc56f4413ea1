# engine/kernels/inductor.py's compile_for on CPU: a frozen graph with the C++ wrapper (the decode
# graph's settings) writes the same source for the same graph whatever its weights' tensors,
# so inductor's disk cache builds its C++ once per machine, not once per process; and graphs
# that share that source still compute with their own weights.
from __future__ import annotations

import torch
from torch._inductor.utils import run_and_get_code

from engine.kernels.inductor import compile_for


def frozen_linear(seed: int) -> tuple[torch.nn.Linear, object]:
    torch.manual_seed(seed)
    layer = torch.nn.Linear(64, 32).eval()  # big enough that inductor passes it in, not inlines it
    return layer, compile_for(torch.device("cpu"), lambda x: torch.relu(layer(x)) * 2.0, freezing=True,
                              cpp_wrapper=True)


def test_two_frozen_graphs_with_the_same_shapes_write_the_same_cpp_wrapper_source() -> None:
    x = torch.randn(4, 64)
    sources = []
    with torch.no_grad():
        for seed in (0, 1):
            _, compiled = frozen_linear(seed)
            _, code = run_and_get_code(compiled, x)
            sources.append("\n".join(code))
    assert "cpp_wrapper_src" in sources[0]  # the C++ wrapper, not Python's
    assert sources[0] == sources[1]


def test_graphs_sharing_one_wrapper_each_compute_with_their_own_weights() -> None:
    x = torch.randn(4, 64)
    with torch.no_grad():
        graphs = [frozen_linear(seed) for seed in (2, 3)]
        for layer, compiled in graphs:
            torch.testing.assert_close(compiled(x), torch.relu(layer(x)) * 2.0)
        assert not torch.allclose(graphs[0][1](x), graphs[1][1](x))
