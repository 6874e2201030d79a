"""Images and videos for vision-language models: files to tower inputs (`image.py`, `video.py`; both kept by their
file's content, `prepared.py`), the tower behind its cache (`encoder.py`), and their place in a prompt (`prompt.py`)."""
import secrets

# How a chat message's text holds an image or a video, as the Qwen3.5/3.6 chat templates write one
IMAGE_MARKER = "<|vision_start|><|image_pad|><|vision_end|>"
VIDEO_MARKER = "<|vision_start|><|video_pad|><|vision_end|>"
# Where a front end puts an image or a video in a message's text (`Engine.encode_chat` / `encode_rendered` make
# it the marker's ids, and pass the images and videos beside the prompt, `Engine.submit(..., images)`): random
# per process, so no client's text can write one, while the marker written as text stays text
_NONCE = secrets.token_hex(8)
IMAGE_SLOT = f"<ninfer-image-{_NONCE}>"
VIDEO_SLOT = f"<ninfer-video-{_NONCE}>"
# The vision tokens a client's text may spell out: encoded as their characters, never as the tokens
VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>")


def video_container(data: bytes) -> str | None:
    """The FFmpeg demuxer of a video file's bytes, by their signature: MP4/MOV (an ftyp box), Matroska/WebM (EBML) or
    AVI (RIFF); None for anything else (FFmpeg is given that demuxer alone: it probes no other format)."""
    if data[4:8] == b"ftyp":
        return "mp4"
    if data[:4] == b"\x1a\x45\xdf\xa3":
        return "matroska"
    if data[:4] == b"RIFF" and data[8:12] == b"AVI ":
        return "avi"
    return None
