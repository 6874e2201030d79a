"""The vision tower against transformers' Qwen3_5VisionModel on tiny random configs: the merged patch embeddings
of images and videos of several grid sizes, fp32 on the CPU."""
import pytest
import torch

from engine.models.spec import vision_parameters
from engine.models.vision import VisionTower, vision_spec

CONFIG = {"depth": 2, "hidden_size": 64, "intermediate_size": 96, "num_heads": 4, "out_hidden_size": 48,
          "patch_size": 4, "temporal_patch_size": 2, "spatial_merge_size": 2, "in_channels": 3,
          "num_position_embeddings": 36, "hidden_act": "gelu_pytorch_tanh",
          "rope_parameters": {"rope_type": "axial", "rope_theta": 10000.0}}


@pytest.fixture(scope="module")
def towers():
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5VisionConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5VisionModel

    torch.manual_seed(0)
    ref = Qwen3_5VisionModel(Qwen3_5VisionConfig(**CONFIG)).float().eval()
    with torch.no_grad():
        for p in ref.parameters():  # random everywhere: zero biases or unit norms would hide a missing term
            p.copy_(torch.randn_like(p) * 0.1)
    weights = {k: v.detach().clone() for k, v in ref.state_dict().items()}
    return ref, VisionTower(vision_spec(CONFIG), weights)


@pytest.mark.parametrize("grids", [[(1, 4, 6)], [(1, 8, 8), (1, 2, 10)], [(3, 4, 4)], [(2, 6, 4), (1, 10, 2)]])
def test_merged_embeddings_equal_transformers(towers, grids):
    """One image (a grid not square), two images of other sizes (one larger than the learned 6x6 position
    grid), a 3-frame video, and a video beside an image: the embeddings of their pad tokens."""
    ref, tower = towers
    spec = tower.spec
    patches = sum(t * h * w for t, h, w in grids)
    pixels = torch.randn(patches, spec.patch_dim, generator=torch.Generator().manual_seed(len(grids) + patches))
    with torch.no_grad():
        want = ref(pixels, torch.tensor(grids)).pooler_output
        got = tower(pixels, grids)
    assert got.shape == (patches // 4, CONFIG["out_hidden_size"])
    assert ((got - want).norm() / want.norm()).item() < 1e-5


def test_pixels_that_do_not_match_the_grids_are_refused(towers):
    _, tower = towers
    with pytest.raises(ValueError, match="do not match"):
        tower(torch.randn(10, tower.spec.patch_dim), [(1, 4, 4)])


def test_the_memory_plan_counts_every_parameter_of_the_tower(towers):
    ref, _ = towers
    assert vision_parameters(CONFIG) == sum(p.numel() for p in ref.parameters())
