"""Images attached to a chat message by path: read before anything else runs, each kept beside the message text
(the message's `images`, one for each IMAGE_MARKER at the start of its content, in order: markers further on are
text the user wrote)."""
from __future__ import annotations

import base64
import stat
from pathlib import Path

from engine import IMAGE_MARKER, IMAGE_SLOT, UserError


def read_image(path: str, where: str, max_mib: int) -> bytes:
    """An image file's bytes (UserError naming `where` when it cannot be read, is not a regular file, or is over
    `max_mib`, the engine's image_max_mib: asked of the file before reading it); the engine decodes and checks
    it."""
    file = Path(path).expanduser()
    try:
        info = file.stat()
        if not stat.S_ISREG(info.st_mode):
            raise UserError(f"{where}: {path} is not a regular file", hint="give the path of an image file")
        if info.st_size > max_mib << 20:
            raise UserError(f"{where}: {path} is {info.st_size / 2**20:.1f} MiB, more than the {max_mib} MiB an "
                            "image may be", hint="attach a smaller or more compressed image")
        return file.read_bytes()
    except OSError as exc:
        raise UserError(f"{where}: cannot read {path} ({exc.strerror or exc})",
                        hint="give the path of a PNG, JPEG, WebP, GIF or BMP file") from None


def with_images(text: str, images: list[bytes]) -> dict:
    """A user message of `text` after its images."""
    message = {"role": "user", "content": IMAGE_MARKER * len(images) + text}
    if images:
        message["images"] = list(images)
    return message


def slotted(message: dict) -> dict:
    """The message for the engine's prompt: its images' markers as IMAGE_SLOTs (`Engine.encode_rendered`)."""
    n = len(message.get("images", ()))
    if not n:
        return message
    return message | {"content": message["content"].replace(IMAGE_MARKER, IMAGE_SLOT, n)}


def written_text(message: dict) -> str:
    """The text the user wrote: the content without its images' markers."""
    return message["content"].replace(IMAGE_MARKER, "", len(message.get("images", ())))


def openai_parts(message: dict) -> dict:
    """A message with images as OpenAI chat content parts (text, and each image as a data: URL where its marker
    was), for a server."""
    images = message.get("images")
    if not images:
        return message
    pieces = message["content"].split(IMAGE_MARKER, len(images))
    parts: list[dict] = []
    for i, text in enumerate(pieces):
        if text:
            parts.append({"type": "text", "text": text})
        if i < len(images):
            url = f"data:{media_type(images[i]) or 'image/png'};base64," + base64.b64encode(images[i]).decode()
            parts.append({"type": "image_url", "image_url": {"url": url}})
    return {k: v for k, v in message.items() if k != "images"} | {"content": parts}


_MAGIC = ((b"\x89PNG", "image/png"), (b"\xff\xd8", "image/jpeg"), (b"GIF8", "image/gif"), (b"BM", "image/bmp"))


def media_type(data: bytes) -> str | None:
    """The image type the bytes begin as (None: none of those the APIs take)."""
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "image/webp"
    return next((kind for magic, kind in _MAGIC if data.startswith(magic)), None)
