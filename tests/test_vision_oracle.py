"""Prompts with images against transformers' Qwen3_5ForConditionalGeneration on a tiny random vision-language
folder written through transformers (fp32, CPU): the tower loaded from the checkpoint, the pads' embeddings
spliced in, the interleaved M-RoPE positions of the image tokens and of the text after them; prompt logits
(whole and in chunks that split an image) and greedy decoding through the Engine API."""
import pytest
import torch

from engine import FinishEvent, SamplingParams
from engine.media.image import Image, image_input
from engine.media.prompt import expand_pads, prompt_media

from .conftest import admitted_together, rel_error

transformers = pytest.importorskip("transformers")

@pytest.fixture(scope="module")
def ref(vl_folder):
    from transformers import Qwen3_5ForConditionalGeneration

    return Qwen3_5ForConditionalGeneration.from_pretrained(str(vl_folder), dtype=torch.float32).eval()


def random_image(grid: tuple[int, int, int], seed: int) -> Image:
    """An image of random patches on `grid` (the tower's input without a file; preprocessing is tested apart)."""
    n = grid[0] * grid[1] * grid[2]
    pixels = torch.randn(n, 3 * 2 * 16, generator=torch.Generator().manual_seed(seed))
    return Image(pixels, grid, n // 4, bytes([seed, *grid]) * 8)  # a digest of what makes it


def template_ids(engine, images: list[Image], seed: int = 0) -> list[int]:
    """Text, then each image as the chat template writes it (one pad between the vision markers), then text."""
    v = engine.vision
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 256, (9,), generator=g).tolist()
    for _ in images:
        text = torch.randint(0, 256, (5,), generator=g).tolist()
        ids += [v.vision_start_id, v.image_token_id, v.vision_end_id, *text]
    return ids


def pads(engine) -> tuple[int, int]:
    return engine.vision.image_token_id, engine.vision.video_token_id


def ref_inputs(engine, ids: list[int], images: list[Image]) -> dict:
    full = torch.tensor([ids])
    return {"input_ids": full, "pixel_values": torch.cat([i.pixels for i in images]),
            "image_grid_thw": torch.tensor([i.grid for i in images]),
            "mm_token_type_ids": (full == engine.vision.image_token_id).int()}


def our_logits(engine, ids: list[int], images: list[Image], chunk: int) -> torch.Tensor:
    model = engine.model
    cache = model.new_cache(len(ids))
    cache.media = prompt_media(ids, pads(engine), images, engine.images.encode(images), 2)
    t = torch.tensor(ids, device=model.device)
    with torch.inference_mode():
        return torch.cat([model.forward(t[i:i + chunk], cache, all_logits=True) for i in range(0, len(ids), chunk)])


CASES = {"square": [(1, 4, 4)], "wide": [(1, 4, 10)], "tall-large": [(1, 12, 6)],
         "two-images": [(1, 6, 4), (1, 2, 8)]}


@pytest.mark.parametrize("case", list(CASES))
def test_prompt_logits_with_images_equal_transformers(vl_engine, ref, case):
    images = [random_image(g, seed=i + len(case)) for i, g in enumerate(CASES[case])]
    ids = expand_pads(template_ids(vl_engine, images), pads(vl_engine), images)
    with torch.inference_mode():
        want = ref(**ref_inputs(vl_engine, ids, images)).logits[0]
    whole = our_logits(vl_engine, ids, images, len(ids))
    assert rel_error(whole, want) < 1e-4
    assert rel_error(our_logits(vl_engine, ids, images, 7), want) < 1e-4  # chunks that cut images


def test_greedy_32_with_two_images_equals_transformers(vl_engine, ref):
    images = [random_image((1, 6, 4), 3), random_image((1, 4, 8), 4)]
    prompt = template_ids(vl_engine, images, seed=2)
    got = vl_engine.complete(prompt, SamplingParams(max_tokens=32, temperature=0, ignore_eos=True), images)
    ids = expand_pads(prompt, pads(vl_engine), images)
    want, past, inputs = [], None, ref_inputs(vl_engine, ids, images)
    with torch.inference_mode():
        for _ in range(32):
            res = ref(**inputs, past_key_values=past, use_cache=True)
            past = res.past_key_values
            want.append(int(res.logits[0, -1].argmax()))
            inputs = {"input_ids": torch.tensor([[want[-1]]])}
    assert got.token_ids == want
    assert got.prompt_tokens == len(ids)
    if vl_engine.runner is not None:  # on a GPU the decode steps past the prompt replay the lanes' graphs
        replays = vl_engine.runner.replays + vl_engine.runner.batch_replays
        vl_engine.complete(prompt, SamplingParams(max_tokens=32, temperature=0, ignore_eos=True), images)
        assert vl_engine.runner.replays + vl_engine.runner.batch_replays - replays >= 31


class GraphLike:
    """The engine core's target, stepping as the graph runner's graphs do (`graphs`) or as eager steps do: past a
    prompt with images, a graph's step knows nothing of the images (its caches' media unset, as at capture) and
    turns by the positions it is given, each place + the prompt's M-RoPE delta (`runner.rope_delta`). The logits
    of the steps past the prompt are kept. On a GPU the target is the graph runner: its steps run on its model."""

    def __init__(self, target, graphs: bool) -> None:
        from engine.runtime.runner import GraphRunner

        self.target, self.graphs, self.logits = target, graphs, []
        self.model = target.model if isinstance(target, GraphRunner) else target

    def __getattr__(self, name: str):
        return getattr(self.target, name)

    def forward(self, ids, cache, all_logits=False, taps=None, keep_inputs=False):
        from engine.models.decoder import Row

        return self.forward_rows(ids, [Row(cache, ids.shape[0], keep_inputs, all_logits)], taps)

    def forward_rows(self, ids, rows, taps=None):
        from engine.runtime.runner import in_media_prompt, rope_delta

        if any(in_media_prompt(r.cache) for r in rows):
            return self.model.forward_rows(ids, rows, taps=taps)
        if not self.graphs:
            self.logits.append(self.model.forward_rows(ids, rows, taps=taps))
            return self.logits[-1]
        places = [r.cache.length + j for r in rows for j in range(r.tokens)]
        turns = [r.cache.length + j + rope_delta(r.cache) for r in rows for j in range(r.tokens)]
        media = [r.cache.media for r in rows]
        for r in rows:
            r.cache.media = None
        try:
            where = {"device": ids.device}  # the graph runner's position buffers live on the model's device
            self.logits.append(self.model.forward_rows(ids, rows, torch.tensor(places, **where), taps,
                                                       torch.tensor(turns, **where)))
            return self.logits[-1]
        finally:
            for r, m in zip(rows, media, strict=True):
                r.cache.media = m


def test_steps_past_the_prompt_turn_by_the_positions_a_graph_is_given(vl_engine, monkeypatch):
    """What lets a request with images decode in the graph lanes: a step past its prompt, run without its images
    on positions + the M-RoPE delta, gives the logits of the step that reads the images' positions."""
    images = [random_image((1, 6, 4), 3), random_image((1, 4, 8), 4)]
    prompt = template_ids(vl_engine, images, seed=2)
    greedy = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    runs = []
    for graphs in (False, True):
        vl_engine.drop_held()
        like = GraphLike(vl_engine.core.target, graphs)
        monkeypatch.setattr(vl_engine.core, "target", like)
        runs.append((vl_engine.complete(prompt, greedy, images).token_ids, like.logits))
        monkeypatch.undo()
    (eager, eager_logits), (graphed, graphed_logits) = runs
    assert graphed == eager and len(graphed_logits) == len(eager_logits) >= 15
    assert all(torch.equal(g, e) for g, e in zip(graphed_logits, eager_logits, strict=True))


def test_odd_sized_picture_through_the_processor(vl_engine, ref):
    """A 37x23 picture (sides off the patch grid) made ready by the engine, and its logits."""
    from PIL import Image as PILImage

    pic = PILImage.fromarray(torch.randint(0, 256, (23, 37, 3), generator=torch.Generator().manual_seed(1),
                                           dtype=torch.uint8).numpy())
    v = vl_engine.vision
    from engine.media.image import ImageBounds, Norm

    image = image_input(pic, v.spec, ImageBounds(1 << 20, 64 * 64, 16 * 16), Norm())
    assert image.grid == (1, 6, 10)
    ids = expand_pads(template_ids(vl_engine, [image], 5), pads(vl_engine), [image])
    with torch.inference_mode():
        want = ref(**ref_inputs(vl_engine, ids, [image])).logits[0]
    assert rel_error(our_logits(vl_engine, ids, [image], len(ids)), want) < 1e-4


def test_held_prefix_sees_which_image(vl_engine):
    """All image pads share one token id: a held conversation with image A must not serve a prompt with image B
    (same text), while the next turn resending A reuses all of it."""
    a, b = random_image((1, 4, 6), 21), random_image((1, 4, 6), 22)
    prompt = template_ids(vl_engine, [a], seed=9)
    greedy = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    vl_engine.drop_held()
    first = vl_engine.complete(prompt, greedy, [a])
    turn = prompt + first.token_ids + [10, 65, 66]  # the next turn, resending the image
    with_b = vl_engine.complete(turn, greedy, [b])
    assert with_b.cached_tokens == 0
    vl_engine.drop_held()
    assert with_b.token_ids == vl_engine.complete(turn, greedy, [b]).token_ids
    vl_engine.drop_held()
    vl_engine.complete(prompt, greedy, [a])
    second = vl_engine.complete(turn, greedy, [a])
    assert second.cached_tokens == first.prompt_tokens + len(first.token_ids) - 1
    vl_engine.drop_held()
    assert second.token_ids == vl_engine.complete(turn, greedy, [a]).token_ids
    assert vl_engine.images.encoded >= 2  # A and B, each once whatever the resends


def test_a_request_with_images_beside_a_text_request(vl_engine):
    """Both at once (their decode rows in one step, one with M-RoPE positions and one without; on a GPU both in
    the lanes' graphs past the prompt): each gets the tokens it gets alone."""
    images = [random_image((1, 4, 4), 31)]
    with_image, text = template_ids(vl_engine, images, seed=4), torch.randint(0, 256, (30,)).tolist()
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    vl_engine.drop_held()
    alone = [vl_engine.complete(with_image, greedy, images).token_ids, vl_engine.complete(text, greedy).token_ids]
    vl_engine.drop_held()
    batched = vl_engine.stats()["batched_steps"]
    with admitted_together(vl_engine):  # sharing steps from the first: the tiny model runs 12 tokens in milliseconds
        streams = [vl_engine.submit(with_image, greedy, images), vl_engine.submit(text, greedy)]
    together = [[e for e in s if isinstance(e, FinishEvent)][0].token_ids for s in streams]
    assert together == alone
    assert vl_engine.stats()["batched_steps"] > batched


def test_several_choices_of_a_prompt_with_an_image(vl_engine):
    """n = 2 greedy choices: the second starts from the first's cache as its prefill ends (its images' positions
    with it), and both are what one request gets."""
    images = [random_image((1, 6, 6), 41)]
    prompt = template_ids(vl_engine, images, seed=8)
    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    vl_engine.drop_held()
    alone = vl_engine.complete(prompt, greedy, images).token_ids
    vl_engine.drop_held()
    streams = vl_engine.submit_choices(prompt, greedy, 2, images)
    assert [[e for e in s if isinstance(e, FinishEvent)][0].token_ids for s in streams] == [alone, alone]


def test_a_prefill_chunk_outside_the_lanes_runs_as_one_step():
    """A request with images runs in a cache of its own, which has no graphs: its short prefill chunk is one eager
    step, not the graph runner's pieces one after another."""
    from types import SimpleNamespace

    from engine.runtime.core import run_rows
    from engine.runtime.scheduler import Work

    steps = []

    class Runner:  # the graph runner's face: a 4-token piece size, and no lane for this cache
        device = torch.device("cpu")

        def graphed(self, cache):
            return False

        def prefill_piece(self, tokens):
            return 4

        def forward(self, ids, cache, **kwargs):
            steps.append(len(ids))
            return torch.zeros(len(ids), 8)

    seq = SimpleNamespace(cache=SimpleNamespace(length=0, ensure=lambda n: None),
                          params=SimpleNamespace(speculate=False))
    run_rows(SimpleNamespace(device=torch.device("cpu")), Runner(), [Work(seq, list(range(10)), True)], None)
    assert steps == [10]


# ---- videos: frames decoded by PyAV, their temporal patches through the tower, each frame a grid of M-RoPE
# positions of its own after its time written as text ----------------------------------------------------------

def video_inputs(engine, ids: list[int], media: list[Image]) -> dict:
    """transformers' inputs of an expanded prompt with images and videos: each kind's pixels and grids apart, and
    the token types (image 1, video 2) its M-RoPE positions follow."""
    from engine.media.video import Video

    full, v = torch.tensor([ids]), engine.vision
    images, videos = [i for i in media if not isinstance(i, Video)], [i for i in media if isinstance(i, Video)]
    out = {"input_ids": full, "mm_token_type_ids": (full == v.image_token_id).int() + 2 * (full == v.video_token_id)}
    if images:
        out |= {"pixel_values": torch.cat([i.pixels for i in images]),
                "image_grid_thw": torch.tensor([i.grid for i in images])}
    if videos:
        out |= {"pixel_values_videos": torch.cat([i.pixels for i in videos]),
                "video_grid_thw": torch.tensor([i.grid for i in videos])}
    return out


def video_prompt(engine, media: list[Image]) -> list[int]:
    """A chat turn with the images and videos (`encode_rendered`: each video's frames after their times), before its
    pads are expanded."""
    from engine import IMAGE_SLOT, VIDEO_SLOT
    from engine.media.video import Video

    slots = "".join(VIDEO_SLOT if isinstance(i, Video) else IMAGE_SLOT for i in media)
    return engine.encode_chat([{"role": "user", "content": f"Look: {slots}What happens?"}], media=media)


@pytest.fixture(scope="module")
def clips(vl_engine):
    """Two videos as the engine reads them: 10 frames of 64x48 at 4 fps (5 taken: 3 temporal patches, the last
    frame repeated) and 9 of 40x24 at 2 fps (all 9 taken, sized 40x24 on the 8-pixel merge grid)."""
    from .conftest import make_video

    return [vl_engine.video(make_video(), "a"), vl_engine.video(make_video(9, 40, 24, 2, "mpeg4", seed=3), "b")]


def test_video_embeddings_equal_transformers(vl_engine, ref, clips):
    assert [c.grid for c in clips] == [(3, 12, 16), (5, 6, 10)] and [c.frames for c in clips] == [5, 9]
    with torch.inference_mode():
        want = torch.cat(ref.model.get_video_features(torch.cat([c.pixels for c in clips]),
                                                      torch.tensor([c.grid for c in clips])).pooler_output)
    assert rel_error(vl_engine.images.encode(clips), want) < 1e-4
    # a tower run bounded to one frame's patches takes a video in several runs: the same embeddings
    from engine.media.encoder import ImageEncoder

    grids: list[tuple[int, int, int]] = []

    def tower(pixels, run):
        grids.extend(run)
        return vl_engine.images.tower(pixels, run)

    frame = max(h * w for _, h, w in (c.grid for c in clips))
    runs = ImageEncoder(tower, vl_engine.device, max_patches=frame)
    assert rel_error(runs.encode(clips), want) < 1e-4
    assert grids == [(1, 12, 16)] * 3 + [(3, 6, 10), (2, 6, 10)]  # as many frames a run as fit


@pytest.mark.parametrize("case", ["video", "image-and-videos"])
def test_prompt_logits_with_videos_equal_transformers(vl_engine, ref, clips, case):
    media = clips[:1] if case == "video" else [random_image((1, 4, 6), 51), clips[1], clips[0]]
    ids = expand_pads(video_prompt(vl_engine, media), pads(vl_engine), media)
    with torch.inference_mode():
        want = ref(**video_inputs(vl_engine, ids, media)).logits[0]
    assert rel_error(our_logits(vl_engine, ids, media, len(ids)), want) < 1e-4
    assert rel_error(our_logits(vl_engine, ids, media, 13), want) < 1e-4  # chunks that cut frames


def test_greedy_24_with_a_video_equals_transformers(vl_engine, ref, clips):
    media = [clips[1]]
    prompt = video_prompt(vl_engine, media)
    got = vl_engine.complete(prompt, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True), media)
    ids = expand_pads(prompt, pads(vl_engine), media)
    want, past, inputs = [], None, video_inputs(vl_engine, ids, media)
    with torch.inference_mode():
        for _ in range(24):
            res = ref(**inputs, past_key_values=past, use_cache=True)
            past = res.past_key_values
            want.append(int(res.logits[0, -1].argmax()))
            inputs = {"input_ids": torch.tensor([[want[-1]]])}
    assert got.token_ids == want
    assert got.prompt_tokens == len(ids) == vl_engine.prompt_tokens(prompt, media)
