"""Images and videos attached to a chat message by path: read before anything else runs, each kept beside the
message text (the message's `images`, one for each IMAGE_MARKER or VIDEO_MARKER at the start of its content, in
order, a video told from an image by its bytes: markers further on are text the user wrote)."""
from __future__ import annotations

import base64
import re
import stat
from pathlib import Path

from engine import IMAGE_MARKER, IMAGE_SLOT, VIDEO_MARKER, VIDEO_SLOT, UserError
from engine.media import video_container

MARKERS = re.compile(f"{re.escape(IMAGE_MARKER)}|{re.escape(VIDEO_MARKER)}")
VIDEO_TYPES = {"mp4": "video/mp4", "matroska": "video/webm", "avi": "video/x-msvideo"}


def read_image(path: str, where: str, max_mib: int, kind: str = "image") -> bytes:
    """An image (video) file's bytes (UserError naming `where` when it cannot be read, is not a regular file, or
    is over `max_mib`, the engine's image_max_mib (video_max_mib): asked of the file before reading it); the engine
    decodes and checks it."""
    file = Path(path).expanduser()
    formats = "a PNG, JPEG, WebP, GIF or BMP file" if kind == "image" else "an MP4/MOV, WebM/MKV or AVI file"
    try:
        info = file.stat()
        if not stat.S_ISREG(info.st_mode):
            raise UserError(f"{where}: {path} is not a regular file", hint=f"give the path of {article(kind)} {kind} "
                            "file")
        if info.st_size > max_mib << 20:
            raise UserError(f"{where}: {path} is {info.st_size / 2**20:.1f} MiB, more than the {max_mib} MiB "
                            f"{article(kind)} {kind} may be", hint=f"attach a smaller or more compressed {kind}")
        return file.read_bytes()
    except OSError as exc:
        raise UserError(f"{where}: cannot read {path} ({exc.strerror or exc})",
                        hint=f"give the path of {formats}") from None


def article(kind: str) -> str:
    return "an" if kind == "image" else "a"


def is_video(data: bytes) -> bool:
    return video_container(data) is not None


def with_images(text: str, images: list[bytes]) -> dict:
    """A user message of `text` after its images and videos (`images`, in order)."""
    message = {"role": "user", "content": "".join(VIDEO_MARKER if is_video(d) else IMAGE_MARKER for d in images)
               + text}
    if images:
        message["images"] = list(images)
    return message


def slotted(message: dict) -> dict:
    """The message for the engine's prompt: its images' and videos' markers as IMAGE_SLOTs and VIDEO_SLOTs
    (`Engine.encode_rendered`)."""
    n = len(message.get("images", ()))
    if not n:
        return message
    slot = {IMAGE_MARKER: IMAGE_SLOT, VIDEO_MARKER: VIDEO_SLOT}
    return message | {"content": MARKERS.sub(lambda m: slot[m.group()], message["content"], n)}


def written_text(message: dict) -> str:
    """The text the user wrote: the content without its images' and videos' markers."""
    return MARKERS.sub("", message["content"], len(message.get("images", ())))


def openai_parts(message: dict) -> dict:
    """A message with images and videos as OpenAI chat content parts (text, and each image or video as a data: URL
    where its marker was: `image_url`, `video_url`), for a server."""
    images = message.get("images")
    if not images:
        return message
    pieces = MARKERS.split(message["content"], len(images))
    parts: list[dict] = []
    for i, text in enumerate(pieces):
        if text:
            parts.append({"type": "text", "text": text})
        if i < len(images):
            kind = "video_url" if is_video(images[i]) else "image_url"
            url = f"data:{media_type(images[i]) or 'image/png'};base64," + base64.b64encode(images[i]).decode()
            parts.append({"type": kind, kind: {"url": url}})
    return {k: v for k, v in message.items() if k != "images"} | {"content": parts}


_MAGIC = ((b"\x89PNG", "image/png"), (b"\xff\xd8", "image/jpeg"), (b"GIF8", "image/gif"), (b"BM", "image/bmp"))


def media_type(data: bytes) -> str | None:
    """The image or video type the bytes begin as (None: none of those the APIs take)."""
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "image/webp"
    if (container := video_container(data)) is not None:
        return VIDEO_TYPES[container]
    return next((kind for magic, kind in _MAGIC if data.startswith(magic)), None)
