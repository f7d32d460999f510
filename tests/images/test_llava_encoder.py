"""LLaVA-1.5's image encoder (CLIP vision tower + MLP projector) equals transformers' get_image_features on a
tiny random model, for both feature strategies and any feature layer; an image's features do not depend on the
other images of its call."""
from __future__ import annotations

import pytest
import torch

from batchjob.models.families.llava import canonical_name
from batchjob.models.vision.llava import LlavaImageEncoder, LlavaVisionConfig

transformers = pytest.importorskip("transformers")


def tiny_llava(select: str, layer: int):
    vision = transformers.CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                           num_attention_heads=4, patch_size=14, image_size=56)
    text = transformers.LlamaConfig(vocab_size=600, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2)
    cfg = transformers.LlavaConfig(vision_config=vision, text_config=text, image_token_index=599,
                                   vision_feature_select_strategy=select, vision_feature_layer=layer)
    torch.manual_seed(0)
    model = transformers.LlavaForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "vision_tower" in name or "projector" in name:
                p.normal_(0, 0.2)  # default init leaves a random tower's output nearly constant
    return model


@pytest.mark.parametrize("select,layer", [("default", -2), ("full", -1), ("default", 1)])
def test_image_features_are_transformers(select, layer):
    model = tiny_llava(select, layer)
    cfg = LlavaVisionConfig.from_hf(model.config.to_dict(), "tiny llava")
    assert cfg.tokens_per_image == 16 + (select == "full")
    weights = {canonical_name(k): v.detach().clone() for k, v in model.state_dict().items()}
    encoder = LlavaImageEncoder(cfg, weights, torch.float32)
    assert not [k for k in weights if "vision_tower" in k or "projector" in k]  # every vision weight taken
    pixels = torch.randn(3, 3, 56, 56, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = torch.stack(model.get_image_features(pixels, vision_feature_layer=layer,
                                                    vision_feature_select_strategy=select).pooler_output)
        got = encoder(pixels)
    assert got.shape == want.shape == (3, cfg.tokens_per_image, 48)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(encoder(pixels[1:2])[0], got[1])  # alone = with others
    vision = {canonical_name(k): tuple(v.shape) for k, v in model.state_dict().items()
              if "vision_tower" in k or "projector" in k}
    assert cfg.weight_shapes() == vision


def test_the_saved_checkpoints_names_load_too(tmp_path):
    """What save_pretrained writes (vision_tower., multi_modal_projector.) maps to the names the in-memory ones do."""
    from safetensors.torch import load_file

    model = tiny_llava("default", -2)
    model.save_pretrained(tmp_path)
    weights = {canonical_name(k): v for k, v in load_file(str(tmp_path / "model.safetensors")).items()}
    cfg = LlavaVisionConfig.from_hf(model.config.to_dict(), "tiny llava")
    encoder = LlavaImageEncoder(cfg, weights, torch.float32)
    pixels = torch.randn(1, 3, 56, 56, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = model.get_image_features(pixels).pooler_output[0]
    torch.testing.assert_close(encoder(pixels)[0], want, rtol=1e-5, atol=1e-5)
