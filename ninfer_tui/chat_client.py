"""One interface for chatting with a model: in-process (an Engine) or over HTTP (a running `ninfer serve`).
The TUI and the line chat use it, so attaching to a server changes nothing above this module."""
from __future__ import annotations

import dataclasses
import json
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass

from engine import FinishEvent, SamplingParams, TokenEvent, UserError
from engine.tokenizer.output_parser import OutputParser

from .attachments import is_video, media_type, openai_parts, slotted


@dataclass
class ReplyEvent:
    kind: str  # "text" | "reasoning" | "done"
    text: str = ""
    completion_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    tok_s: float = 0.0
    finish_reason: str = ""
    # On "done": the prompt tokens actually evaluated (the rest came from a held conversation) and the seconds
    # that took, the seconds of generating after the first token, and the whole reply's wall time.
    prompt_eval_tokens: int = 0
    prompt_eval_s: float = 0.0
    eval_s: float = 0.0
    total_s: float = 0.0


class Reply:
    """A streamed answer; iterate for ReplyEvents (the last is "done"). `cancel()`, from any thread, stops it: the
    iteration goes on to a "done" event. `close()`, from the thread that iterates it, when it is left before its
    end (or never iterated): stops it and frees at once what it holds (`close` defaults to `cancel`)."""

    def __init__(self, events: Iterator[ReplyEvent], cancel, close=None) -> None:
        self._events, self._cancel, self._close = events, cancel, close or cancel

    def __iter__(self) -> Iterator[ReplyEvent]:
        return self._events

    def cancel(self) -> None:
        self._cancel()

    def close(self) -> None:
        self._close()


class LocalClient:
    def __init__(self, engine, profile_name: str) -> None:
        self.engine, self.profile = engine, profile_name
        self.model = engine.model_name
        self.device = str(engine.device)

    @property
    def label(self) -> str:
        return f"{self.model} on {self.device}"

    def reply(self, messages: list[dict], params: SamplingParams) -> Reply:
        started = time.perf_counter()
        text = self.engine.render_chat([slotted(m) for m in messages])
        # every image and video of the conversation, resent each turn: the engine encodes each once (cached by
        # content)
        images = self.media(messages)
        ids = self.engine.encode_rendered(text, images)
        room = self.engine.max_context - self.engine.prompt_tokens(ids, images)
        params = dataclasses.replace(params, max_tokens=max(1, min(params.max_tokens, room)))
        stream = self.engine.submit(ids, params, images)
        parser = OutputParser(in_reasoning=text.rstrip().endswith("<think>"), tools=False)

        def events() -> Iterator[ReplyEvent]:
            t0, n = time.perf_counter(), 0
            for event in stream:
                if isinstance(event, TokenEvent):
                    n += event.token_id is not None
                    for p in parser.feed(event.text):
                        yield ReplyEvent(p.kind, p.text, n, tok_s=n / max(time.perf_counter() - t0, 1e-9))
                elif isinstance(event, FinishEvent):
                    for p in parser.finish():
                        yield ReplyEvent(p.kind, p.text, n)
                    t = event.timings
                    yield ReplyEvent("done", "", event.completion_tokens, event.prompt_tokens, event.cached_tokens,
                                     t.decode_tok_s, event.finish_reason, t.prefill_tokens, t.prefill_s, t.decode_s,
                                     time.perf_counter() - started)

        # A cancel only asks the engine to stop; a stream no longer read gives its slot back on close.
        return Reply(events(), stream.cancel, stream.close)


    def media(self, messages: list[dict]) -> list:
        """The engine's images and videos of the messages' attachments, in order, each video sampled within the
        frames the request has left (video_max_frames in all)."""
        return self.engine.media(
            [(f"message {i + 1}'s {'video' if is_video(data) else 'image'} {j + 1}", data, is_video(data))
             for i, m in enumerate(messages) for j, data in enumerate(m.get("images", ()))])

    def check_images(self, messages: list[dict], images: list[bytes]) -> None:
        """UserError when the next message's images or videos would be refused: each as the engine reads it, and
        the conversation's count of images and video frames (every turn resends them all); a front end asks
        before it keeps the message."""
        self.media([*messages, {"images": images}])


class RemoteClient:
    """A running ninfer server, through its OpenAI chat-completions route (streamed)."""

    def __init__(self, url: str, model: str, profile_name: str, api_key: str | None = None) -> None:
        self.url, self.model, self.profile, self.api_key = url.rstrip("/"), model, profile_name, api_key
        self.device = "server"

    @property
    def label(self) -> str:
        return f"{self.model} via {self.url}"

    def check_images(self, messages: list[dict], images: list[bytes]) -> None:
        """UserError for an attachment no server takes (its bytes are none of the image or video types); the
        server checks the rest when the message goes."""
        for j, data in enumerate(images):
            if media_type(data) is None:
                raise UserError(f"attachment {j + 1} is not a PNG, JPEG, WebP, GIF or BMP image nor an MP4/MOV, "
                                "WebM/MKV or AVI video", hint="attach an image or video file (`/image PATH`, "
                                "`/video PATH`), or `/image` alone to drop them")

    def reply(self, messages: list[dict], params: SamplingParams) -> Reply:
        t0 = time.perf_counter()
        body = {"model": self.model, "messages": [openai_parts(m) for m in messages], "stream": True,
                "stream_options": {"include_usage": True},
                "max_tokens": params.max_tokens, "temperature": params.temperature, "top_p": params.top_p}
        headers = {"content-type": "application/json"}
        if self.api_key:
            headers["authorization"] = f"Bearer {self.api_key}"
        req = urllib.request.Request(f"{self.url}/v1/chat/completions", json.dumps(body).encode(), headers)
        resp = urllib.request.urlopen(req, timeout=600)
        cancelled = [False]

        def cancel() -> None:
            cancelled[0] = True
            resp.close()

        def events() -> Iterator[ReplyEvent]:
            n, finish, usage, first = 0, "stop", {}, None
            try:
                for raw in resp:
                    line = raw.decode("utf-8", "replace").strip()
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    usage = chunk.get("usage") or usage
                    for choice in chunk.get("choices", []):
                        delta = choice.get("delta", {})
                        finish = choice.get("finish_reason") or finish
                        for kind, key in (("reasoning", "reasoning_content"), ("text", "content")):
                            if delta.get(key):
                                first = first or time.perf_counter()
                                n += 1
                                yield ReplyEvent(kind, delta[key], n, tok_s=n / max(time.perf_counter() - t0, 1e-9))
            except (OSError, ValueError):
                if not cancelled[0]:
                    raise
                finish = "cancelled"
            finally:
                resp.close()
            # Over HTTP the server's split is not sent: the time to the first token stands for the prompt's.
            end = time.perf_counter()
            first = first or end
            done = usage.get("completion_tokens", n)
            prompt = usage.get("prompt_tokens", 0)
            cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
            yield ReplyEvent("done", "", done, prompt, cached, max(done - 1, 0) / max(end - first, 1e-9), finish,
                             prompt - cached, first - t0, end - first, end - t0)

        return Reply(events(), cancel)
