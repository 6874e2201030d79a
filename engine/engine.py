"""The Engine facade: load a model once, then turn requests into event streams."""
from __future__ import annotations

import atexit
import threading
import weakref
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, replace

import torch

from .cache.disk_tier import open_disk_tier
from .cache.held import HeldSequence, HeldSequences
from .cache.kv_cache import KVCache
from .cache.kv_pool import PAGE, BlockTable, KVPool, pages
from .cache.sequence import SequenceCache
from .config import EngineConfig
from .errors import ContextOverflowError, UserError
from .kernels import cpu_build
from .loaders import VISION_PREFIX, load_model, read_spec
from .loaders.converted import settled_config
from .media.encoder import ImageEncoder
from .media.image import Image, ImageBounds, Norm, preprocess
from .media.prepared import PreparedImages
from .media.prompt import PromptMedia, encode_rendered, expand_pads, prompt_media
from .media.video import Video, VideoBounds, preprocess_video
from .memory_plan import GIB, MESSAGE_CHECKPOINTS, MIB, check_fit, plan_memory, tower_patches
from .models import build_model
from .models.vision import VisionTower
from .quant.qweight import load_transform
from .runtime.core import EngineCore
from .runtime.drafting.drafters import make_drafter
from .runtime.request import MAX_CHOICES, FinishEvent, Grammar, SamplingParams, TokenEvent
from .runtime.scheduler import NoRoom, Scheduler
from .runtime.sequence import Sequence
from .tokenizer.chat_template import ChatTemplate
from .tokenizer.grammar import GrammarCompiler
from .tokenizer.tool_grammar import tool_call_grammar

SPARE_TOKENS = PAGE  # what an elastic claim reserves past its prompt (`Engine._claim`)
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


def available_bytes(device: torch.device) -> int:
    """Memory a new engine may use: free GPU memory, or the host's available RAM."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    import psutil

    return psutil.virtual_memory().available


def check_supported(config: EngineConfig) -> None:
    """Refuse settings whose implementation has not landed yet, before anything loads."""
    if config.spec == "dflash" and not config.drafter:
        raise UserError('spec = "dflash" needs a drafter checkpoint, and none is set',
                        hint="pass --drafter FOLDER (e.g. a local copy of z-lab/Qwen3.6-27B-DFlash) or set "
                        "`drafter` in the profile; or use --spec mtp / --spec ngram")


@dataclass
class _Claim:
    """What a request took before it runs: the held conversation it continues (how many of its tokens, and
    whether it shares them or took it over) and new KV blocks for the rest."""

    held: HeldSequence | None
    reused: int
    share: bool  # the held one stays held (see `_claim`)
    blocks: list[int]
    want: int  # blocks the request may fill: prompt + max_tokens
    # An elastic claim reserves only the blocks its table holds, growing as it decodes; when the pool has no more
    # the engine core preempts (`NoRoom`). Another reserves `want` whole: it can never be short.
    elastic: bool = False
    reserved: int = 0  # blocks counted in the engine's reservation for it


class Engine:
    def __init__(self, config: EngineConfig,
                 on_capture: Callable[[int, int], None] | None = None) -> None:
        """`on_capture(done, total)` reports the GPU's load steps (seconds): CUDA-graph captures, then the prefill
        kernels' warm-up."""
        if config.threads:  # process-wide; 0 keeps torch's default
            torch.set_num_threads(config.threads)
        config = settled_config(config)  # a converted folder's weights are in its own formats
        self.config = config
        cpu_build.use_dir(config.cpu_kernels_dir)
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        check_supported(config)
        geometry = read_spec(config.model, config.vision, config.mmproj)
        self.plan = plan_memory(geometry, config, self.device.type)
        # every rank is a process of this host with a host tier of its own, and on the CPU its shard in its RAM
        ranks, on_cpu = config.tensor_parallel, self.device.type == "cpu"
        verdict = check_fit(self.plan, available_bytes(self.device) // (ranks if on_cpu else 1))
        if not verdict.fits:
            each = f" (each of its {ranks} processes)" if on_cpu and ranks > 1 else ""
            raise UserError(f"the model and its settings do not fit in memory on {self.device.type}{each}: "
                            f"{verdict.message()}", hint=verdict.advice)
        # the host tier's budgets, beside the rest of the plan when the engine itself runs in host memory
        ram = available_bytes(torch.device("cpu"))
        need = ranks * (self.plan.host_total + (self.plan.device_total if on_cpu else 0))
        if self.plan.host_total and need > ram:
            tier = ranks * self.plan.host_total
            raise UserError(f"the host memory tier may take {tier / GIB:.2f} GiB of RAM"
                            f"{f' ({ranks} processes)' if ranks > 1 else ''} and "
                            f"{(ram - need + tier) / GIB:.2f} GiB is available for it",
                            hint="lower host_kv_mib or host_state_slots")
        self.parallel = None  # tensor parallelism: the other ranks load their shards while this one loads its own
        if config.tensor_parallel > 1:
            from .parallel.leader import Leader

            self.parallel = Leader(config, geometry, self.dtype, self.device)
        try:
            self._build(config, on_capture)
        except BaseException:
            if self.parallel is not None:  # the other ranks stop with this one's failure
                self.parallel.close()
            raise

    def _build(self, config: EngineConfig, on_capture: Callable[[int, int], None] | None) -> None:
        """The model, its drafter, the KV pool, the graphs and the engine core, as `__init__` settled them."""
        try:
            transform = load_transform(config.weights, config.tiled_weights)
            if self.parallel is not None:
                transform = self.parallel.transform(transform)
            loaded = load_model(config.model, self.dtype, self.device, transform, vision=config.vision,
                                tiled=config.tiled_weights, verified_shards=config.verified_shards,
                                mmproj=config.mmproj)
        except torch.OutOfMemoryError:
            raise UserError(f"out of memory while loading the model on {self.device} (planned "
                            f"{self.plan.device_total / GIB:.2f} GiB)",
                            hint="free GPU memory (`ninfer gpu-clean`) or pick a smaller profile") from None
        self.geometry = loaded.geometry
        self.tokenizer = loaded.tokenizer
        self.vision = loaded.vision
        self.images = None  # the vision tower behind its cache (a vision-language checkpoint)
        self.prepared = PreparedImages()  # image files made ready, by their content
        if loaded.vision is not None:
            tower = {k[len(VISION_PREFIX):]: loaded.weights.pop(k) for k in list(loaded.weights)
                     if k.startswith(VISION_PREFIX)}
            self.images = ImageEncoder(VisionTower(loaded.vision.spec, tower), self.device,
                                       tower_patches(config, loaded.vision.spec.patch_size))
        if config.spec != "mtp":  # the MTP head is only a drafter: free it when another one (or none) runs
            loaded.weights = {k: v for k, v in loaded.weights.items() if not k.startswith("mtp.")}
        self.model = build_model(loaded, config.kv_dtype) if self.parallel is None else \
            self.parallel.model(loaded.geometry, loaded.weights, config.kv_dtype)
        self.drafter = make_drafter(config, self.model)
        # The paged KV pool: every request's KV blocks and those of the held conversations.
        try:
            self.pool = KVPool.for_tokens(config.kv_tokens, self.device)
            self.pool.store("target", self.model.kv_spec())
            if self.drafter is not None and self.drafter.kv_store is not None:
                self.pool.store(*self.drafter.kv_store)
        except torch.OutOfMemoryError:
            raise UserError(f"out of memory while allocating the KV pool ({config.kv_tokens} tokens) on "
                            f"{self.device}", hint="free GPU memory (`ninfer gpu-clean`), or lower kv_capacity / "
                            "max_context or use kv_dtype int8") from None
        # With CUDA graphs every request borrows a lane (a working cache the graphs are captured against, its
        # block table among their inputs). Without, each request has a cache of its own. Either way concurrent
        # requests interleave step by step, their plain decode steps batched (`steps`): with graphs a batch
        # bucket's graph replays them.
        self.lanes = self.runner = None
        if self.device.type == "cuda":
            from .kernels import tiles
            from .runtime.warmup import LoadProgress, warmup_chunks

            tiles.use_file(config.kernel_cache)
            chunks = warmup_chunks(config.graph_prefill_tokens if config.cuda_graphs else 0, config.prefill_chunk,
                                   min(self.max_context, (self.pool.blocks - 1) * PAGE))
            progress = LoadProgress(on_capture, len(chunks))
            if config.cuda_graphs:
                self._capture_graphs(config, progress.captured)
            self._warm_prefill(chunks, progress.warmed)
        self.model_name = loaded.source
        self.grammars = GrammarCompiler(self.tokenizer, self.geometry.vocab_size)
        self.chat_template = None
        if loaded.chat_template:
            tok = self.tokenizer
            bos = tok.token_text(tok.bos_id) if tok.bos_id is not None else ""
            eos = tok.token_text(tok.eos_ids[0]) if tok.eos_ids else ""
            self.chat_template = ChatTemplate(loaded.chat_template, bos, eos)
        opener = open_disk_tier if self.parallel is None else self.parallel.open_disk_tier  # files of the whole model
        disk = opener(config.held_dir, config.held_disk_mib, self.model_name, self.model, config.weights.as_dict(),
                      self.pool)
        self.held = HeldSequences(config.held_sequences, config.host_kv_mib * MIB, config.host_state_slots, disk)
        if disk is not None:
            _WITH_DISK_TIER.add(self)
        self._held_lock = threading.Lock()  # the held conversations, and taking blocks from the pool
        # blocks the running requests may fill: an elastic claim's blocks so far, another's prompt + max_tokens
        self._reserved = 0
        # With graphs a request runs only in a lane: more may not run at once than there are lanes (the rest
        # wait in the pending queue, where stats and the 429 rule count them).
        running = len(self.lanes) if self.lanes is not None else config.max_concurrency
        self.core = EngineCore(self.model, self.runner if self.runner is not None else self.model, self.tokenizer,
                               Scheduler(running, config.max_pending_requests, config.prefill_chunk),
                               self._start, self.drafter, config.draft_tokens, config.adaptive_drafts,
                               fork=self._start)

    def _capture_graphs(self, config: EngineConfig, on_capture: Callable[[int, int], None] | None) -> None:
        from .runtime.lanes import Lanes
        from .runtime.runner import GraphRunner

        sizes = (1,) if config.spec == "none" else (1, config.verify_tokens)
        try:
            self.lanes = Lanes([self.model.new_cache(self.max_context, self.pool)
                                for _ in range(config.graph_lanes)])
            self.runner = GraphRunner(self.model, self.lanes, sizes, self.drafter, config.graph_prefill_tokens,
                                      images=self.images is not None)
            self.runner.capture_all(on_capture)
        except torch.OutOfMemoryError:
            raise UserError(f"out of memory while capturing CUDA graphs on {self.device} (planned "
                            f"{self.plan.device_total / GIB:.2f} GiB in all)",
                            hint="free GPU memory (`ninfer gpu-clean`), lower kv_capacity / max_concurrency / "
                            "draft_tokens, or run without graphs (`--set cuda_graphs=false`)") from None

    def _warm_prefill(self, chunks: list[int], progress: Callable[[int], None]) -> None:
        """The eager prefill chunks' kernels compiled and tuned now, not by the first long prompt
        (`runtime/warmup.py`): on a lane (without graphs, a cache of its own) whose blocks go back after, before
        the engine core exists, so no request, held conversation or counter sees them."""
        from .runtime.warmup import warm_prefill

        if not chunks:
            return
        lane = self.lanes.take() if self.lanes is not None else None
        cache = lane if lane is not None else self.model.new_cache(sum(chunks), self.pool)
        try:
            if cache.kv.table.reserve(sum(chunks)):
                warm_prefill(self.runner if self.runner is not None else self.model, self.drafter, cache, chunks,
                             progress)
        except torch.OutOfMemoryError:
            raise UserError(f"out of memory while running a prefill chunk of {chunks[0]} tokens at load on "
                            f"{self.device} (planned {self.plan.device_total / GIB:.2f} GiB in all)",
                            hint="free GPU memory (`ninfer gpu-clean`), or lower prefill_chunk") from None
        finally:
            cache.release()
            cache.reset()
            if lane is not None:
                self.lanes.give(lane)

    @property
    def max_context(self) -> int:
        return min(self.config.max_context, self.geometry.max_position)

    def encode_chat(self, messages: list[dict], tools: list | None = None, add_generation_prompt: bool = True,
                    media: list[Image] = (), **kwargs) -> list[int]:
        return self.encode_rendered(self.render_chat(messages, tools, add_generation_prompt, **kwargs), media)

    def encode_rendered(self, text: str, media: list[Image] = ()) -> list[int]:
        """A rendered chat's ids: each IMAGE_SLOT a message's text holds becomes an image's marker, each VIDEO_SLOT
        its video's frames with their times (the videos among `media`, in order), and vision tokens the text spells
        out stay text (`media.prompt.encode_rendered`)."""
        return encode_rendered(self.tokenizer, text, [i for i in media if isinstance(i, Video)])

    def render_chat(self, messages: list[dict], tools: list | None = None, add_generation_prompt: bool = True,
                    **kwargs) -> str:
        if self.chat_template is None:
            raise UserError("this model has no chat template", hint="use a plain prompt (--prompt) instead")
        return self.chat_template.render(messages, add_generation_prompt=add_generation_prompt, tools=tools,
                                         **kwargs)

    def check_grammar(self, grammar: Grammar) -> None:
        """Compile a grammar ahead of its request (UserError saying why when it cannot be used); `submit` then
        finds it compiled."""
        self.grammars.compile(grammar)

    def tool_call_grammar(self, tools: list[dict], name: str | None = None, reasoning: bool = False,
                          required: bool = True) -> Grammar:
        """A grammar of tool calls in the form this model's chat template teaches (Qwen's XML, or the JSON one
        of templates without tools), each call's arguments under its tool's JSON schema: one call of the tool
        `name`, or one or more calls of any of `tools` (name None); `required` False allows plain text instead.
        `reasoning`: free reasoning and </think> come first. UserError when a tool's schema cannot be compiled."""
        xml = self.chat_template is not None and self.chat_template.calls_in_xml
        grammar = tool_call_grammar(self.grammars, tools, name, xml, reasoning, required)
        self.check_grammar(grammar)
        return grammar

    def check_fits(self, prompt_tokens: int, max_tokens: int) -> None:
        if prompt_tokens + max_tokens > self.max_context:
            raise ContextOverflowError(prompt_tokens, max_tokens, self.max_context)

    def image(self, data: bytes, where: str = "image") -> Image:
        """An image file (PNG, JPEG, WebP, GIF, BMP) made ready for a prompt, under the engine's bounds (once for a
        file sent again: `PreparedImages`); UserError naming `where` (the request part) when it is refused or the
        model reads no images."""
        v, c = self._vision_for(where, "images", "max_images", self.config.max_images), self.config
        bounds = ImageBounds(c.image_max_mib << 20, c.image_max_pixels, min(v.min_pixels, c.image_max_pixels))
        return self.prepared.get(
            data, lambda digest: preprocess(data, v.spec, bounds, Norm(v.mean, v.std), where, digest), bounds.variant)

    def media(self, parts: list[tuple[str, bytes | Callable[[], bytes], bool]]) -> list[Image]:
        """A request's images and videos made ready in order, from (where, the file's bytes or what fetches them,
        is it a video) parts: refused before any is fetched or decoded where they hold more than max_images images
        (the one place a request's images are counted: every front end makes them ready here), each file fetched
        as its turn comes, each video sampled within the frames the request has left of video_max_frames."""
        c = self.config
        pictures = [where for where, _, video in parts if not video]
        if c.max_images and len(pictures) > c.max_images:  # none at all: the first image says so (`_vision_for`)
            raise UserError(f"{pictures[c.max_images]}: the request has {len(pictures)} images, more than the "
                            f"{c.max_images} a request may send", hint="send fewer images (each turn of a "
                            "conversation sends its images again: start a new one), or raise max_images")
        out, frames = [], c.video_max_frames
        for where, source, video in parts:
            data = source() if callable(source) else source
            if video:
                out.append(self.video(data, where, frames))
                frames -= out[-1].frames
            else:
                out.append(self.image(data, where))
        return out

    def _vision_for(self, where: str, what: str, setting: str, allowed: int):
        """The checkpoint's vision side for a request part of `what` (images, videos), or the UserError naming
        `where`: the server takes none (`setting` is 0) or the model reads none."""
        if not allowed:
            raise UserError(f"{where}: this server takes no {what} ({setting} is 0)",
                            hint=f"send text only, or raise {setting}")
        if self.vision is None:
            raise UserError(f"{where}: this model reads no {what} ({self.model_name} has no vision tower)",
                            hint="send text only, or load a vision-language checkpoint: Qwen3.5/3.6 with its "
                            "vision_config, or its GGUF with the mmproj-*.gguf file beside it (or --mmproj FILE)")
        return self.vision

    def video(self, data: bytes, where: str = "video", max_frames: int | None = None) -> Video:
        """A video file (MP4/MOV, WebM/MKV, AVI) made ready for a prompt under the engine's bounds, at most
        `max_frames` of its frames taken (what the request has left of video_max_frames; all of it by default);
        UserError naming `where` (the request part) when it is refused or the model reads no videos."""
        v, c = self._vision_for(where, "videos", "video_max_frames", self.config.video_max_frames), self.config
        frames = c.video_max_frames if max_frames is None else max_frames
        if frames < v.spec.temporal_patch_size:
            raise UserError(f"{where}: the request's videos before it took its {c.video_max_frames} frames "
                            "(video_max_frames)", hint="send fewer videos, or raise video_max_frames")
        bounds = VideoBounds(c.video_max_mib << 20, frames, c.video_max_pixels, c.video_decode_s)

        def make(digest: bytes) -> Video:
            return preprocess_video(data, v.spec, bounds, v.video, Norm(v.mean, v.std), where, digest)

        return self.prepared.get(data, make, bounds.variant)  # the frame budget shapes what it makes

    def encode_images(self, images: list[Image]) -> torch.Tensor | None:
        """The images' embeddings (the vision tower run on those not in its cache), ahead of `submit`, which takes
        them as `embeds`: a server runs the tower in a worker thread, and submit (on its event loop) neither runs
        it nor waits for another request's encoding. None without images or a tower."""
        if self.images is None or not images:
            return None
        return self.images.encode(list(images))

    def prompt_tokens(self, prompt_ids: list[int], images: list[Image]) -> int:
        """The prompt's length once each image's and video frame's placeholder becomes its pad tokens."""
        return len(prompt_ids) + sum(i.tokens - i.grid[0] for i in images)

    def submit(self, prompt_ids: list[int], params: SamplingParams, images: list[Image] = (),
               embeds: torch.Tensor | None = None) -> Stream:
        """Validate a request and take its place (running or queued) at once; raises UserError for bad input
        and Overloaded when the queue is full. Iterate the Stream for its events; `cancel()` stops it.
        `images` (from `image` and `video`): the prompt's images and videos in the order of their placeholders;
        `embeds`, their `encode_images`, or None to encode them here."""
        return self.submit_choices(prompt_ids, params, 1, images, embeds)[0]

    def submit_choices(self, prompt_ids: list[int], params: SamplingParams, n: int,
                       images: list[Image] = (), embeds: torch.Tensor | None = None) -> list[Stream]:
        """`submit` for n completions of one prompt, which is prefilled once: choice 0 prefills it, and as its
        prefill ends the others start from its cache (full KV blocks shared, the rest and the recurrent state
        copied) and pick their first tokens from the same logits. Choice i samples with seed + i when a seed is
        set (`SamplingParams.choice`), so each is what a single request with that seed gives. The n count as
        one request in the queue."""
        if not 1 <= n <= MAX_CHOICES:
            raise UserError(f"a request may ask for 1..{MAX_CHOICES} choices, got {n}")
        if not prompt_ids:
            raise UserError("the prompt is empty", hint="give at least one token of prompt")
        media = None
        if images:
            prompt_ids, media = self._with_images(list(prompt_ids), list(images), embeds)
            params = replace(params, speculate=False)  # drafters know no M-RoPE positions
        bad = [t for t in prompt_ids if not 0 <= t < self.geometry.vocab_size]
        if bad:
            raise UserError(f"prompt token id {bad[0]} is outside the vocabulary (0..{self.geometry.vocab_size - 1})")
        self.check_fits(len(prompt_ids), params.max_tokens)
        if pages(len(prompt_ids) + params.max_tokens) > self.pool.blocks - 1:
            raise UserError(f"the prompt and max_tokens ({len(prompt_ids)} + {params.max_tokens} tokens) exceed "
                            f"the KV pool ({(self.pool.blocks - 1) * PAGE} tokens)",
                            hint="lower max_tokens, or raise kv_capacity")
        matcher = self.grammars.matcher(params.grammar) if params.grammar is not None else None
        seqs = [Sequence(list(prompt_ids), params.choice(i), self.message_starts(prompt_ids), self._checkpoint,
                         matcher if i == 0 or matcher is None else matcher.copy(), media)
                for i in range(n)]
        seqs[0].forks = seqs[1:]
        seqs[0].loading = self._read_held(seqs[0].keys)
        try:
            self.core.add(seqs[0])
        except BaseException:
            if seqs[0].loading is not None:
                seqs[0].loading.cancel()  # refused (Overloaded): the read has no request to serve
            raise
        return [Stream(self.core, seq) for seq in seqs]

    def _read_held(self, keys: list[int]) -> Future | None:
        """The disk tier's read of a held conversation the prompt continues (`HeldSequences.read`), begun as the
        request queues: it waits for the file in the queue (`_loaded`) while the step loop runs the others, and
        the core looks again once the read is done."""
        def served() -> int:
            with self._held_lock:
                return self.held.best(keys)[1]

        loading = self.held.read(keys, served)
        if loading is not None:
            loading.add_done_callback(lambda _: self.core.wake())
        return loading

    def _with_images(self, prompt_ids: list[int], images: list[Image],
                     embeds: torch.Tensor | None) -> tuple[list[int], PromptMedia]:
        """The prompt with its image and video pads expanded, and its images' and videos' embeddings (`embeds`, or
        the tower run here on those not in its cache) and M-RoPE positions."""
        c = self.config
        what, setting = ("videos", "video_max_frames") if all(isinstance(i, Video) for i in images) else (
            "images", "max_images")
        v = self._vision_for("the request", what, setting, getattr(c, setting))  # past it, the tower is loaded
        frames = sum(i.frames for i in images if isinstance(i, Video))
        if frames > c.video_max_frames:
            raise UserError(f"the request's videos have {frames} frames, more than the {c.video_max_frames} a "
                            "request may send", hint="send fewer or shorter videos, or raise video_max_frames")
        pads = (v.image_token_id, v.video_token_id)
        ids = expand_pads(prompt_ids, pads, images)
        self.check_fits(len(ids), 1)
        if embeds is None:
            embeds = self.images.encode(images)
        return ids, prompt_media(ids, pads, images, embeds, v.spec.spatial_merge_size)

    def generate(self, prompt_ids: list[int], params: SamplingParams,
                 images: list[Image] = ()) -> Iterator[TokenEvent | FinishEvent]:
        return iter(self.submit(prompt_ids, params, images))

    def complete(self, prompt_ids: list[int], params: SamplingParams, images: list[Image] = ()) -> FinishEvent:
        """Run a request to the end and return its FinishEvent."""
        final = None
        for event in self.generate(prompt_ids, params, images):
            if isinstance(event, FinishEvent):
                final = event
        return final

    def stats(self) -> dict:
        with self._held_lock:
            held = len(self.held)
        runner = self.runner
        pool = self.pool
        sched = self.core.scheduler
        return {"running": len(sched.running), "pending": sched.pending, "held_sequences": held,
                "kv_tokens_in_use": (pool.blocks - 1 - pool.free_blocks) * PAGE,
                "kv_tokens_free": pool.free_blocks * PAGE,
                "cuda_graph_sizes": list(runner.captured) if runner is not None else [],
                "cuda_graph_batches": list(runner.captured_batches) if runner is not None else [],
                "lanes": len(self.lanes) if self.lanes is not None else 0,
                "batched_steps": self.core.batched_steps, "prefill_tokens": self.core.prefilled,
                "drafted_tokens": self.core.drafted,
                "accepted_tokens": self.core.accepted, "preemptions": self.core.preemptions,
                "draft_choice": self.core.load_choice.summary() if self.core.load_choice is not None else {}}

    def drop_held(self) -> None:
        """Forget the held conversations (and the disk tier's files so far): the next prompt prefills whole."""
        with self._held_lock:
            self.held.clear()

    def close(self) -> None:
        """Stop every request; with the disk tier, write the held conversations to it, wait for the files and
        stop its threads; with tensor parallelism, stop the other ranks."""
        self.core.stop()
        with self._held_lock:
            self.held.persist()
        if self.held.disk is not None:
            self.held.disk.close()  # outside the lock: a read under way asks what memory serves
        _WITH_DISK_TIER.discard(self)  # written: nothing more for the exit hook
        if self.parallel is not None:
            self.parallel.close()

    def _claim(self, prompt_ids: list[int], max_tokens: int, elastic: bool) -> _Claim | None:
        """A request's share of the KV pool: blocks for the prompt now and the rest as it decodes (`_grow`), and a
        reservation: of the blocks it holds and one more when `elastic` (it is admitted while they fit; the core
        preempts it, or a newer one, where the pool runs out), else of prompt + max_tokens (the running
        requests' never exceed the pool, so every one can finish; None while the others' leave too little). The held
        conversation that serves most of its prompt is taken over when the prompt continues all of it (its
        blocks become the request's), shared when the prompt leaves it earlier (an edited message, another
        request on the same system prompt: it stays held, and its full blocks of the reused tokens serve both).
        Held conversations are dropped, oldest first, while the pool lacks blocks."""
        want, now = pages(len(prompt_ids) + max_tokens), pages(len(prompt_ids))
        # an elastic request reserves SPARE_TOKENS of room past its prompt (fewer where it has fewer to make), and
        # waits for them: admitted with none, its first decoded tokens would need a block at once, and
        # it, the newest running, would be preempted again right after its prefill; reserved, so that requests
        # admitted together do not count one spare block twice
        reserve = pages(len(prompt_ids) + min(SPARE_TOKENS, max_tokens)) if elastic else want
        with self._held_lock:
            if self._reserved + reserve > self.pool.blocks - 1:
                return None
            # reserved once the blocks are had: where taking them fails (or raises) nothing is left counted
            claim = (self._claim_blocks(prompt_ids, now, want)
                     or self._claim_blocks(prompt_ids, now, want, reuse=False))
            if claim is None:
                return None
            self._reserved += reserve
            claim.elastic, claim.reserved = elastic, reserve
            return claim

    def _claim_fork(self, first: Sequence, max_tokens: int) -> _Claim | None:
        """A further choice's claim: its reservation, and blocks for its prompt past the full blocks it shares
        with the first choice, whose whole prompt it reuses as a shared held prefix would be (`_prepare_cache`
        copies the rest and the recurrent state); None when the pool cannot give them."""
        n = len(first.prompt_ids)
        want, now = pages(n + max_tokens), pages(n) - n // PAGE
        with self._held_lock:
            if self._reserved + want > self.pool.blocks - 1:
                return None
            while self.pool.free_blocks < now and self.held.drop_oldest():
                pass
            blocks = self.pool.allocate(now)
            if blocks is None:
                return None
            self._reserved += want
        return _Claim(HeldSequence(first.keys, first.cache), n, True, blocks, want, reserved=want)

    def _claim_blocks(self, prompt_ids: list[int], now: int, want: int, reuse: bool = True) -> _Claim | None:
        """`_claim`'s blocks for the prompt (`now`), with the best held conversation's when `reuse`; None when the
        pool cannot give them with that one kept (the held ones' blocks it may drop included)."""
        held, n = self.held.best(prompt_ids) if reuse else (None, 0)
        share = held is not None and n < len(held.tokens)
        ids = held.cache.kv.table.ids if held is not None and isinstance(held.cache.kv, KVCache) else []
        reused = 0 if not ids else n // PAGE if share else min(len(ids), pages(n))
        spare = [] if share else ids[reused:]  # a taken one's blocks past the reused tokens
        others = [h.cache.kv.table.ids for h in self.held if h is not held and isinstance(h.cache.kv, KVCache)]
        new = now - reused
        if self.pool.free_blocks + self.pool.freeable([spare, *others]) < new:
            return None
        if share:
            self.held.touch(held)
        elif held is not None:
            self.held.take(held)
            if ids:
                held.cache.kv.table.truncate(n)
        while self.pool.free_blocks < new:
            self.held.drop_oldest(keep=held)
        return _Claim(held, n, share, self.pool.allocate(new), want)

    def _grow(self, table: BlockTable, tokens: int, claim: _Claim) -> None:
        """Blocks for a running request's first `tokens` tokens, dropping held conversations (oldest first) while
        the pool lacks them: within its reservation the pool always has them once no held one is left. An
        elastic claim reserves them first, or raises NoRoom when the others' reservations leave too few."""
        with self._held_lock:
            more = pages(tokens) - len(table.ids)
            if claim.elastic and (beyond := pages(tokens) - claim.reserved) > 0:  # past what it holds in reserve
                if self._reserved + beyond > self.pool.blocks - 1:
                    raise NoRoom(f"{beyond} more KV blocks for {tokens} tokens")
                self._reserved += beyond
                claim.reserved += beyond
            while self.pool.free_blocks < more and self.held.drop_oldest():
                pass
            ids = self.pool.allocate(more)
            if ids is None:
                raise RuntimeError(f"the KV pool has {self.pool.free_blocks} free blocks, a request within its "
                                   f"reservation needs {more}")
            table.add(ids)

    def _start(self, seq: Sequence, first: Sequence | None = None) -> bool:
        """Admit a request (on the core's thread): a lane or a cache of its own, its claim on the KV pool, the
        held prefix it reuses, or with `first` the cache of a request for several choices whose prefill just
        ended (`_claim_fork`). False while the running requests leave no room."""
        if first is None and not self._loaded(seq):
            return False
        # a request with images runs in a lane too: its prompt's steps eagerly, the rest in the graphs with its
        # M-RoPE delta (`runtime/runner.py`)
        lane = self.lanes.take() if self.lanes is not None else None
        if self.lanes is not None and lane is None:
            return False
        # plain requests claim elastically; one with images (its positions past the prompt turn by the images'),
        # one whose further choices start from its prefill, a further choice, and the ranks of tensor parallelism
        # reserve their whole length and are never preempted
        seq.elastic = elastic = first is None and seq.media is None and not seq.forks and self.parallel is None
        claim = (self._claim(seq.keys, seq.remaining, elastic) if first is None
                 else self._claim_fork(first, seq.remaining))
        if claim is None:
            if lane is not None:
                self.lanes.give(lane)
            return False
        if first is not None:  # its cache's state is the first one's: so are the checkpoints taken so far
            seq.snapshots = dict(first.snapshots)
        cache = lane
        try:
            if cache is None:
                cache = self.model.new_cache(len(seq.fed_ids) + seq.remaining, self.pool)
            self._prepare_cache(cache, claim)
            cache.media = seq.media
            seq.start(cache, self.tokenizer, self.geometry.vocab_size, self.device)
        except BaseException:
            if cache is None:  # its cache could not be made: the claim's blocks are in no table yet
                self._drop_claim(claim)
            self._release(cache, claim, lane)
            raise
        seq.release = lambda s, hold: self._finished(s, hold, claim, lane)
        return True

    def _loaded(self, seq: Sequence) -> bool:
        """Whether the request may start: False while the disk tier still reads the held conversation it
        continues (`_read_held`); once read, that one is held, for the request's claim to find."""
        loading = seq.loading
        if loading is None:
            return True
        if not loading.done():
            return False
        seq.loading = None
        loaded = None if loading.cancelled() else loading.result()
        if loaded is not None:
            with self._held_lock:
                self.held.hold_loaded(loaded)
        return True

    def _finished(self, seq: Sequence, hold: bool, claim: _Claim, lane: SequenceCache | None) -> None:
        """A request ended: kept as a held conversation when it ended normally, then what it took goes back."""
        try:
            if hold:
                self._hold(seq.history, seq.cache, seq.snapshots)
        finally:
            self._release(seq.cache, claim, lane)

    def _release(self, cache: SequenceCache | None, claim: _Claim, lane: SequenceCache | None) -> None:
        try:
            if cache is not None:
                cache.release()
        finally:
            self._unclaim(claim)
            if lane is not None:
                self.lanes.give(lane)

    def _checkpoint(self, seq: Sequence, position: int) -> None:
        """A prefill checkpoint, kept for holding: in host memory with the host tier's state slots (none where it
        has one there already: a further choice has the first one's)."""
        if seq.cache.states is not None and position not in seq.snapshots:
            seq.snapshots[position] = seq.cache.states.snapshot(host=self.config.host_state_slots > 0)

    def _prepare_cache(self, cache: SequenceCache, claim: _Claim) -> SequenceCache:
        """The request's cache with its claimed blocks and reservation, holding the claim's reused prefix (the
        held conversation's recurrent state from the checkpoint there), or empty."""
        cache.reset()
        cache.kv.table.add(claim.blocks)
        held, n = claim.held, claim.reused
        if held is not None:
            checkpoint = held.checkpoints[n] if n != len(held.tokens) and held.cache.states is not None else None
            cache.load(held.cache, n, checkpoint, claim.share)
        table = cache.kv.table
        cache.limit, cache.grow = claim.want * PAGE, lambda tokens: self._grow(table, tokens, claim)
        return cache

    def _drop_claim(self, claim: _Claim) -> None:
        """Give back the blocks of a claim no cache took: its new ones, and a held conversation's it took over."""
        with self._held_lock:
            self.pool.release(claim.blocks)
            if claim.held is not None and not claim.share:
                claim.held.cache.release()

    def _unclaim(self, claim: _Claim) -> None:
        with self._held_lock:
            self._reserved -= claim.reserved

    def _hold(self, tokens: list[int], cache: SequenceCache, checkpoints: dict) -> None:
        """Keep the finished sequence; `tokens` are those it may hold (the prompt and the output), of which the
        cache holds the first `cache.length`."""
        if not self.config.held_sequences or not cache.length:  # preempted before it ran: nothing worth a place
            return
        held = HeldSequence(tokens[: cache.length],
                            cache.detach(self.config.host_kv_mib > 0, self.config.host_state_slots > 0),
                            checkpoints)
        with self._held_lock:
            self.held.put(held)

    def message_starts(self, ids: list[int]) -> tuple[int, ...]:
        """Where the last MESSAGE_CHECKPOINTS messages of a chat prompt start (their turn markers): the places
        where clients change a resent conversation (an edited last message, history moved before a note)."""
        marker = self.tokenizer.special.get("<|im_start|>")
        if marker is None:
            return ()
        starts = [i for i, t in enumerate(ids) if t == marker]
        return tuple(starts[-1 - MESSAGE_CHECKPOINTS:-1])  # the last marker opens the generation prompt


_WITH_DISK_TIER: weakref.WeakSet[Engine] = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    """At exit, the held conversations of engines with a disk tier go to disk: a restart continues them."""
    for engine in list(_WITH_DISK_TIER):
        engine.close()


class Stream:
    """One request's events, in order, as the engine core makes them. Iterating waits for each; `cancel()` (or
    `close()`) from any thread stops the request, queued or running, and frees what it holds at the core's next
    step. A stream dropped unread is cancelled too."""

    def __init__(self, core: EngineCore, seq: Sequence) -> None:
        self._core, self._seq = core, seq
        self.prompt_ids, self.params = seq.prompt_ids, seq.params

    def cancel(self) -> None:
        if not self._seq.finished:
            self._core.cancel(self._seq)

    close = cancel

    def __del__(self) -> None:
        self.cancel()

    def __iter__(self) -> Iterator[TokenEvent | FinishEvent]:
        while True:
            event = self._seq.events.get()
            if isinstance(event, BaseException):
                raise event
            yield event
            if isinstance(event, FinishEvent):
                return
