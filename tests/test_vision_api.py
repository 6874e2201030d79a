"""Images and videos through the official openai and anthropic SDKs on the in-process app serving the tiny
vision-language model: OpenAI chat `image_url` and `video_url`, Responses `input_image` and Anthropic `image` blocks
answer; the next turn resending the same image or video reports cached tokens; count_tokens counts the image's
tokens; bad images and videos are 400s in each API's shape that name the part and the limit."""
import base64
import io

import anthropic
import numpy as np
import openai
import pytest
import torch
from fastapi.testclient import TestClient

from engine import IMAGE_SLOT, VIDEO_SLOT, Engine, EngineConfig

from .conftest import make_video

PIL = pytest.importorskip("PIL")
from PIL import Image as PILImage  # noqa: E402

PLAIN = {"chat_template_kwargs": {"enable_thinking": False}, "ignore_eos": True}


def png(seed: int, w: int = 48, h: int = 40) -> bytes:
    buf = io.BytesIO()
    PILImage.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def data_url(data: bytes, kind: str = "png") -> str:
    return f"data:image/{kind};base64," + base64.b64encode(data).decode()


@pytest.fixture(scope="module")
def clients(vl_engine):
    from engine.server.app import create_app
    from engine.server.bridge import ServerSettings

    with TestClient(create_app(ServerSettings(model_id="m"), lambda: vl_engine, load_in_background=False)) as tc:
        yield (vl_engine, openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=tc, max_retries=0),
               anthropic.Anthropic(base_url="http://testserver", api_key="x", http_client=tc, max_retries=0))


def chat_turn(image: bytes, text: str = "What is in the picture?") -> dict:
    return {"role": "user", "content": [{"type": "text", "text": text},
                                        {"type": "image_url", "image_url": {"url": data_url(image)}}]}


def test_openai_chat_image_answers_and_the_next_turn_reuses_it(clients):
    """The first turn's prompt (ending in the open <think> block) is where the hybrid model's state was kept: the
    next turn, which resends the image and the reasoning, continues from there; with another picture it cannot."""
    eng, client, _ = clients
    eng.drop_held()
    args = dict(model="m", max_tokens=5, temperature=0, extra_body={"ignore_eos": True})
    first = client.chat.completions.create(messages=[chat_turn(png(1))], **args)
    assert first.usage.prompt_tokens > eng.image(png(1)).tokens
    reply = {"role": "assistant", "content": "", "reasoning_content": first.choices[0].message.reasoning_content}
    more = {"role": "user", "content": "And the colours?"}
    second = client.chat.completions.create(messages=[chat_turn(png(1)), reply, more], **args)
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens
    other = client.chat.completions.create(messages=[chat_turn(png(2)), reply, more], **args)
    assert other.usage.prompt_tokens_details.cached_tokens < 10  # another picture: at most the text before it


def test_responses_input_image_answers(clients):
    _, client, _ = clients
    out = client.responses.create(model="m", max_output_tokens=4, temperature=0, extra_body=PLAIN, input=[
        {"role": "user", "content": [{"type": "input_text", "text": "Describe"},
                                     {"type": "input_image", "image_url": data_url(png(3))}]}])
    assert out.status in ("completed", "incomplete") and out.usage.output_tokens == 4


def test_anthropic_image_block_answers_and_count_tokens_counts_it(clients):
    eng, _, client = clients
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": base64.b64encode(png(4)).decode()}}
    messages = [{"role": "user", "content": [image, {"type": "text", "text": "What is this?"}]}]
    out = client.messages.create(model="m", max_tokens=4, messages=messages)
    assert out.usage.output_tokens >= 1
    with_image = client.messages.count_tokens(model="m", messages=messages).input_tokens
    text_only = client.messages.count_tokens(
        model="m", messages=[{"role": "user", "content": [{"type": "text", "text": "What is this?"}]}]).input_tokens
    picture = eng.image(png(4))
    assert with_image - text_only == picture.tokens + 2  # the pads and the two vision markers
    assert with_image == out.usage.input_tokens


@pytest.mark.parametrize("part, message", [
    ({"type": "image_url", "image_url": {"url": data_url(b"not a png")}}, "messages[0].content[0]: the image cannot "
                                                                          "be decoded"),
    ({"type": "image_url", "image_url": {"url": "data:image/tiff;base64,AAAA"}}, "image media type 'image/tiff'"),
    ({"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}, "does not fetch image URLs"),
    ({"type": "image_url", "image_url": {"url": "data:image/png;base64,@@@"}}, "not valid base64"),
])
def test_bad_openai_images_are_400s_naming_the_part(clients, part, message):
    _, client, _ = clients
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": [part]}], max_tokens=2)
    assert message in err.value.body["message"]


def test_too_many_images_and_anthropic_url_sources_are_400s(clients):
    eng, client, claude = clients
    parts = [{"type": "image_url", "image_url": {"url": data_url(png(5))}}] * (eng.config.max_images + 1)
    with pytest.raises(openai.BadRequestError, match=f"more than the {eng.config.max_images}"):
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": parts}], max_tokens=2)
    with pytest.raises(anthropic.BadRequestError, match="messages.0.content.0: this server does not fetch"):
        claude.messages.create(model="m", max_tokens=2, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}}]}])


def test_a_requests_images_are_counted_once_before_any_is_fetched(clients):
    """`Engine.media` counts a request's images, for the APIs as for the local chat: image URLs past max_images
    are refused for their number, not fetched (this server fetches none: the first would say so); the app's check
    of the next message names the image past the bound in the conversation every turn resends."""
    from engine import UserError
    from ninfer_tui.chat_client import LocalClient

    eng, client, _ = clients
    n = eng.config.max_images
    urls = [{"type": "image_url", "image_url": {"url": f"https://example.com/{i}.png"}} for i in range(n + 1)]
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": urls}], max_tokens=2)
    assert err.value.body["message"] == (f"messages[0].content[{n}]: the request has {n + 1} images, more than the "
                                         f"{n} a request may send")
    earlier = [{"role": "user", "content": "Look", "images": [png(5)] * n}]
    with pytest.raises(UserError, match=f"message 2's image 1: the request has {n + 1} images") as err:
        LocalClient(eng, "p").check_images(earlier, [png(5)])
    assert "start a new one" in err.value.hint


def test_a_model_without_a_vision_tower_refuses_images():
    from engine import SamplingParams, UserError
    from engine.media.image import Image
    from engine.server.app import create_app
    from engine.server.bridge import ServerSettings

    eng = Engine(EngineConfig("synthetic:tiny", device="cpu", dtype="float32", max_context=256))
    with TestClient(create_app(ServerSettings(model_id="m"), lambda: eng, load_in_background=False)) as tc:
        client = openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=tc, max_retries=0)
        with pytest.raises(openai.BadRequestError, match=r"messages\[0\].content\[1\]: this model reads no images"):
            client.chat.completions.create(model="m", messages=[chat_turn(png(6))], max_tokens=2)
    image = Image(torch.zeros(16, 12), (1, 4, 4), 4, bytes(32))  # made elsewhere, given to submit as it is
    with pytest.raises(UserError, match="the request: this model reads no images .* has no vision tower"):
        eng.submit([1, 2, 3], SamplingParams(max_tokens=1), [image])


def test_generate_with_images_from_the_command_line(vl_folder, vl_engine, tmp_path):
    """`ninfer generate --image PATH` (twice): both images' tokens are in the prompt; an unreadable one is a user
    error (exit 2) naming the flag."""
    import json

    from .conftest import run_cli

    a, b = tmp_path / "a.png", tmp_path / "b.png"
    a.write_bytes(png(7))
    b.write_bytes(png(8, 30, 70))
    common = ("generate", "-m", str(vl_folder), "--device", "cpu", "--chat", "Compare", "-n", "3", "--temperature",
              "0", "--json", "--set", "image_max_pixels=4096")  # the bounds of vl_engine
    r = run_cli(*common, "--image", str(a), "--image", str(b))
    assert r.returncode == 0, r.stderr
    text_only = len(vl_engine.encode_chat([{"role": "user", "content": "Compare"}]))
    tokens = sum(vl_engine.image(p.read_bytes()).tokens + 2 for p in (a, b))  # pads and markers
    assert json.loads(r.stdout)["prompt_tokens"] == text_only + tokens
    missing = run_cli(*common, "--image", str(tmp_path / "none.png"))
    assert missing.returncode == 2 and "--image" in missing.stderr and "cannot read" in missing.stderr


def test_line_chat_image_command(vl_engine, tmp_path, capsys):
    """`/image PATH` attaches an image to the next message; later turns resend it (encoded once); an image the
    engine refuses fails that message alone, naming it, and the next message goes without it."""
    from engine import SamplingParams, UserError
    from ninfer_tui.chat import LineChat
    from ninfer_tui.chat_client import LocalClient
    from ninfer_tui.cli import build_parser
    from ninfer_tui.sessions import SessionStore

    picture, junk = tmp_path / "p.png", tmp_path / "junk.png"
    picture.write_bytes(png(9))
    junk.write_bytes(b"not an image")
    chat = LineChat(build_parser().parse_args(["chat", "--profile", "cpu-default"]), SessionStore(),
                    client=LocalClient(vl_engine, "cpu-default"))
    chat.new()
    chat.params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    with pytest.raises(UserError, match="/image: cannot read"):
        chat.command(f"/image {tmp_path / 'none.png'}")
    chat.command(f"/image {picture}")
    assert "image 1 attached" in capsys.readouterr().err
    encoded = vl_engine.images.encoded
    chat.send("What is it?")
    assert chat.messages[0]["images"] == [picture.read_bytes()] and vl_engine.images.encoded == encoded + 1
    chat.send("Sure?")
    assert vl_engine.images.encoded == encoded + 1  # resent, not encoded again
    chat.command(f"/image {junk}")
    with pytest.raises(UserError, match="message 5's image 1: the image cannot be decoded"):
        chat.send("And this?")
    chat.send("Never mind.")
    assert "images" not in chat.messages[-2] and len(chat.messages) == 6
    store, session = chat.store, chat.session
    reopened = LineChat(build_parser().parse_args(["chat", "--profile", "cpu-default"]), store,
                        client=LocalClient(vl_engine, "cpu-default"))
    reopened.resume(session, show=False)
    assert reopened.messages[0] == chat.messages[0]  # the session keeps the attachment (by content, on disk)
    files = list(store.attachments.iterdir())
    assert [f.read_bytes() for f in files] == [picture.read_bytes()]
    store.delete(session.id)
    assert not list(store.attachments.iterdir())


def socket_server(answer: bytes, drip: bool = False) -> int:
    """The port of a server on 127.0.0.1 that answers each connection with `answer`, then with `drip` a byte every
    0.5 s for 30 s (each read gets a byte in time: only the fetch's deadline ends it)."""
    import socket
    import threading
    import time

    listener = socket.create_server(("127.0.0.1", 0))

    def serve():
        while True:
            conn, _ = listener.accept()
            conn.recv(4096)
            try:
                conn.sendall(answer)
                for _ in range(60 if drip else 0):
                    time.sleep(0.5)
                    conn.sendall(b"x")
            except OSError:
                pass
            conn.close()

    threading.Thread(target=serve, daemon=True).start()
    return listener.getsockname()[1]


def test_image_urls_are_fetched_only_where_the_server_allows(vl_engine, tmp_path, monkeypatch):
    """With `image_urls` an http(s) image or video URL is fetched (the same tokens as the image or video inline); a
    missing one, a body over image_max_mib, a server answering nonsense and one too slow are 400s naming the part;
    a loopback address only with `image_urls_private`; without `image_urls` (the default) URLs are refused
    (above)."""
    import functools
    import http.server
    import threading

    from engine.server import images
    from engine.server.app import create_app
    from engine.server.bridge import ServerSettings

    monkeypatch.setattr(images, "FETCH_TIMEOUT_S", 1.0)  # the slow server's fetch ends at this deadline
    monkeypatch.setattr(images, "READ_TIMEOUT_S", 0.8)
    (tmp_path / "p.png").write_bytes(png(10))
    (tmp_path / "a.mp4").write_bytes(make_video(seed=9))
    (tmp_path / "big.png").write_bytes(b"\0" * ((vl_engine.config.image_max_mib << 20) + 1))
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(tmp_path))
    handler.log_message = lambda *a: None
    files = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=files.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{files.server_address[1]}"
    nonsense = socket_server(b"NOT HTTP AT ALL\r\n\r\n")
    slow = socket_server(b"HTTP/1.0 200 OK\r\n\r\n", drip=True)
    settings = ServerSettings(model_id="m", image_urls=True, image_urls_private=True)
    public_only = ServerSettings(model_id="m", image_urls=True)
    try:
        with TestClient(create_app(public_only, lambda: vl_engine, load_in_background=False)) as tc:
            client = openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=tc, max_retries=0)
            for host in ("127.0.0.1", "localhost"):
                with pytest.raises(openai.BadRequestError, match=r"content\[0\]: the image URL names a local"):
                    client.chat.completions.create(model="m", max_tokens=1, messages=[{"role": "user", "content": [
                        {"type": "image_url", "image_url": {"url": f"http://{host}:{files.server_address[1]}/p.png"}}]}])
        with TestClient(create_app(settings, lambda: vl_engine, load_in_background=False)) as tc:
            client = openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=tc, max_retries=0)

            def ask(url: str):
                return client.chat.completions.create(model="m", max_tokens=1, messages=[{"role": "user", "content": [
                    {"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "Hi"}]}])

            for url in (f"http://127.0.0.1:{nonsense}/", f"http://127.0.0.1:{slow}/"):
                with pytest.raises(openai.BadRequestError, match=r"not be fetched \(an error, or more than 1 s\)$"):
                    ask(url)
            # the fetches below end by themselves (the 20 MiB one too): no deadline a busy machine could reach
            monkeypatch.setattr(images, "FETCH_TIMEOUT_S", 60.0)
            monkeypatch.setattr(images, "READ_TIMEOUT_S", 60.0)

            fetched, inline = ask(f"{base}/p.png"), ask(data_url(png(10)))
            assert fetched.usage.prompt_tokens == inline.usage.prompt_tokens
            clip, inline = ({"role": "user", "content": [part]} for part in (
                {"type": "video_url", "video_url": {"url": f"{base}/a.mp4"}}, video_url(make_video(seed=9))))
            assert (client.chat.completions.create(model="m", max_tokens=1, messages=[clip]).usage.prompt_tokens
                    == client.chat.completions.create(model="m", max_tokens=1, messages=[inline]).usage.prompt_tokens)
            with pytest.raises(openai.BadRequestError, match=r"content\[0\]: the image URL could not be fetched"):
                ask(f"{base}/none.png")
            with pytest.raises(openai.BadRequestError, match=r"more than the 20 MiB an image may be"):
                ask(f"{base}/big.png")
    finally:
        files.shutdown()


def test_the_tower_runs_off_the_event_loop_and_after_the_length_check(clients, monkeypatch):
    """The request's worker thread encodes its images, once, and submit (on the event loop) takes the embeddings
    from the Job; a request too long for the window is refused before the tower runs."""
    import asyncio

    eng, client, _ = clients
    calls, encode = [], eng.images.encode

    def watched(images):
        try:
            asyncio.get_running_loop()
            calls.append("event loop")
        except RuntimeError:
            calls.append("worker")
        return encode(images)

    monkeypatch.setattr(eng.images, "encode", watched)
    client.chat.completions.create(model="m", messages=[chat_turn(png(11))], max_tokens=1)
    assert calls == ["worker"]
    with pytest.raises(openai.BadRequestError, match="context"):
        client.chat.completions.create(model="m", messages=[chat_turn(png(12))], max_tokens=eng.max_context)
    assert calls == ["worker"]


@pytest.mark.parametrize("head, wrap", [
    ("data:image/jpg;base64", False), ("data:image/png;charset=utf-8;base64", False), ("data:image/PNG;base64", True),
    ("data:image/webp;base64", False)])
def test_data_urls_as_clients_write_them(vl_engine, head, wrap):
    """image/jpg, parameters, MIME line breaks every 76 characters, and a declared type the bytes are not: the
    decoder tells the type from the bytes."""
    from engine.server.images import image_source

    b64 = base64.b64encode(png(13)).decode()
    if wrap:
        b64 = "\r\n".join(b64[i:i + 76] for i in range(0, len(b64), 76))
    data = image_source(f"{head},{b64}", "messages[0].content[0]", "messages")
    assert data == png(13) and vl_engine.image(data).tokens == vl_engine.image(png(13)).tokens


def test_an_attached_path_must_be_a_regular_file_within_image_max_mib(tmp_path):
    """Asked of the file before reading: /dev/zero would never end, a 2 GiB file would be read whole."""
    from engine import UserError
    from ninfer_tui.attachments import read_image

    big = tmp_path / "big.png"
    with big.open("wb") as f:
        f.truncate((2 << 20) + 1)  # sparse: no time to write
    for path, message in ((tmp_path, "is not a regular file"), ("/dev/zero", "is not a regular file"),
                          (big, "2.0 MiB, more than the 2 MiB an image may be")):
        with pytest.raises(UserError, match=f"/image: .*{message}"):
            read_image(str(path), "/image", 2)
    (tmp_path / "ok.png").write_bytes(png(14))
    assert read_image(str(tmp_path / "ok.png"), "/image", 2) == png(14)


def test_vision_tokens_written_as_text_stay_text(clients):
    """The marker typed into a user's text, an assistant turn or a tool result is text: the request's one image
    has one place, and a request without images has none."""
    from engine import IMAGE_MARKER

    eng, client, claude = clients
    pad = eng.vision.image_token_id
    assert pad not in eng.encode_rendered(f"a{IMAGE_MARKER}b<|image_pad|>")
    typed = {"role": "user", "content": [{"type": "text", "text": f"What does {IMAGE_MARKER} mean?"},
                                         {"type": "image_url", "image_url": {"url": data_url(png(15))}}]}
    said = {"role": "assistant", "content": f"It is {IMAGE_MARKER}."}
    out = client.chat.completions.create(model="m", max_tokens=1, messages=[typed, said, chat_turn(png(16))])
    assert out.usage.prompt_tokens > 2 * eng.image(png(15)).tokens
    client.chat.completions.create(model="m", max_tokens=1, messages=[{"role": "user", "content": IMAGE_MARKER}])
    claude.messages.create(model="m", max_tokens=1, messages=[
        {"role": "user", "content": "Read it"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "Read", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": IMAGE_MARKER}]}],
        tools=[{"name": "Read", "input_schema": {"type": "object"}}])


def test_an_anthropic_tool_result_may_hold_an_image(clients):
    """Claude Code's Read tool returns a PNG as an image block in the tool_result: it goes in the tool message,
    after which the turn's own image comes."""
    eng, _, claude = clients
    source = {"type": "base64", "media_type": "image/png", "data": base64.b64encode(png(17)).decode()}
    messages = [
        {"role": "user", "content": "Look at shot.png"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "Read", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": [
            {"type": "text", "text": "shot.png:"}, {"type": "image", "source": source}]},
            {"type": "image", "source": {**source, "data": base64.b64encode(png(18, 40, 48)).decode()}},
            {"type": "text", "text": "and this one"}]}]
    tools = [{"name": "Read", "input_schema": {"type": "object"}}]
    out = claude.messages.create(model="m", max_tokens=1, messages=messages, tools=tools)
    texts = [{"type": "tool_result", "tool_use_id": "t1", "content": "shot.png:"},
             {"type": "text", "text": "and this one"}]
    without = claude.messages.count_tokens(model="m", messages=messages[:2] + [{"role": "user", "content": texts}],
                                           tools=tools).input_tokens
    total = out.usage.input_tokens + out.usage.cache_read_input_tokens  # Anthropic counts the cached apart
    assert total == without + eng.image(png(17)).tokens + eng.image(png(18, 40, 48)).tokens + 4


def test_a_vision_config_without_the_tower_is_text_only_and_no_images_nor_videos_leave_the_tower(vl_folder, vl_engine,
                                                                                                tmp_path):
    """A text-only export that keeps the vision_config loads (and plans) as text-only; max_images = 0 with
    video_max_frames = 0 neither loads the tower nor counts it."""
    import shutil

    from safetensors.torch import load_file, save_file

    for f in vl_folder.iterdir():
        if f.suffix != ".safetensors" and f.name != "model.safetensors.index.json":
            shutil.copy(f, tmp_path / f.name)
    weights = {}
    for shard in vl_folder.glob("*.safetensors"):
        weights |= {k: v for k, v in load_file(shard).items() if "visual." not in k}
    save_file(weights, tmp_path / "model.safetensors")
    text_only = Engine(EngineConfig(model=str(tmp_path), device="cpu", dtype="float32"))
    assert text_only.vision is None and text_only.plan.weights < vl_engine.plan.weights
    with pytest.raises(Exception, match="reads no images"):
        text_only.image(png(19))
    closed = Engine(EngineConfig(model=str(vl_folder), device="cpu", dtype="float32", max_images=0,
                                 video_max_frames=0))
    assert closed.images is None and closed.plan.weights == text_only.plan.weights
    # the tower's run is planned where it may run: one image at image_max_pixels (or as many video frames)
    import dataclasses

    from engine.memory_plan import plan_memory, tower_patches

    geometry, config = vl_engine.model.geometry, vl_engine.config
    run = tower_patches(config, geometry.vision_patch_size) * geometry.vision_patch_elements * 4
    shut = dataclasses.replace(config, max_images=0, video_max_frames=0)
    saved = plan_memory(geometry, config, "cpu").workspace - plan_memory(geometry, shut, "cpu").workspace
    assert run > 0 and saved == run
    with pytest.raises(Exception, match="max_images is 0"):
        closed.image(png(19))
    with pytest.raises(Exception, match="video_max_frames is 0"):
        closed.video(make_video())


def test_the_local_client_keeps_a_typed_marker_as_text(vl_engine):
    """The app and line chat send the message's own images; the marker the user typed after them is text."""
    from engine import IMAGE_MARKER, SamplingParams
    from ninfer_tui.attachments import with_images, written_text
    from ninfer_tui.chat_client import LocalClient

    message = with_images(f"What is {IMAGE_MARKER}?", [png(20)])
    assert written_text(message) == f"What is {IMAGE_MARKER}?"
    assert written_text({"role": "user", "content": f"see {IMAGE_MARKER} here"}) == f"see {IMAGE_MARKER} here"
    reply = LocalClient(vl_engine, "p").reply([message], SamplingParams(max_tokens=1, temperature=0))
    done = [e for e in reply if e.kind == "done"][0]
    assert done.prompt_tokens > vl_engine.image(png(20)).tokens


def video_url(data: bytes, kind: str = "mp4") -> dict:
    return {"type": "video_url", "video_url": {"url": f"data:video/{kind};base64," + base64.b64encode(data).decode()}}


def test_openai_chat_video_answers_and_the_next_turn_reuses_it(clients):
    """A `video_url` data URL (vLLM's and Qwen's part; the OpenAI SDK passes it as it is): the prompt holds the
    video's frames, and the next turn resending it continues from the held conversation (as with an image: from
    the first turn's prompt, which ends in the open <think> block)."""
    eng, client, _ = clients
    clip = make_video(seed=6)
    turn = {"role": "user", "content": [{"type": "text", "text": "What happens?"}, video_url(clip)]}
    args = dict(model="m", max_tokens=4, temperature=0, extra_body={"ignore_eos": True})
    text_only = client.chat.completions.create(messages=[{"role": "user", "content": "What happens?"}], **args)
    eng.drop_held()
    first = client.chat.completions.create(messages=[turn], **args)
    assert first.usage.completion_tokens == 4
    video = eng.video(clip)
    # the pads, and each temporal patch's vision markers and time ("<0.2 seconds>": 13 byte tokens here)
    assert first.usage.prompt_tokens - text_only.usage.prompt_tokens == video.tokens + video.grid[0] * (2 + 13)
    reply = {"role": "assistant", "content": "", "reasoning_content": first.choices[0].message.reasoning_content}
    second = client.chat.completions.create(messages=[turn, reply, {"role": "user", "content": "And then?"}], **args)
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens


def test_responses_messages_take_the_video_url_part(clients):
    """The Responses API defines no video part: its messages take chat's `video_url`, as they take `image_url`."""
    _, client, _ = clients
    out = client.responses.create(model="m", max_output_tokens=3, temperature=0, extra_body=PLAIN, input=[
        {"role": "user", "content": [{"type": "input_text", "text": "Describe"}, video_url(make_video(seed=8))]}])
    assert out.usage.output_tokens == 3 and out.usage.input_tokens > 3 * 48


@pytest.mark.parametrize("part, message", [
    (video_url(b"not a video"), "messages[0].content[1]: the video's container is not supported"),
    (video_url(make_video()[:300]), "messages[0].content[1]: the video cannot be decoded"),
    (video_url(make_video(1)), "messages[0].content[1]: the video has 1 frame, fewer than the 2"),
    (video_url(b"x", "ogg"), "messages[0].content[1]: video media type 'video/ogg' is not supported"),
    ({"type": "video_url", "video_url": {"url": "https://example.com/a.mp4"}}, "does not fetch video URLs"),
    ({"type": "video_url", "video_url": {"url": "ftp://example.com/a.mp4"}}, "must be a data: URL (data:video/mp4"),
])
def test_bad_openai_videos_are_400s_naming_the_part(clients, part, message):
    _, client, _ = clients
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="m", max_tokens=2, messages=[
            {"role": "user", "content": [{"type": "text", "text": "What happens?"}, part]}])
    assert message in err.value.body["message"] and err.value.body["param"] == "messages"


def test_a_requests_videos_share_its_frames(clients):
    """video_max_frames bounds a request's videos together: a 60-second clip takes all 64 frames (sampled more
    sparsely than 2 a second), and a video after it is refused, naming its part and the limit."""
    eng, client, _ = clients
    long = make_video(240, 16, 16, 4, "mpeg4")
    assert eng.video(long).frames == eng.config.video_max_frames == 64
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="m", max_tokens=2, messages=[
            {"role": "user", "content": [video_url(long), video_url(make_video())]}])
    assert "messages[0].content[1]: the request's videos before it took its 64 frames" in err.value.body["message"]


def test_generate_and_the_line_chat_take_videos(vl_folder, vl_engine, tmp_path, capsys):
    """`ninfer generate --video PATH` puts the video's frames after the image in the prompt; `/video PATH` in the
    line chat attaches one to the next message, which a reopened session keeps and a server gets as `video_url`."""
    import json

    from engine import SamplingParams
    from ninfer_tui.attachments import openai_parts
    from ninfer_tui.chat import LineChat
    from ninfer_tui.chat_client import LocalClient
    from ninfer_tui.cli import build_parser
    from ninfer_tui.sessions import SessionStore

    from .conftest import run_cli

    clip, picture = tmp_path / "a.mp4", tmp_path / "a.png"
    clip.write_bytes(make_video(seed=7))
    picture.write_bytes(png(21))
    r = run_cli("generate", "-m", str(vl_folder), "--device", "cpu", "--chat", "Compare", "-n", "2", "--temperature",
                "0", "--json", "--set", "image_max_pixels=4096", "--image", str(picture), "--video", str(clip))
    assert r.returncode == 0, r.stderr
    media = [vl_engine.image(picture.read_bytes()), vl_engine.video(clip.read_bytes())]
    prompt = vl_engine.encode_chat([{"role": "user", "content": f"{IMAGE_SLOT}{VIDEO_SLOT}Compare"}], media=media)
    assert json.loads(r.stdout)["prompt_tokens"] == vl_engine.prompt_tokens(prompt, media)

    chat = LineChat(build_parser().parse_args(["chat", "--profile", "cpu-default"]), SessionStore(),
                    client=LocalClient(vl_engine, "cpu-default"))
    chat.new()
    chat.params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    chat.command(f"/video {clip}")
    assert "video 1 attached" in capsys.readouterr().err
    chat.send("What happens?")
    assert chat.messages[0]["images"] == [clip.read_bytes()]
    assert [p["type"] for p in openai_parts(chat.messages[0])["content"]] == ["video_url", "text"]
    reopened = LineChat(build_parser().parse_args(["chat", "--profile", "cpu-default"]), chat.store,
                        client=LocalClient(vl_engine, "cpu-default"))
    reopened.resume(chat.session, show=False)
    assert reopened.messages[0] == chat.messages[0]


def test_a_resent_video_is_prepared_once_for_its_frame_budget(vl_engine):
    """A video resent (every turn of an agent's conversation, the app's check before its send) is decoded once for
    a frame budget; another budget samples it again."""
    data = make_video(seed=11)
    made = vl_engine.prepared.made
    first = vl_engine.video(data, "v")
    assert vl_engine.video(data, "v") is first and vl_engine.prepared.made == made + 1
    assert vl_engine.video(data, "v", 4).frames == 4 and vl_engine.prepared.made == made + 2
