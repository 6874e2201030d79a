"""Experiment: is greedy output with drafts the output without them, on the GPU paths (graphs, padded verify
steps, masks)? Under a JSON schema (the grammar cuts rounds short) and free with rounds cut short at random
(the same padding without a grammar; from 0 drafts, where a round is a plain
decode step, or from 1). Prints, per prompt and pass, whether the tokens equal the no-draft output,
the first differing position, and the drafts kept.

Usage: python scripts/experiments/spec_identity.py [--preset tinyq|qwen3.6-27b] [--no-graphs] [--weights q5/q4]
  [--kv int8] [--prompts 3] [--tokens 64]
"""
import argparse
import json
import random
import sys
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "scripts")]

from bench_concurrency import PROMPTS, WEIGHTS  # noqa: E402
from bench_grammar import SCHEMA  # noqa: E402

from engine import Engine, EngineConfig, SamplingParams  # noqa: E402
from engine.models import presets  # noqa: E402
from engine.runtime import core, scheduler  # noqa: E402
from engine.runtime.request import Grammar  # noqa: E402

# the tiny model with the Qwen vocabulary (the grammar sees the real tokenizer)
presets.PRESETS["tinyq"] = {**presets.TINY, "vocab_size": 248320, "eos_token_id": 248046}
presets.DRAFTER_PRESETS["dflash-tinyq"] = {**presets.DFLASH_TINY, "vocab_size": 248320, "dflash_config": {
    **presets.DFLASH_TINY["dflash_config"], "mask_token_id": 248070}}

ap = argparse.ArgumentParser()
ap.add_argument("--preset", default="tinyq")
ap.add_argument("--device", default="cuda")
ap.add_argument("--no-graphs", action="store_true")
ap.add_argument("--weights", default="auto", choices=sorted(WEIGHTS))
ap.add_argument("--kv", default="auto")
ap.add_argument("--prompts", type=int, default=3)
ap.add_argument("--tokens", type=int, default=64)
ap.add_argument("--passes", type=int, default=2)
args = ap.parse_args()

cut = {"least": None}  # cut each round's drafts to a random count from `least` to all (None: no cut)
rng = random.Random(0)
propose = core.EngineCore._propose


def cut_propose(self, seqs):
    out = []
    for drafts, verify in propose(self, seqs):
        if cut["least"] is not None and len(drafts) > cut["least"]:
            drafts = list(drafts.tolist() if hasattr(drafts, "tolist") else drafts)
            drafts = drafts[:rng.randrange(cut["least"], len(drafts) + 1)]
            verify = len(drafts) > 0  # a round cut to no drafts is a plain decode step
        out.append((drafts, verify))
    return out


core.EngineCore._propose = cut_propose

# "verify-all": every decoding row of a speculating request runs as a verify row, one without drafts included
forced = {"on": False}
plain_work = scheduler.Work


def work(seq, ids, prefill, drafts=(), **kw):
    if forced["on"] and not prefill:
        kw["keep"] = True
    return plain_work(seq, ids, prefill, list(drafts) if isinstance(drafts, tuple) else drafts, **kw)


scheduler.Work = work
cfg = EngineConfig(f"synthetic:{args.preset}", device=args.device, max_concurrency=1, held_sequences=0,
                   spec="dflash", draft_tokens=7, drafter=f"synthetic:dflash-{args.preset}", draft_acceptance=0.596,
                   adaptive_drafts=False, max_context=2048, weights=WEIGHTS[args.weights], kv_dtype=args.kv,
                   cuda_graphs=args.device == "cuda" and not args.no_graphs)
eng = Engine(cfg)
schema = SamplingParams(max_tokens=args.tokens, temperature=0, ignore_eos=True,
                        grammar=Grammar("json_schema", json.dumps(SCHEMA)))
free = replace(schema, grammar=None)
print(f"{args.preset} weights={args.weights} kv={args.kv} graphs={cfg.cuda_graphs}")
summary = {}
for arm, params, least, verify in (("schema", schema, None, False), ("free-cut0", free, 0, False),
                                  ("free-cut1", free, 1, False), ("free", free, None, False),
                                  ("schema verify-all", schema, None, True), ("free-cut0 verify-all", free, 0, True)):
    cut["least"], forced["on"] = least, verify
    same = total = acc = dr = 0
    for prompt in PROMPTS[:args.prompts]:
        ids = eng.tokenizer.encode(prompt, add_special=True)
        ref = eng.complete(ids, replace(params, speculate=False))
        for i in range(args.passes + 1):  # the first pass fills the controlled drafter's table
            o = eng.complete(ids, params)
            first = next((j for j, (a, b) in enumerate(zip(o.token_ids, ref.token_ids, strict=False)) if a != b), None)
            if i:
                total += 1
                same += o.token_ids == ref.token_ids
                acc, dr = acc + o.spec.accepted, dr + o.spec.drafted
            print(f"  {arm} pass {i}: same={o.token_ids == ref.token_ids} first_diff={first} rounds={o.spec.rounds}"
                  f" drafted={o.spec.drafted} accepted={o.spec.accepted}")
    summary[arm] = f"{same}/{total} identical, accepted/drafted {acc}/{dr}"
print(json.dumps(summary))
