"""Model families: the Qwen3-Omni thinker gets what Qwen3-MoE has with no code of its own
(shared weights, the fast profile), and the engine and trainer stay family-blind."""

from __future__ import annotations

import ast
import json
import shutil
from pathlib import Path

import pytest
import torch
from omni_transformers import needs_omni_transformers

from samebits import LLM, SamplingParams, batch_invariant, trainer
from samebits.model import families
from samebits.model.config_files import UnsupportedCheckpointError
from samebits.model.families import check_checkpoint_config, family_for
from samebits.model.qwen3_moe.family import Qwen3MoeFamily
from samebits.model.qwen3_omni.family import Qwen3OmniFamily
from samebits.model.qwen3_omni.tiny import audio_part, build_tiny_omni_checkpoint, image_part, make_prompt

SRC = Path(__file__).resolve().parents[1] / "src" / "samebits"
MAX_LEN = 128


@pytest.fixture(scope="module")
def omni(tmp_path_factory):
    return build_tiny_omni_checkpoint(tmp_path_factory.mktemp("omni") / "c", seed=1, layout="thinker")


def _prompts():
    g = torch.Generator().manual_seed(7)
    return [
        make_prompt(1, [], [9]),
        make_prompt(2, [image_part(g, (1, 4, 4))], [4, 3]),
        make_prompt(3, [image_part(g, (1, 2, 4)), audio_part(g, 130)], [2, 3, 4]),
    ]


def _params(n, tokens=10):
    return [SamplingParams(temperature=1.0, max_tokens=tokens, ignore_eos=True, seed=20 + i) for i in range(n)]


@needs_omni_transformers
def test_omni_shared_weights_are_the_trainers_tensors_and_stay_bitwise(omni):
    hf = trainer.load_hf_thinker(omni)
    named = dict(hf.named_parameters())
    llm = LLM(omni, weights=hf.named_parameters(remove_duplicate=False), max_num_seqs=3, max_model_len=MAX_LEN)
    assert set(llm._params) == set(named)
    assert all(llm._params[n].data_ptr() == p.data_ptr() for n, p in named.items())  # no copy
    prompts = _prompts()
    outs = llm.generate(prompts, _params(3))
    seqs = [o.prompt_token_ids + o.token_ids for o in outs]
    lens = [len(o.prompt_token_ids) for o in outs]
    with batch_invariant():
        lps = trainer.token_logprobs(hf, seqs, lens, packed=True, multimodal=prompts)
    assert all(torch.equal(o.logprobs, lp) for o, lp in zip(outs, lps, strict=True))
    with torch.no_grad():  # an optimizer step on the trainer's tensor is in the engine at once
        named["lm_head.weight"].mul_(2)
    again = llm.generate(prompts[:1], _params(1))[0]
    assert not torch.equal(again.logprobs, outs[0].logprobs)


@pytest.mark.parametrize(
    "edit,match",
    [
        (lambda s: s.pop("model.visual.blocks.0.attn.qkv.weight"), r"vision encoder: missing model\.visual"),
        (lambda s: s.update({"model.extra.weight": torch.zeros(2)}), "unexpected thinker tensor model.extra"),
        (lambda s: s.update({"lm_head.weight": s["lm_head.weight"].float()}), "float32"),
    ],
)
@needs_omni_transformers
def test_omni_shared_weights_that_do_not_fit_are_refused_by_name(omni, edit, match):
    state = {n: p.detach() for n, p in trainer.load_hf_thinker(omni).named_parameters()}
    edit(state)
    with pytest.raises(ValueError, match=match):
        LLM(omni, weights=state.items(), max_model_len=64)


@needs_omni_transformers
def test_omni_fast_profile_runs_and_is_not_the_exact_numerics(omni):
    prompts, greedy = _prompts(), [SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)] * 3
    fast = LLM(omni, numerics="fast", max_num_seqs=3, max_model_len=MAX_LEN).generate(prompts, greedy)
    exact = LLM(omni, max_num_seqs=3, max_model_len=MAX_LEN).generate(prompts, greedy)
    assert all(len(o.token_ids) == 8 for o in fast)
    assert any(not torch.equal(a.logprobs, b.logprobs) for a, b in zip(fast, exact, strict=True))


def test_family_for_checkpoints_and_transformers_configs(omni, tiny):
    from transformers import AutoConfig

    assert family_for(omni) is Qwen3OmniFamily and family_for(tiny) is Qwen3MoeFamily
    assert family_for(AutoConfig.from_pretrained(omni)) is Qwen3OmniFamily
    assert family_for(AutoConfig.from_pretrained(tiny)) is Qwen3MoeFamily


class _PlantedFamily(Qwen3MoeFamily):
    """A family known only to the registry: its configs carry model_type "planted"."""

    @classmethod
    def matches(cls, config: dict) -> bool:
        return config.get("model_type") == "planted"

    @classmethod
    def read_config(cls, path):
        return ("planted", Path(path).name)


def test_check_checkpoint_config_asks_the_registry(tiny, tmp_path, monkeypatch):
    planted = tmp_path / "planted"
    shutil.copytree(tiny, planted)
    cfg = planted / "config.json"
    cfg.write_text(json.dumps(json.loads(cfg.read_text()) | {"model_type": "planted"}))
    with pytest.raises(UnsupportedCheckpointError, match="model_type 'planted'"):  # control: unknown
        check_checkpoint_config(planted)
    monkeypatch.setattr(families, "FAMILIES", (_PlantedFamily, *families.FAMILIES))
    assert check_checkpoint_config(planted) == ("planted", "planted")  # one registry line, no other
    assert check_checkpoint_config(tiny) == Qwen3MoeFamily.read_config(tiny)


def _registry_bypasses(src: Path) -> list[str]:
    """Files that know a family outside the registry: any module but `model/families.py` and the
    family's own folder importing its `family` module, and `families.py` importing from a family
    folder anything but the family class itself (a config class or a helper of one family)."""
    folders = {p.parent.name for p in (src / "model").glob("*/family.py")}
    found = []
    for f in src.rglob("*.py"):
        rel = f.relative_to(src)
        own = rel.parts[0] == "model" and len(rel.parts) > 2 and rel.parts[1]
        for node in ast.walk(ast.parse(f.read_text())):
            if not isinstance(node, ast.ImportFrom) or not node.module:
                continue
            parts = node.module.split(".")
            if parts[:2] != ["samebits", "model"] or len(parts) < 3 or parts[2] not in folders:
                continue
            if parts[2] == own:
                continue
            if rel == Path("model/families.py"):
                if parts[3:] != ["family"] or not all(a.name.endswith("Family") for a in node.names):
                    found.append(f"{rel}: {node.module}")
            elif parts[3:] == ["family"]:
                found.append(f"{rel}: {node.module}")
    return sorted(found)


def test_only_the_registry_knows_the_families():
    assert _registry_bypasses(SRC) == []


def test_a_family_named_outside_the_registry_is_caught(tmp_path):
    src = tmp_path / "samebits"
    (src / "model" / "fam").mkdir(parents=True)
    (src / "model" / "fam" / "family.py").write_text("from samebits.model.fam.config import C\n")
    (src / "model" / "families.py").write_text(
        "from samebits.model.fam.family import FamFamily\nfrom samebits.model.fam.config import C\n"
    )
    (src / "engine").mkdir()
    (src / "engine" / "core.py").write_text("from samebits.model.fam.family import FamFamily\n")
    assert _registry_bypasses(src) == [
        "engine/core.py: samebits.model.fam.family",
        "model/families.py: samebits.model.fam.config",
    ]


def _samebits_imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    return {n for n in names if n.startswith("samebits")}


@pytest.mark.parametrize("layer", ["model", "trainer", "requests"])
def test_model_trainer_and_requests_do_not_import_the_engine(layer):
    bad = {
        str(f.relative_to(SRC)): sorted(i for i in _samebits_imports(f) if i.startswith("samebits.engine"))
        for f in (SRC / layer).rglob("*.py")
    }
    assert not {f: i for f, i in bad.items() if i}


def test_no_engine_file_is_specific_to_a_model_family():
    for f in (SRC / "engine").glob("*.py"):
        imports = _samebits_imports(f)
        assert not [i for i in imports if "omni" in i or i.endswith("qwen3_moe")], f.name
        assert "omni" not in f.read_text().lower(), f.name
