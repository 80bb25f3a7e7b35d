"""Qwen3-Omni needs transformers >= OMNI_TRANSFORMERS (5.21); Qwen3-MoE runs from 5.10.4.

Below 5.21 every construction of the thinker, engine or trainer, is refused with what to do;
at 5.21 and newer the same constructions succeed. Which of the two runs is decided by the
installed version (`omni_transformers.OMNI_RUNS`), so the pair cannot pass vacuously; the
version check itself is also run on faked versions, each side of the line."""

from __future__ import annotations

import pytest
import torch
import transformers
from omni_transformers import OMNI_RUNS, needs_omni_transformers

from samebits import LLM, trainer
from samebits.model.config_files import UnsupportedCheckpointError
from samebits.model.families import check_checkpoint_config
from samebits.model.qwen3_omni.config import OMNI_TRANSFORMERS, check_omni_transformers
from samebits.model.qwen3_omni.tiny import build_tiny_omni_checkpoint


@pytest.fixture(scope="module")
def omni(tmp_path_factory):
    root = tmp_path_factory.mktemp("omni_floor")
    return {lay: build_tiny_omni_checkpoint(root / lay, seed=0, layout=lay) for lay in ("thinker", "full")}


def _users_thinker_logprobs(path):
    """`token_logprobs` on a thinker the user built with transformers alone (not `load_hf_thinker`)."""
    from transformers import Qwen3OmniMoeThinkerForConditionalGeneration

    model = Qwen3OmniMoeThinkerForConditionalGeneration.from_pretrained(path, dtype=torch.float32)
    return trainer.token_logprobs(model, [[3, 4, 5, 6, 7]], [2])


CONSTRUCTIONS = {
    "LLM": lambda path: LLM(path, max_model_len=64),
    "load_hf_thinker": trainer.load_hf_thinker,
    "load_hf_model": trainer.load_hf_model,  # refused before a weight is read, as the engine refuses
    "check_checkpoint_config": check_checkpoint_config,
}
REFUSED = rf"Qwen3-Omni needs transformers>={OMNI_TRANSFORMERS}.*you have {transformers.__version__}"


@pytest.mark.skipif(OMNI_RUNS, reason=f"transformers {transformers.__version__} runs Qwen3-Omni")
@pytest.mark.parametrize("layout", ["thinker", "full"])
@pytest.mark.parametrize("build", CONSTRUCTIONS)
def test_omni_refused_at_construction_below_its_transformers(omni, build, layout):
    with pytest.raises(UnsupportedCheckpointError, match=REFUSED) as err:
        CONSTRUCTIONS[build](omni[layout])
    assert f"pip install 'transformers>={OMNI_TRANSFORMERS},<6'" in str(err.value)


@pytest.mark.skipif(OMNI_RUNS, reason=f"transformers {transformers.__version__} runs Qwen3-Omni")
def test_token_logprobs_on_a_users_thinker_refused_below_its_transformers(omni):
    with pytest.raises(UnsupportedCheckpointError, match=REFUSED):
        _users_thinker_logprobs(omni["thinker"])


@needs_omni_transformers
@pytest.mark.parametrize("layout", ["thinker", "full"])
@pytest.mark.parametrize("build", [b for b in CONSTRUCTIONS if b != "load_hf_model"])
def test_omni_built_at_its_transformers(omni, build, layout):
    """The control: the same constructions succeed (`load_hf_model` is for Qwen3-MoE)."""
    assert CONSTRUCTIONS[build](omni[layout]) is not None


@needs_omni_transformers
def test_token_logprobs_on_a_users_thinker_runs_at_its_transformers(omni):
    (lp,) = _users_thinker_logprobs(omni["thinker"])
    assert lp.shape == (3,) and bool(torch.isfinite(lp).all())


@pytest.mark.parametrize("version", ["5.10.4", "5.20.2", "4.57.6"])
def test_the_check_refuses_an_older_transformers_by_version(version):
    with pytest.raises(UnsupportedCheckpointError, match=rf"needs transformers>=5\.21.*you have {version}"):
        check_omni_transformers(version)


@pytest.mark.parametrize("version", ["5.21.0", "5.23.0", "5.25.0", "6.0.0"])
def test_the_check_passes_5_21_and_newer(version):
    check_omni_transformers(version)  # no refusal; pyproject's <6 is pip's to enforce
