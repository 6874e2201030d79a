"""Images and videos attached to a chat message by path: read before anything else runs, each kept beside the
message text (the message's `images`, one for each IMAGE_MARKER or VIDEO_MARKER at the start of its content, in
order, a video told from an image by its bytes: markers further on are text the user wrote)."""
from __future__ import annotations

import base64
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlparse

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


@dataclass(frozen=True)
class Attachment:
    """A file attached to a message: its file's name (shown in the message's chip) and its bytes."""

    name: str
    data: bytes

    @property
    def kind(self) -> str:
        return "video" if is_video(self.data) else "image"

    @property
    def chip(self) -> str:
        return f"{self.kind} {self.name}".strip()


def read_attachment(path: str, where: str, image_max_mib: int, video_max_mib: int) -> Attachment:
    """An image or video file for a message, its kind told from its first bytes and its size bounded by that
    kind's limit: UserError naming `where` when it cannot be read, is too large, or is neither (the engine decodes
    and checks the rest when the message goes)."""
    kind = media_kind(path)
    try:
        data = read_image(path, where, video_max_mib if kind == "video" else image_max_mib, kind or "image")
    except UserError as exc:
        if kind is not None:
            raise
        raise UserError(str(exc), hint=EITHER_HINT) from None  # no kind was told: the user may mean either
    if kind is None:  # a file that could be read, of another type
        raise UserError(f"{where}: {path} is not an image or a video", hint=EITHER_HINT)
    return Attachment(Path(path).name, data)


EITHER_HINT = "give the path of a PNG, JPEG, WebP, GIF or BMP image, or of an MP4/MOV, WebM/MKV or AVI video"


def media_kind(path: str) -> str | None:
    """The kind ("image" or "video") of a regular file whose first bytes are a type the engine reads; None for
    anything else (no such file, not a regular file, unreadable, another type). Only those bytes are read: a
    pasted path is checked as it comes."""
    file = Path(path).expanduser()
    try:
        if not file.is_file():  # a FIFO or a device would block or never end
            return None
        with file.open("rb") as f:
            kind = media_type(f.read(16))
    except (OSError, ValueError):
        return None
    return kind and kind.split("/")[0]


def given_path(text: str) -> str:
    """The path `text` names, as a user types it or a terminal pastes a dragged file: as written when that names
    a file, else unwrapped from quotes, from a file:// URL (its %-escapes decoded) or from backslash escapes
    ('my\\ shot.png')."""
    text = text.strip()
    if os.path.lexists(os.path.expanduser(text)):
        return text
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
        return text[1:-1]
    if text.startswith("file://"):
        url = urlparse(text)
        return unquote(url.path) if url.netloc in ("", "localhost") else text
    return re.sub(r"\\(.)", r"\1", text)


def pasted_file(text: str) -> tuple[str, str] | None:
    """The path and kind of the image or video file that `text` is, all of it (`given_path`), for offering it as
    an attachment instead of sending the path as text; None for any other text."""
    text = text.strip()
    if not text or "\n" in text:
        return None
    path = given_path(text)
    kind = media_kind(path)
    return (path, kind) if kind else None


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
    n = len(message.get("images", ()))
    return MARKERS.sub("", message["content"], n) if n else message["content"]  # count 0 would mean all


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
