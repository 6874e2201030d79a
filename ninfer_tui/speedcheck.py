"""`ninfer speedcheck`: the fixed 8K short-code task, timed, compared with a reference, with a verdict."""
from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from engine import FinishEvent, SamplingParams, TokenEvent

from . import speed_reference
from .doctor import Finding
from .launch import engine_from_profile
from .profiles import Profile, with_overrides

CONTEXT = 8192
PLAIN_TOKENS = 256  # the comparison run without drafts (the drafter still follows the text, as it must)
# The fixed task: short code in, a lot of code out (what the reference figures were measured on).
TASK = """You are an expert Python developer. Write a complete, production-quality Python module `lru_ttl.py` that
implements a thread-safe LRU cache with per-entry time-to-live:

- class `LRUCache(capacity: int, default_ttl: float | None = None)`
- methods `get(key, default=None)`, `put(key, value, ttl=None)`, `delete(key)`, `clear()`, `__len__`,
  `__contains__`, and `stats()` returning hits, misses, evictions and expirations
- a decorator `cached(cache, key=None)` for functions
- O(1) operations with a dict and a doubly linked list, a lock around every mutation
- expired entries removed lazily on access and by a `purge()` method

Then write a pytest test suite covering every method, eviction order, TTL expiry (with a fake clock), the
decorator, and concurrent access from 8 threads. Explain the design briefly at the end."""


@dataclass
class SpeedReport:
    model: str
    profile: str
    device: str
    gpu: str | None
    kv_dtype: str
    prompt_tokens: int
    completion_tokens: int
    prefill_tok_s: float
    decode_tok_s: float
    ttft_s: float
    round_ms: float
    acceptance_rate: float | None
    mean_accepted: float | None
    peak_gpu_mem_mib: float | None
    reference_tok_s: float | None
    reference_source: str | None
    verdict: str
    tok_s_series: list[float] = field(default_factory=list)  # decode tok/s per 1/20 of the run
    # with a drafter: the same prompt decoded without drafts (a shorter run), and what the two say
    plain_decode_tok_s: float | None = None
    spec_advice: str = ""
    requested_tokens: int = 0  # the run's length: as asked, within the context
    partial: bool = False  # interrupted (Ctrl+C): the figures cover the tokens generated until then
    # the compared row's kind ("measured", "projected": a model's projection, or "other engine"), and every row
    # for this GPU, profile and drafter (ninfer's own first, the other engine's beside them)
    reference_kind: str | None = None
    references: list[dict] = field(default_factory=list)

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def speed_profile(profile: Profile) -> Profile:
    """The profile as the speed check runs it: 8K context, INT8 KV unless the profile says more."""
    kv = profile.kv_dtype if profile.kv_dtype in ("bf16", "fp8", "int8") else "int8"
    return with_overrides(profile, {"max_context": CONTEXT, "kv_dtype": kv,
                                    "kv_capacity": max(profile.kv_capacity, CONTEXT) if profile.kv_capacity else 0})


def default_tokens(profile: Profile) -> int:
    """How many tokens the check generates unless told: as many as the reference run for this device and profile
    (its row's `new_tokens` in speed_references.json, which a CPU row keeps short)."""
    import torch

    from engine.engine import resolve_device

    device = resolve_device(profile.device)
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    return speed_reference.task_tokens(gpu, profile.name, speed_profile(profile).spec)


def verdict(measured: float, ref: speed_reference.Reference | None, profile: Profile,
            findings: list[Finding], others: list[speed_reference.Reference] = ()) -> str:
    """What the measurement says against `ref` (and the rows `others` shown beside it), and what explains a gap."""
    machine = [f for f in findings if f.verdict == "warn" and f.category in ("gpu", "system")]
    config = [f for f in findings if f.verdict == "warn" and f.category == "config"]
    if ref is not None:
        config += [Finding("config", key, f"{getattr(profile, key)} (reference: {want})", "warn")
                   for key, want in ref.setup.items() if getattr(profile, key, want) != want
                   and not any(c.check.startswith(key) for c in config)]
    reasons = "; ".join(f"{f.check}: {f.value}" + (f" ({f.note})" if f.note else "") for f in machine)
    knobs = "; ".join(f"{f.check}: {f.value}" + (f" ({f.note})" if f.note else "") for f in config)
    if ref is None:
        text = f"Measured {measured:.1f} tok/s. ninfer's reference table has no row for this GPU and profile, so " \
               "there is nothing to compare with."
        if reasons:
            text += f" The machine check found: {reasons}."
        return text
    pct = 100 * measured / ref.decode_tok_s
    what = {"measured": "ninfer's measured", "projected": "ninfer's PROJECTED (a model, not a measurement)",
            "other engine": "the other engine's"}[ref.kind]
    head = f"Measured {measured:.1f} tok/s, {pct:.0f}% of {what} {ref.decode_tok_s:.1f} tok/s here " \
           f"({ref.source})."
    head += "".join(f" The other engine's figure here: {o.decode_tok_s:.1f} tok/s ({o.source})."
                    for o in others if o.kind == "other engine" and o is not ref)
    if pct >= 90:
        return head + " That is on par (or better): nothing to fix."
    if reasons:
        return head + f" The gap is this machine: {reasons}." + (f" The configuration also differs: {knobs}."
                                                                 if knobs else "")
    if config:
        return head + f" The machine looks fine; the gap is the configuration: {knobs}."
    return head + " Neither the machine check nor the configuration explains the gap: the remaining difference is " \
                  "hardware the doctor cannot see (host CPU, memory speed) or the engine itself."


def run_speedcheck(profile: Profile, max_new_tokens: int, findings: list[Finding] = (),
                   on_token: Callable[[int], None] | None = None, announce: bool = True) -> SpeedReport:
    """Load the profile's model, warm up, run the task greedily for exactly `max_new_tokens` tokens. Ctrl+C
    during the run returns the figures so far, marked partial."""
    import torch

    run_profile = speed_profile(profile)
    engine = engine_from_profile(run_profile, announce=announce)
    ids = engine.encode_chat([{"role": "user", "content": TASK}])
    new_tokens = max(1, min(max_new_tokens, engine.max_context - len(ids)))
    # warm-up on the task's own prompt: the path the run measures (a shorter prompt's chunks take other kernels, or
    # graphed pieces on a GPU, and the measured prefill paid what they left to compile)
    engine.complete(ids, SamplingParams(max_tokens=8, temperature=0))
    engine.drop_held()  # the measured run prefills the whole prompt
    cuda = engine.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    t0 = time.perf_counter()
    stamps: list[float] = []
    final = None
    stream = engine.submit(ids, params)
    try:
        for event in stream:
            if isinstance(event, TokenEvent) and event.token_id is not None:
                stamps.append(time.perf_counter())
                if on_token:
                    on_token(len(stamps))
            elif isinstance(event, FinishEvent):
                final = event
    except KeyboardInterrupt:
        pass  # the figures so far are the report
    finally:
        stream.close()  # its slot and KV blocks back to the engine, however the run ended
    gpu = torch.cuda.get_device_name(engine.device) if cuda else None
    rows = speed_reference.matching(gpu, profile.name, run_profile.spec)
    ref = rows[0] if rows else None
    report = SpeedReport(
        model=engine.model_name, profile=profile.name, device=str(engine.device), gpu=gpu,
        kv_dtype=run_profile.kv_dtype, prompt_tokens=len(ids), completion_tokens=len(stamps), prefill_tok_s=0.0,
        decode_tok_s=0.0, ttft_s=stamps[0] - t0 if stamps else 0.0, round_ms=0.0, acceptance_rate=None,
        mean_accepted=None, peak_gpu_mem_mib=torch.cuda.max_memory_allocated(engine.device) / 2**20 if cuda else None,
        reference_tok_s=ref.decode_tok_s if ref else None, reference_source=ref.source if ref else None, verdict="",
        tok_s_series=_series(stamps), requested_tokens=new_tokens, partial=final is None,
        reference_kind=ref.kind if ref else None, references=[r.as_dict() for r in rows])
    if final is None:
        return _partial(report, stamps, rows, run_profile, list(findings))
    t, spec = final.timings, final.spec
    rounds = spec.rounds if spec else t.decode_steps  # without drafts each round yields one token
    plain = None
    if spec is not None:  # the same prompt without drafts: does speculation pay on this machine?
        params = SamplingParams(max_tokens=min(new_tokens, PLAIN_TOKENS), temperature=0, ignore_eos=True,
                                speculate=False)
        plain = engine.complete(ids, params).timings.decode_tok_s
    return dataclasses.replace(
        report, prompt_tokens=final.prompt_tokens, completion_tokens=final.completion_tokens,
        prefill_tok_s=t.prefill_tok_s, decode_tok_s=t.decode_tok_s,
        round_ms=1000 * t.decode_s / rounds if rounds else 0.0,
        acceptance_rate=spec.acceptance_rate if spec else None, mean_accepted=spec.mean_accepted if spec else None,
        verdict=verdict(t.decode_tok_s, ref, run_profile, list(findings), rows), plain_decode_tok_s=plain,
        spec_advice=spec_advice(t.decode_tok_s, plain, spec, run_profile))


def _partial(report: SpeedReport, stamps: list[float], rows: list[speed_reference.Reference], profile: Profile,
             findings: list[Finding]) -> SpeedReport:
    """The figures of an interrupted run, from the tokens' arrival times: prefill from the time to the first
    token, decode from the tokens after it (as the engine counts them)."""
    n = len(stamps)
    head = f"Interrupted after {n} of {report.requested_tokens} tokens: partial figures."
    if n < 2:
        return dataclasses.replace(report, prefill_tok_s=report.prompt_tokens / report.ttft_s if n else 0.0,
                                   verdict=head + " Too few tokens for a decode speed.")
    decode = (n - 1) / (stamps[-1] - stamps[0])
    per_token = profile.spec == "none"  # with drafts a round yields several tokens: rounds are not known here
    return dataclasses.replace(report, prefill_tok_s=report.prompt_tokens / report.ttft_s, decode_tok_s=decode,
                               round_ms=1000 / decode if per_token else 0.0,
                               verdict=head + " " + verdict(decode, rows[0] if rows else None, profile, findings,
                                                            rows))


def spec_advice(spec_tok_s: float, plain_tok_s: float | None, stats, profile: Profile) -> str:
    """Whether the drafts paid for themselves in this run, with the numbers and the knob to turn."""
    if plain_tok_s is None or stats is None or not plain_tok_s:
        return ""
    gain = spec_tok_s / plain_tok_s
    seen = (f"Speculative decoding ({profile.spec}, draft_tokens {profile.draft_tokens}): {spec_tok_s:.1f} tok/s "
            f"with drafts vs {plain_tok_s:.1f} tok/s without on the same prompt ({gain:.2f}x; acceptance "
            f"{100 * (stats.acceptance_rate or 0):.0f}%, {stats.mean_accepted:.2f} tokens per round).")
    if not stats.accepted:  # every token came from the target alone: a gap either way is the runs' own noise
        return seen + " No draft was accepted on this text, so drafting cannot have paid: set spec = \"none\", " \
                      "or measure on text that repeats its context (code edits) or with the checkpoint's drafter."
    if gain >= 1.05:
        return seen + " The drafts pay."
    if gain > 0.95:
        return seen + " The drafts about break even here: try fewer draft_tokens, or spec = \"none\"."
    return seen + " The drafts cost more than they save on this machine and text: set spec = \"none\" (or " \
                  "fewer draft_tokens) in the profile."


def _series(stamps: list[float], buckets: int = 20) -> list[float]:
    """Decode tok/s over the run, in up to `buckets` slices of equal token count (the first token excluded)."""
    if len(stamps) < 3:
        return []
    n = len(stamps) - 1
    size = max(1, n // buckets)
    out = []
    for i in range(1, len(stamps) - size + 1, size):
        dt = stamps[i + size - 1] - stamps[i - 1]
        out.append(size / dt if dt > 0 else 0.0)
    return out


def plot(series: list[float], height: int = 8) -> str:
    """tok/s over the run as rows of block characters (one column per slice), with the scale on the left."""
    top = max(series)
    lo = min(series)
    levels = " ▁▂▃▄▅▆▇█"
    rows = []
    for r in range(height - 1, -1, -1):
        line = ""
        for v in series:
            fill = (v / top) * height - r if top > 0 else 0
            line += levels[max(0, min(8, round(fill * 8)))] * 2
        label = f"{top:8.1f} |" if r == height - 1 else (f"{0:8.1f} |" if r == 0 else f"{'':8s} |")
        rows.append(label + line)
    rows.append(f"{'':8s} +{'-' * 2 * len(series)}  decode tok/s over the run (min {lo:.1f}, max {top:.1f})")
    return "\n".join(rows)
