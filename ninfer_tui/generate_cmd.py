"""`ninfer generate`: one prompt in, one completion out (streamed text or a JSON object)."""
from __future__ import annotations

import argparse
import json
import sys

from engine import IMAGE_SLOT, VIDEO_SLOT, FinishEvent, TokenEvent, UserError

from .attachments import read_image
from .launch import engine_from_profile, profile_from_args, sampling_from_args
from .models import display_name


def _prompt_ids(args: argparse.Namespace, engine, media: list) -> list[int]:
    if args.prompt_ids is not None:
        try:
            return [int(x) for x in args.prompt_ids.split(",") if x.strip()]
        except ValueError:
            raise UserError(f"--prompt-ids must be comma-separated integers, got {args.prompt_ids!r}") from None
    if args.chat is not None:
        slots = IMAGE_SLOT * len(args.image) + VIDEO_SLOT * len(args.video)
        return engine.encode_chat([{"role": "user", "content": slots + args.chat}], media=media)
    return engine.tokenizer.encode(args.prompt, add_special=True)


def run_generate(args: argparse.Namespace) -> int:
    profile = profile_from_args(args, announce=not args.json)
    params = sampling_from_args(args, profile)  # bad flags fail before the model loads
    text_prompt = args.prompt if args.prompt is not None else args.chat
    if text_prompt is not None and not text_prompt.strip():
        raise UserError("the prompt is empty", hint="pass some text to --prompt/--chat")
    if args.prompt_ids is not None and not args.prompt_ids.strip():
        raise UserError("--prompt-ids is empty", hint="pass ids like --prompt-ids 1,2,3")
    if (args.image or args.video) and args.chat is None:
        raise UserError("--image and --video go with --chat (they are part of a chat message)",
                        hint="pass the text as --chat TEXT")
    # before the model loads
    files = [(f"--image {path}", read_image(path, f"--image {path}", profile.image_max_mib)) for path in args.image]
    clips = [(f"--video {path}", read_image(path, f"--video {path}", profile.video_max_mib, "video"))
             for path in args.video]
    engine = engine_from_profile(profile, announce=not args.json)
    # a path given twice is two images; each video sampled within the frames the request has left
    images = engine.media([(where, data, False) for where, data in files]
                          + [(where, data, True) for where, data in clips])
    ids = _prompt_ids(args, engine, images)
    if profile.spec != "none" and profile.draft_acceptance > 0:
        # The benchmark drafter drafts what the target produced for this prompt before (engine/runtime/drafting/
        # controlled.py): a first, unreported run records it, so the reported one drafts at the set rate.
        if not args.json:
            print(f"draft_acceptance {profile.draft_acceptance}: a first run records the target's output; the one "
                  "shown drafts from it (its prompt may come from the cache: compare decode speeds)", file=sys.stderr)
        engine.complete(ids, params, images)
    final = None
    for event in engine.generate(ids, params, images):
        if isinstance(event, TokenEvent) and not args.json:
            sys.stdout.write(event.text)
            sys.stdout.flush()
        elif isinstance(event, FinishEvent):
            final = event
    if args.json:
        report = {
            "model": display_name(profile.model), "prompt_tokens": final.prompt_tokens,
            "completion_tokens": final.completion_tokens, "token_ids": final.token_ids, "text": final.text,
            "finish_reason": final.finish_reason, "timings": final.timings.as_dict(),
        }
        if final.spec is not None:
            report["spec"] = final.spec.as_dict()
        print(json.dumps(report))
    else:
        sys.stdout.write("\n")
        t = final.timings
        print(f"[{final.prompt_tokens} prompt tokens, {final.completion_tokens} generated, "
              f"prefill {t.prefill_tok_s:.1f} tok/s, decode {t.decode_tok_s:.1f} tok/s{_spec_note(final.spec)}, "
              f"{final.finish_reason}]",
              file=sys.stderr)
    return 0


def _spec_note(stats) -> str:
    if stats is None or stats.acceptance_rate is None:
        return ""
    return (f", drafts accepted {100 * stats.acceptance_rate:.0f}% ({stats.mean_accepted:.2f} tokens/step, "
            f"{stats.ms_per_round:.1f} ms/round)")
