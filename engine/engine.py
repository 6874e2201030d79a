"""The Engine facade: load a model once, then turn requests into event streams."""
from __future__ import annotations

import threading
from collections.abc import Iterator

import torch

from .config import EngineConfig
from .errors import ContextOverflowError, UserError
from .loaders import load_model
from .models import build_model
from .runtime.generate import generate
from .runtime.request import FinishEvent, SamplingParams, TokenEvent
from .tokenizer.chat_template import ChatTemplate

_DTYPES = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise UserError("device 'cuda' was asked for but no CUDA GPU is visible", hint="use --device cpu")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[name]


class Engine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        loaded = load_model(config.model, self.dtype, self.device)
        self.spec = loaded.spec
        self.tokenizer = loaded.tokenizer
        self.model = build_model(loaded, config.kv_dtype)
        self.model_name = loaded.source
        self.chat_template = None
        if loaded.chat_template:
            tok = self.tokenizer
            bos = tok.token_text(tok.bos_id) if tok.bos_id is not None else ""
            eos = tok.token_text(tok.eos_ids[0]) if tok.eos_ids else ""
            self.chat_template = ChatTemplate(loaded.chat_template, bos, eos)
        # The reference path runs one sequence at a time; requests from several threads take turns.
        self._lock = threading.Lock()

    @property
    def max_context(self) -> int:
        return min(self.config.max_context, self.spec.max_position)

    def encode_chat(self, messages: list[dict], tools: list | None = None, add_generation_prompt: bool = True,
                    **kwargs) -> list[int]:
        if self.chat_template is None:
            raise UserError("this model has no chat template", hint="use a plain prompt (--prompt) instead")
        text = self.chat_template.render(messages, add_generation_prompt=add_generation_prompt, tools=tools, **kwargs)
        return self.tokenizer.encode(text, add_special=True)

    def check_fits(self, prompt_tokens: int, max_tokens: int) -> None:
        if prompt_tokens + max_tokens > self.max_context:
            raise ContextOverflowError(prompt_tokens, max_tokens, self.max_context)

    def generate(self, prompt_ids: list[int], params: SamplingParams) -> Iterator[TokenEvent | FinishEvent]:
        if not prompt_ids:
            raise UserError("the prompt is empty", hint="give at least one token of prompt")
        bad = [t for t in prompt_ids if not 0 <= t < self.spec.vocab_size]
        if bad:
            raise UserError(f"prompt token id {bad[0]} is outside the vocabulary (0..{self.spec.vocab_size - 1})")
        self.check_fits(len(prompt_ids), params.max_tokens)
        return self._run(prompt_ids, params)

    def _run(self, prompt_ids: list[int], params: SamplingParams) -> Iterator[TokenEvent | FinishEvent]:
        with self._lock:
            cache = self.model.new_cache(len(prompt_ids) + params.max_tokens)
            yield from generate(self.model, self.tokenizer, prompt_ids, params, cache, self.config.prefill_chunk)

    def complete(self, prompt_ids: list[int], params: SamplingParams) -> FinishEvent:
        """Run a request to the end and return its FinishEvent."""
        final = None
        for event in self.generate(prompt_ids, params):
            if isinstance(event, FinishEvent):
                final = event
        return final
