"""The Qwen3-Omni thinker: loading, positions, multimodal prompts and rollout-vs-trainer parity,
bitwise, on a tiny random thinker saved by transformers in the released layout."""

from __future__ import annotations

import json

import pytest
import torch
from omni_transformers import skip_module_without_omni_transformers

from samebits import LLM, SamplingParams, batch_invariant, trainer
from samebits.engine.digest import tensor_digest
from samebits.engine.scheduler import ScheduledBatch, ScheduledChunk
from samebits.engine.sequence import Sequence
from samebits.model.config_files import UnsupportedCheckpointError
from samebits.model.qwen3_omni.loader import load_thinker_weights
from samebits.model.qwen3_omni.model import SplitResidualDeepstackTextModel, ThinkerTextModel
from samebits.model.qwen3_omni.tiny import (
    audio_part,
    build_tiny_omni_checkpoint,
    build_tiny_thinker,
    image_part,
    make_prompt,
)
from samebits.requests import MultimodalPrompt

skip_module_without_omni_transformers()  # PROMPTS below call transformers' audio lengths

MAX_LEN = 160


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("omni")
    return {
        "full": build_tiny_omni_checkpoint(root / "full", seed=0, layout="full", per_expert_layout=True),
        "thinker": build_tiny_omni_checkpoint(
            root / "thinker", seed=0, layout="thinker", per_expert_layout=False
        ),
        "no_audio": build_tiny_omni_checkpoint(root / "no_audio", seed=0, layout="thinker", audio=False),
    }


def _prompts() -> dict[str, MultimodalPrompt]:
    g = torch.Generator().manual_seed(3)
    return {
        "text": make_prompt(1, [], [11]),
        "image": make_prompt(2, [image_part(g, (1, 4, 6))], [5, 4]),
        "video": make_prompt(3, [image_part(g, (2, 4, 4), video=True, seconds=0.5)], [3, 6]),
        "audio": make_prompt(4, [audio_part(g, 230)], [4, 3]),
        "mixed": make_prompt(
            5,
            [image_part(g, (1, 2, 4)), audio_part(g, 130), image_part(g, (2, 2, 2), video=True)],
            [2, 3, 2, 5],
        ),
    }


PROMPTS = _prompts()
KINDS = list(PROMPTS)


def _params(n: int, tokens: int = 14):
    return [SamplingParams(temperature=1.0, max_tokens=tokens, ignore_eos=True, seed=10 + i) for i in range(n)]


def _recompute(path, outs, packed, **impl):
    model = trainer.load_hf_thinker(path, **impl)
    seqs = [o.prompt_token_ids + o.token_ids for o in outs]
    with batch_invariant():
        return trainer.token_logprobs(
            model,
            seqs,
            [len(o.prompt_token_ids) for o in outs],
            packed=packed,
            multimodal=list(PROMPTS.values()),
        )


def _mismatches(outs, lps) -> dict[str, int]:
    return {k: int((o.logprobs != lp).sum()) for k, o, lp in zip(KINDS, outs, lps, strict=True)}


@pytest.fixture(scope="module")
def rollout(ckpts):
    """All five prompts batched with chunked prefill (chunks split the placeholder runs), and each alone."""
    path = ckpts["full"]
    batched = LLM(path, max_num_seqs=5, max_model_len=MAX_LEN, max_num_batched_tokens=24)
    outs = batched.generate(list(PROMPTS.values()), _params(len(PROMPTS)))
    llm = LLM(path, max_num_seqs=2, max_model_len=MAX_LEN)
    alone = [llm.generate([p], [sp])[0] for p, sp in zip(PROMPTS.values(), _params(len(PROMPTS)), strict=True)]
    return llm, outs, alone


# -- loading ------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["full", "thinker"])
@pytest.mark.parametrize("per_expert", [True, False], ids=["released_names", "transformers5_names"])
def test_every_layout_loads_to_transformers_tensors(tmp_path, layout, per_expert):
    """Released names (thinker.model.layers, thinker.visual, per-expert) and transformers 5.x names
    (model.language_model, model.visual, fused experts), full Omni or thinker only."""
    path = build_tiny_omni_checkpoint(tmp_path / "c", seed=0, layout=layout, per_expert_layout=per_expert)
    names = json.dumps(sorted(_disk_names(path)))
    assert ('"talker.' in names and '"code2wav.' in names) == (layout == "full")
    assert ('.mlp.experts.0.gate_proj.weight"' in names) == per_expert
    assert ("model.language_model." in names) != per_expert
    ref = dict(build_tiny_thinker(seed=0).named_parameters())
    llm = LLM(path, max_model_len=64)
    ours = dict(llm.model.named_parameters())
    assert set(ours) == set(ref)  # HF 5.x thinker names: update_weights needs no conversion
    for name, p in ours.items():
        assert torch.equal(p, ref[name]), name


def test_trainer_loads_the_same_weights_and_syncs_by_name(ckpts, rollout):
    llm = rollout[0]
    hf = trainer.load_hf_thinker(ckpts["full"])
    params = dict(hf.named_parameters())
    assert all(torch.equal(p, params[n]) for n, p in llm.model.named_parameters())
    with torch.no_grad():
        for name in (
            "model.visual.blocks.0.attn.qkv.weight",
            "model.language_model.layers.0.mlp.experts.down_proj",
        ):
            params[name].mul_(0.5)
    names = list(params)
    before = llm.weight_digests(names)
    try:
        llm.update_weights(hf.named_parameters())
        assert llm.weight_digests(names) == {n: tensor_digest(p) for n, p in params.items()}
    finally:
        llm.update_weights(trainer.load_hf_thinker(ckpts["full"]).named_parameters())
    assert llm.weight_digests(names) == before
    assert load_thinker_weights(ckpts["no_audio"])[1].audio is None


def test_missing_encoder_tensor_refused_by_name(ckpts, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    path = shutil.copytree(ckpts["thinker"], tmp_path / "bad")
    f = next(path.glob("*.safetensors"))
    state = load_file(str(f))
    del state["model.visual.blocks.1.mlp.linear_fc2.bias"]
    save_file(state, str(f), metadata={"format": "pt"})
    with pytest.raises(
        UnsupportedCheckpointError, match=r"vision encoder: 1 tensor\(s\) missing.*blocks\.1\.mlp"
    ):
        LLM(path, max_model_len=64)


def _disk_names(path) -> set[str]:
    from safetensors import safe_open

    names = set()
    for f in path.glob("*.safetensors"):
        with safe_open(str(f), framework="pt") as fh:
            names |= set(fh.keys())
    return names


def test_unsupported_thinker_configs_refused(ckpts, tmp_path):
    import shutil

    path = shutil.copytree(ckpts["thinker"], tmp_path / "bad")
    cfg = json.loads((path / "config.json").read_text())
    cfg["text_config"]["rope_parameters"]["mrope_section"] = [4, 4, 5]
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedCheckpointError, match="mrope_section"):
        LLM(path, max_model_len=64)
    cfg["text_config"]["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedCheckpointError, match="rope_type"):
        LLM(path, max_model_len=64)


# -- positions ----------------------------------------------------------------------------


def test_decode_positions_continue_as_transformers(ckpts, rollout):
    """transformers' compute_3d_position_ids with a KV cache of length j gives j + rope_delta."""
    llm = rollout[0]
    model = trainer.load_hf_thinker(ckpts["full"])
    for kind in ("image", "video", "mixed"):
        state = llm.family.prepare(0, PROMPTS[kind], PROMPTS[kind].prompt_token_ids)
        p = state.positions.shape[1]
        model.model.rope_deltas = state.rope_delta.view(1, 1)
        for j in (p, p + 7):
            hf = model.model.compute_3d_position_ids(
                input_ids=None, image_grid_thw=None, video_grid_thw=None, attention_mask=None,
                inputs_embeds=torch.zeros(1, 1, 96), past_key_values=_Cache(j),
            )  # fmt: skip
            assert torch.equal(state.positions_for(j, j + 1), hf[:, 0]), (kind, j)


class _Cache:
    def __init__(self, n):
        self.n = n

    def get_seq_length(self):
        return self.n


# -- parity -------------------------------------------------------------------------------


def test_rollout_alone_equals_batched_with_chunked_prefill(rollout):
    _, outs, alone = rollout
    for kind, a, b in zip(KINDS, alone, outs, strict=True):
        assert a.token_ids == b.token_ids, kind
        assert torch.equal(a.logprobs, b.logprobs), kind


@pytest.mark.parametrize("packed", [False, True], ids=["one_at_a_time", "packed"])
def test_rollout_equals_trainer_bitwise(ckpts, rollout, packed):
    _, outs, _ = rollout
    lps = _recompute(ckpts["full"], outs, packed)
    assert all(lp.dtype == torch.float32 for lp in lps)
    assert _mismatches(outs, lps) == dict.fromkeys(KINDS, 0)


def test_negative_control_deepstack_into_split_residual(ckpts, rollout):
    """The rollout with deepstack added to the split residual: visual prompts mismatch, others not."""
    llm, outs, _ = rollout
    text_model = llm.model.model.language_model
    text_model.__class__ = SplitResidualDeepstackTextModel  # same weights, only the deepstack order changes
    try:
        wrong = llm.generate(list(PROMPTS.values()), _params(len(PROMPTS)))
    finally:
        text_model.__class__ = ThinkerTextModel
    lps = _recompute(ckpts["full"], wrong, packed=True)  # the trainer on the wrong rollout's own tokens
    counts = _mismatches(wrong, lps)
    assert counts["text"] == 0 and counts["audio"] == 0, counts
    assert counts["image"] > 0 and counts["video"] > 0 and counts["mixed"] > 0, counts


def test_negative_control_split_residual_differs_from_visual_rows_on(rollout):
    """Prefill hidden states: identical before the first visual row, different on and after it."""
    llm = rollout[0]
    prompt = PROMPTS["image"]
    state = llm.family.prepare(0, prompt, prompt.prompt_token_ids)
    hidden = {}
    for cls in (ThinkerTextModel, SplitResidualDeepstackTextModel):
        seq = Sequence(0, 0, prompt.prompt_token_ids, SamplingParams())
        seq.family_state, seq.block_table = state, list(range(4))
        batch = ScheduledBatch([ScheduledChunk(seq, 0, seq.num_tokens)])
        llm.model.model.language_model.__class__ = cls
        try:
            with torch.inference_mode(), batch_invariant():
                hidden[cls], _ = llm.runner.forward(batch)
        finally:
            llm.model.model.language_model.__class__ = ThinkerTextModel
    first = int(state.visual_index[0])
    a, b = hidden[ThinkerTextModel], hidden[SplitResidualDeepstackTextModel]
    assert torch.equal(a[:first], b[:first])
    assert not torch.equal(a[first], b[first])
    assert all(not torch.equal(a[i], b[i]) for i in state.visual_index.tolist())
    assert not torch.equal(a[-1], b[-1])


def test_negative_control_stock_experts_in_trainer(ckpts, rollout):
    """A formula control: grouped_mm rounds once more than samebits' experts."""
    _, outs, _ = rollout
    lps = _recompute(ckpts["full"], outs, packed=True, experts_implementation="grouped_mm")
    assert sum(_mismatches(outs, lps).values()) > 0


# -- bad input ----------------------------------------------------------------------------


def _bad_prompts():
    image, audio, video = PROMPTS["image"], PROMPTS["audio"], PROMPTS["video"]
    ids = image.prompt_token_ids
    extra = ids[:3] + [380] + ids[3:]  # one image placeholder too many
    return {
        "placeholder count": (MultimodalPrompt(extra, image.pixel_values, image.image_grid_thw), "placeholder"),
        "missing grid": (MultimodalPrompt(ids, pixel_values=image.pixel_values), "without image_grid_thw"),
        "no tensors": (MultimodalPrompt(ids), "no pixel_values"),
        "pixels vs grid": (MultimodalPrompt(ids, image.pixel_values[:-1], image.image_grid_thw), "patches"),
        "video seconds": (
            MultimodalPrompt(video.prompt_token_ids, pixel_values_videos=video.pixel_values_videos,
                             video_grid_thw=video.video_grid_thw), "video_second_per_grid"),
        "audio mask": (MultimodalPrompt(audio.prompt_token_ids, input_features=audio.input_features),
                       "feature_attention_mask"),
        "audio length": (
            MultimodalPrompt(audio.prompt_token_ids, input_features=audio.input_features[..., :120],
                             feature_attention_mask=audio.feature_attention_mask[:, :120]), "audio"),
        "processor keys": ({"input_ids": [ids], "pixel_valuez": image.pixel_values}, "unknown"),
    }  # fmt: skip


def test_bad_multimodal_input_refused_by_request_and_engine_usable(rollout):
    llm, outs, _ = rollout
    good = list(PROMPTS.values())[:2]
    for name, (bad, match) in _bad_prompts().items():
        with pytest.raises(ValueError, match=rf"request 2: .*{match}"):
            llm.generate([*good, bad], _params(3))
        assert not llm.scheduler.has_unfinished(), name
    again = llm.generate(good, _params(2))
    for a, b in zip(again, outs[:2], strict=True):
        assert torch.equal(a.logprobs, b.logprobs)


def test_modality_without_encoder_refused(ckpts, tiny):
    llm = LLM(ckpts["no_audio"], max_num_seqs=2, max_model_len=MAX_LEN)
    with pytest.raises(ValueError, match="request 1: .*no audio encoder"):
        llm.generate([PROMPTS["image"], PROMPTS["audio"]], _params(2, 4))
    assert len(llm.generate([PROMPTS["image"]], _params(1, 4))[0].token_ids) == 4
    text_llm = LLM(tiny, max_model_len=64)
    with pytest.raises(ValueError, match="request 0: .*Qwen3-Omni"):
        text_llm.generate([PROMPTS["image"]], _params(1, 4))


def test_placeholders_never_sampled(ckpts):
    llm = LLM(ckpts["thinker"], max_num_seqs=1, max_model_len=MAX_LEN)
    out = llm.generate(
        [PROMPTS["text"]], [SamplingParams(temperature=5.0, max_tokens=120, ignore_eos=True, seed=0)]
    )
    assert not set(out[0].token_ids) & set(llm.family.never_sample)
