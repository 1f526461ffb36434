"""The plugin's counting wrapper under ``torch.compile``: the counter stays idle while dynamo traces, so the
compiled function is not guarded on it and is compiled once (it was recompiled at every call, which failed
transformers' ``test_generate_compile_model_forward_fullgraph`` in both runs); in eager every call counts."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

TOOLS = Path(__file__).resolve().parents[2] / "tools"


@pytest.fixture
def plugin(monkeypatch):
    """tools/transformers_sdpa_plugin.py, imported as pytest's ``-p`` imports it (tools/ on sys.path)."""
    monkeypatch.syspath_prepend(str(TOOLS))
    import transformers_sdpa_plugin

    return transformers_sdpa_plugin


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v)


def test_counter_is_idle_while_compiling_and_the_function_compiles_once(plugin) -> None:
    counter = plugin._Counter()
    counted = counter.wrap(attention)

    def layer(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return counted(q, k, v) * 2

    torch._dynamo.reset()
    compiled = torch.compile(layer, fullgraph=True, backend="eager")  # dynamo's guards alone decide recompiles
    g = torch.Generator().manual_seed(0)
    with torch._dynamo.config.patch(error_on_recompile=True):  # a second compile raises
        for _ in range(3):
            q, k, v = (torch.randn(1, 2, 5, 8, generator=g) for _ in range(3))
            torch.testing.assert_close(compiled(q, k, v), 2 * attention(q, k, v))
    # eager: every call counts
    before = counter.calls
    counted(q, k, v)
    counted(q, k, v)
    assert counter.calls == before + 2
