"""Running a script under Triton's CPU interpreter (TRITON_INTERPRET=1), for kernel tests that
need no GPU. Skips without Triton (CI installs none; the GPU tests cover the same kernels)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

PRELUDE = """
import torch, triton
import triton.runtime.interpreter as _ti
_patch = _ti._patch_lang_tensor
def _patch_index(tensor, scope):  # numpy >= 2.4 refuses int() of a 1-element array (loop bounds)
    _patch(tensor, scope)
    scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))
_ti._patch_lang_tensor = _patch_index
torch.Tensor.is_cuda = property(lambda self: True)
"""


def run_interpreted(script: str, timeout: float = 300) -> None:
    """Runs PRELUDE + script in a fresh interpreter process; the script must print OK last."""
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = subprocess.run(
        [sys.executable, "-c", PRELUDE + script], env=env, capture_output=True, text=True, timeout=timeout
    )
    assert out.returncode == 0 and out.stdout.strip().endswith("OK"), out.stderr[-2000:]
