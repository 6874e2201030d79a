"""CLI for `ninfer speedcheck`, `ninfer doctor` and `ninfer gpu-clean` (the TUI screens call the same modules)."""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from engine.errors import UserError

from .launch import add_engine_args, profile_from_args


def add_parsers(sub) -> None:
    s = sub.add_parser("speedcheck", help="the fixed 8K short-code speed test, with a verdict")
    add_engine_args(s)
    s.add_argument("--max-new-tokens", type=int, default=None,
                   help="tokens to generate (default: as many as the reference run for this device and profile)")
    s.add_argument("--json", action="store_true", help="print the report as JSON (paste it into a forum thread)")
    s.add_argument("--plot", action="store_true", help="plot tok/s over the run in the terminal")
    d = sub.add_parser("doctor", help="what decides speed on this machine")
    d.add_argument("--profile", "-P", help="the profile to diagnose (default: the default profile)")
    d.add_argument("--json", action="store_true", help="print the findings as JSON")
    g = sub.add_parser("gpu-clean", help="find and end stale processes that hold the GPU (by PID only)")
    g.add_argument("--pid", type=int, action="append", default=[], help="end this PID (repeatable)")
    g.add_argument("--dry-run", action="store_true", help="show what would be done, end nothing")
    g.add_argument("--yes", "-y", action="store_true", help="do not ask before ending processes")
    g.add_argument("--json", action="store_true", help="print what was found and done as JSON")
    g.add_argument("--device-glob", default="/dev/nvidia*", help=argparse.SUPPRESS)
    g.add_argument("--proc-root", default="/proc", help=argparse.SUPPRESS)


def run_doctor(args: argparse.Namespace) -> int:
    from . import profiles
    from .doctor import as_json, diagnose, render

    profile = profiles.select(args.profile, announce=lambda m: print(m, file=sys.stderr))
    findings = diagnose(profile)
    if args.json:
        print(json.dumps(as_json(findings), indent=2))
    else:
        print(render(findings))
        warns = sum(f.verdict == "warn" for f in findings)
        print(f"\n{warns} warning(s)" if warns else "\nno warnings")
    return 0


def run_speedcheck_cmd(args: argparse.Namespace) -> int:
    """The check, its report and verdict; Ctrl+C during the run prints the figures so far, marked partial, and
    exits 130."""
    from .doctor import diagnose
    from .progress import Progress
    from .speedcheck import default_tokens, plot, run_speedcheck

    if args.max_new_tokens is not None and args.max_new_tokens < 1:
        raise UserError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    profile = profile_from_args(args)
    n = default_tokens(profile) if args.max_new_tokens is None else args.max_new_tokens
    findings = diagnose(profile, own_pids={os.getpid()})
    bar = Progress("speedcheck", n)
    try:
        report = run_speedcheck(profile, n, findings, on_token=lambda i: bar.advance(1), announce=not args.json)
    finally:
        bar.close()
    code = 130 if report.partial else 0
    if args.json:
        print(json.dumps({**report.as_dict(), "doctor": [f.__dict__ for f in findings]}, indent=2))
        return code
    partial = f" (partial: {report.completion_tokens} of {report.requested_tokens})" if report.partial else ""
    rows = [("model", report.model), ("profile", f"{report.profile} (kv {report.kv_dtype})"),
            ("device", report.gpu or report.device),
            ("prompt / generated", f"{report.prompt_tokens} / {report.completion_tokens} tokens{partial}"),
            ("prefill", f"{report.prefill_tok_s:.1f} tok/s"), ("decode", f"{report.decode_tok_s:.2f} tok/s"),
            ("time to first token", f"{report.ttft_s:.3f} s"), ("time per round", f"{report.round_ms:.2f} ms"),
            ("acceptance", "n/a (no speculative decoding)" if report.acceptance_rate is None else
             f"{100 * report.acceptance_rate:.1f}% (mean accepted {report.mean_accepted:.2f})"),
            ("decode without drafts", "n/a" if report.plain_decode_tok_s is None else
             f"{report.plain_decode_tok_s:.2f} tok/s"),
            ("peak GPU memory", "n/a (CPU)" if report.peak_gpu_mem_mib is None else
             f"{report.peak_gpu_mem_mib:.0f} MiB"),
            ("reference", "none for this GPU and profile" if report.reference_tok_s is None else
             f"{report.reference_tok_s:.1f} tok/s [{report.reference_kind}] ({report.reference_source})")]
    for k, v in rows:
        print(f"{k:22s} {v}")
    if args.plot and report.tok_s_series:
        print(plot(report.tok_s_series))
    print(f"\n{report.verdict}")
    if report.spec_advice:
        print(report.spec_advice)
    return code


def run_gpu_clean(args: argparse.Namespace) -> int:
    from engine.server.lifecycle import scan_servers

    from .gpu_clean import find_holders, plan_actions, terminate
    from .gpu_info import read_nvml
    from .serve_cmd import report_skipped, run_dir

    scan = scan_servers(run_dir())
    report_skipped(scan.problems)
    holders = plan_actions(find_holders(args.device_glob, Path(args.proc_root), read_nvml(), scan.servers), args.pid)
    unknown = set(args.pid) - {h.pid for h in holders}
    if unknown:
        raise UserError(f"PID {', '.join(map(str, sorted(unknown)))} does not hold the GPU",
                        hint="`ninfer gpu-clean --dry-run` lists the processes that do")
    targets = [h for h in holders if h.action == "terminate"]
    if not args.json:
        if not holders:
            print("no process holds the GPU")
        for h in holders:
            mem = "-" if h.gpu_mem_mib is None else f"{h.gpu_mem_mib} MiB"
            tag = ("ninfer" + (", stale" if h.stale else "")) if h.ninfer else "other"
            print(f"{h.pid:>8d} {h.user:10s} {mem:>10s} {h.age_s / 60:7.1f} min  [{tag}] {h.cmdline[:70]}")
            print(f"{'':>8s} -> {'would ' if args.dry_run and h.action == 'terminate' else ''}{h.action}"
                  + (f" ({h.why})" if h.why else ""))
    if targets and not args.dry_run and not args.yes:
        if not sys.stdin.isatty():
            raise UserError(f"{len(targets)} process(es) would be ended, but there is no terminal to confirm",
                            hint="pass --yes to end them, or --dry-run to only look")
        if input(f"end {len(targets)} process(es) {', '.join(str(t.pid) for t in targets)}? [y/N] ").strip() \
                .lower() not in ("y", "yes"):
            print("nothing ended")
            return 0
    freed = 0
    for h in targets:
        if args.dry_run:
            h.action = "would terminate"
            continue
        h.action = terminate(h.pid, h.created)
        freed += h.gpu_mem_mib or 0
        if not args.json:
            print(f"{h.pid}: {h.action}")
    if args.json:
        print(json.dumps([h.as_dict() for h in holders], indent=2))
    elif targets and not args.dry_run:
        print(f"freed about {freed} MiB of GPU memory" if freed else "done")
    return 0
