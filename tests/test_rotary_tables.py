"""The rotary tables are the same in every process. oneMKL picks a float unary op's kernel at its
first call, and first calls made at once from torch's threads can run a low-accuracy kernel on
one thread's part (pytorch/pytorch#188792): on an Intel Xeon with AMX the tables' first `cos`
came out off by up to 1.5e-4 on half their rows in 2 to 4 processes of 10, and a request's
greedy tokens with them. `warm_up_torch_math` runs before the tables are built; each fresh
process below builds them first thing, as an engine does, and must get the accurate table."""

from __future__ import annotations

import subprocess
import sys

_CHILD = """
import torch
torch.set_num_threads(2)
from quire.layers.rotary import RopeConfig, RotaryEmbedding, _inv_freq
rope = RopeConfig(theta=100000.0)
rotary = RotaryEmbedding(64, 160, rope)
positions = torch.arange(160, dtype=torch.float32)
angles = torch.outer(positions, _inv_freq(64, rope)).double()  # the tables' float32 angles
angles = torch.cat([angles, angles], dim=-1)
for table, exact in ((rotary.cos_cache, angles.cos()), (rotary.sin_cache, angles.sin())):
    error = (table.double() - exact).abs().max().item()
    assert error < 1e-6, f"a table off by {error:.2e}"
"""


def test_each_fresh_process_builds_accurate_rotary_tables():
    for _ in range(6):  # unwarmed, about a third of processes failed
        result = subprocess.run(
            [sys.executable, "-c", _CHILD], capture_output=True, text=True, timeout=120
        )
        assert result.returncode == 0, result.stderr[-2000:]
