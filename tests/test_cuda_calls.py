"""The CUDA-only calls' table (`pretrain.testing.cuda_calls`): every call binds against the
installed function's signature and runs where it can without a GPU, and the table lists every
place `pretrain/` makes one."""
from __future__ import annotations

import ast

import pytest

from pretrain.testing import cuda_calls
from pretrain.testing.cuda_calls import CUDA_CALLS, call_sites, check, listed_sites


@pytest.mark.parametrize("call", CUDA_CALLS, ids=[c.name for c in CUDA_CALLS])
def test_each_cuda_only_call_binds_to_the_installed_function(call):
    row = check(call)
    assert row.ok, row.problem
    if row.found:
        assert row.bound
    if call.run is not None and row.found:
        assert row.ran in ("meta", "cpu"), row.ran


def test_the_table_lists_every_cuda_only_call_site():
    found, listed = call_sites(), listed_sites()
    assert not found - listed, f"CUDA-only calls missing from CUDA_CALLS: {sorted(found - listed)}"
    assert not listed - found, f"CUDA_CALLS lists calls pretrain/ no longer makes: " \
                               f"{sorted(listed - found)}"


def test_the_walk_finds_each_kind_of_call():
    source = """
import pynvml
from torch.nn.attention.varlen import varlen_attn
y = torch._grouped_mm(a, b, offs=o)
torch.cuda.synchronize(); torch.cuda.is_available()
opt = torch.optim.AdamW(params, fused=True)
params.setdefault("fused", True)
accel.max_memory_allocated()
handle = nvml.nvmlDeviceGetHandleByIndex(0)
"""
    assert cuda_calls._sites_in(ast.parse(source)) == {
        "pynvml", "varlen_attn", "torch._grouped_mm", "torch.cuda.synchronize", "fused",
        "max_memory_allocated", "nvml.nvmlDeviceGetHandleByIndex"}


def test_a_renamed_keyword_fails_its_row(monkeypatch):
    """A torch whose function lost a keyword the stack passes: the row says which."""
    def varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False):
        raise AssertionError("never called")

    monkeypatch.setattr(cuda_calls, "resolve", lambda target: varlen_attn)
    call = cuda_calls.CudaCall("varlen", "torch:varlen_attn",
                               lambda: (tuple(range(7)), {"window_size": (-1, 0)}), sites=())
    row = check(call)
    assert not row.ok and not row.bound and "window_size" in row.problem
