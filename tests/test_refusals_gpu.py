"""The NaN/inf refusals on CUDA: the check runs on the device (aminmax propagates NaN there too)."""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from samebits import LLM
from samebits.model.checkpoint_checks import refuse_non_finite
from samebits.model.config_files import UnsupportedCheckpointError
from samebits.model.qwen3_moe.loader import load_state_dict

pytestmark = pytest.mark.gpu
NORM = "model.norm.weight"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_found_on_the_device(dtype, bad):
    good = torch.randn(128, 1536, 64, device="cuda").to(dtype)
    refuse_non_finite([("good", good)], "probe")  # negative control: finite passes
    poisoned = good.clone()
    poisoned[77, 1000, 3] = bad
    with pytest.raises(UnsupportedCheckpointError, match=r"probe: 1 tensor\(s\) hold NaN or inf: bad;"):
        refuse_non_finite([("good", good), ("bad", poisoned)], "probe")


def test_cuda_load_and_update_refuse_nan(tiny, tmp_path):
    path = shutil.copytree(tiny, tmp_path / "nan")
    state = load_file(path / "model.safetensors")
    state[NORM] = state[NORM].clone().fill_(float("nan"))
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(UnsupportedCheckpointError, match=NORM):
        load_state_dict(path, device="cuda")
    llm = LLM(tiny, device="cuda", max_model_len=64)
    before = llm.weight_digests()
    with pytest.raises(ValueError, match=NORM):
        llm.update_weights({NORM: torch.full_like(llm._params[NORM], float("inf"))})
    assert llm.weight_digests() == before
