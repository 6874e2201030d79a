"""Images for vision-language models: files to tower inputs (`image.py`), the tower behind its cache
(`encoder.py`), and their place in a prompt (`prompt.py`)."""
import secrets

# How a chat message's text holds an image, as the Qwen3.5/3.6 chat templates write one
IMAGE_MARKER = "<|vision_start|><|image_pad|><|vision_end|>"
# Where a front end puts an image in a message's text (`Engine.encode_chat` / `encode_rendered` make it the
# marker's ids, and pass the image beside the prompt, `Engine.submit(..., images)`): random per process, so no
# client's text can write one, while the marker written as text stays text
IMAGE_SLOT = f"<ninfer-image-{secrets.token_hex(8)}>"
# The vision tokens a client's text may spell out: encoded as their characters, never as the tokens
VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>")
