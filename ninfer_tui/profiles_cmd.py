"""`ninfer profiles ...`: list, show, create, edit, choose, check and remove launch profiles; the memory-fit check."""
from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

from engine.errors import UserError

from . import profiles


def add_parser(sub) -> None:
    p = sub.add_parser("profiles", help="launch profiles: list, show, new, edit, use, validate, rm, fit")
    ps = p.add_subparsers(dest="profiles_command", metavar="ACTION")
    ls = ps.add_parser("list", help="built-in and user profiles")
    ls.add_argument("--json", action="store_true", help="print the list as JSON")
    sh = ps.add_parser("show", help="a profile with `extends` folded in, as TOML")
    sh.add_argument("name")
    sh.add_argument("--json", action="store_true", help="print the profile as JSON")
    nw = ps.add_parser("new", help="create a user profile that extends another")
    nw.add_argument("name")
    nw.add_argument("--from", dest="base", help="profile to extend (default: the current default profile)")
    ed = ps.add_parser("edit", help="edit a user profile in $EDITOR (validated on save)")
    ed.add_argument("name")
    us = ps.add_parser("use", help="make a profile the default")
    us.add_argument("name")
    va = ps.add_parser("validate", help="check a profile (by name) or a profile file")
    va.add_argument("profile", metavar="NAME|FILE")
    rm = ps.add_parser("rm", help="remove a user profile")
    rm.add_argument("name")
    ft = ps.add_parser("fit", help="will the profile fit this GPU (or a GPU of --gpu-mem-gib)?")
    ft.add_argument("name", nargs="?", help="profile (default: the default profile)")
    ft.add_argument("--gpu-mem-gib", type=float, help="check against a card of this many GiB instead")
    ft.add_argument("--tensor-parallel", type=int, metavar="N",
                    help="plan one of N GPUs the model is cut over (default: the profile's tensor_parallel)")
    ft.add_argument("--json", action="store_true", help="print the report as JSON")


def run(args: argparse.Namespace) -> int:
    action = args.profiles_command or "list"
    return {"list": _list, "show": _show, "new": _new, "edit": _edit, "use": _use, "validate": _validate,
            "rm": _rm, "fit": _fit}[action](args)


def _summary(p: profiles.Profile, default: str | None) -> dict:
    return {"name": p.name, "default": p.name == default, "source": "built-in" if p.builtin else "user",
            "file": p.source, "description": p.description, "model": p.model, "device": p.device,
            "max_context": p.max_context, "kv_dtype": p.kv_dtype, "spec": p.spec,
            "draft_tokens": p.draft_tokens if p.spec != "none" else None, "max_concurrency": p.max_concurrency}


def _list(args) -> int:
    default = profiles.read_settings().get("default_profile")
    good, bad = profiles.scan()
    for b in bad:  # one line each, and the good ones still listed
        where = "" if b.path in b.cause else f" ({b.path})"
        print(f"warning: profile {b.name}{where} skipped: {b.cause}", file=sys.stderr)
    if bad:
        print("hint: fix or remove the files named; `ninfer profiles validate NAME` checks one", file=sys.stderr)
    rows = [_summary(p, default) for p in good]
    if getattr(args, "json", False):
        print(json.dumps(rows, indent=2))
        return 0
    for r in rows:
        mark = "*" if r["default"] else " "
        spec = f"{r['spec']} K={r['draft_tokens']}" if r["draft_tokens"] else r["spec"]
        print(f"{mark} {r['name']:14s} {r['source']:8s} {r['model']:14s} ctx {r['max_context']:>6d}  "
              f"kv {r['kv_dtype']:4s}  spec {spec:10s} {r['description']}")
    if not default:
        print("(no default yet: the first run picks one; set it with `ninfer profiles use NAME`)", file=sys.stderr)
    return 0


def _show(args) -> int:
    p = profiles.load(args.name)
    if args.json:
        print(json.dumps({"name": p.name, "file": p.source, **p.to_dict()}, indent=2))
    else:
        print(f"# profile {p.name} ({'built-in' if p.builtin else 'user'}: {p.source})")
        print(profiles.dump(p.to_dict()), end="")
    return 0


def _user_file(name: str) -> Path:
    if not profiles.NAME_RE.match(name):
        raise UserError(f"{name!r} is not a valid profile name",
                        hint="use letters, digits, '.', '_' and '-', starting with a letter or digit")
    return profiles.user_dir() / f"{name}.toml"


def _new(args) -> int:
    path = _user_file(args.name)
    if path.exists():
        raise UserError(f"profile {args.name} already exists ({path})", hint=f"edit it: `ninfer profiles edit "
                        f"{args.name}`")
    base = args.base or profiles.default_profile_name()
    profiles.load(base)  # the base must exist and be valid
    text = f'description = "{args.name}: my changes to {base}"\nextends = "{base}"\n\n' \
           f"# Add the keys to change, e.g.\n# max_context = 16384\n# kv_dtype = \"fp8\"\n"
    path.write_text(text, encoding="utf-8")
    profiles.load(args.name)
    print(path)
    return 0


def _edit(args) -> int:
    path = _user_file(args.name)
    if not path.exists():
        src, builtin = profiles.find_file(args.name)  # editing a built-in starts a user copy that overrides it
        path.write_text(src.read_text(encoding="utf-8"), encoding="utf-8")
        print(f"created {path} from the built-in {args.name}", file=sys.stderr)
    before = path.read_text(encoding="utf-8")
    editor = os.environ.get("VISUAL") or os.environ.get("EDITOR") or "vi"
    while True:
        rc = subprocess.call([*shlex.split(editor), str(path)])
        if rc != 0:
            path.write_text(before, encoding="utf-8")
            raise UserError(f"the editor ({editor}) exited with {rc}; {path} was left unchanged")
        try:
            profiles.load(args.name).engine_config("x")
            print(f"saved {path}", file=sys.stderr)
            return 0
        except UserError as exc:
            print(f"error: {exc}", file=sys.stderr)
            if not sys.stdin.isatty() or input("edit again? [Y/n] ").strip().lower() in ("n", "no"):
                path.write_text(before, encoding="utf-8")
                raise UserError(f"{path} was not saved: it does not validate", hint="the previous version "
                                "was restored") from None


def _use(args) -> int:
    profiles.load(args.name)
    profiles.set_default(args.name)
    print(f"default profile: {args.name}")
    return 0


def _validate(args) -> int:
    p = profiles.validate(args.profile)
    print(f"{args.profile}: valid (profile {p.name}, model {p.model}, file {p.source})")
    return 0


def _rm(args) -> int:
    users = profiles.user_files()
    if args.name not in users:
        if args.name in profiles.builtin_files():
            raise UserError(f"{args.name} is a built-in profile and cannot be removed")
        raise UserError(f"no user profile named {args.name!r}")
    users[args.name].unlink()
    if profiles.read_settings().get("default_profile") == args.name:
        settings = profiles.read_settings()
        settings.pop("default_profile")
        profiles.settings_path().write_text(profiles.dump(settings), encoding="utf-8")
    print(f"removed {users[args.name]}")
    return 0


def fit_report(profile: profiles.Profile, gpu_mem_gib: float | None) -> dict:
    """The memory plan of a profile against a card of `gpu_mem_gib` GiB, or this machine's free GPU memory."""
    from engine.loaders.converted import settled_config
    from engine.memory_plan import GIB, check_fit, plan_memory  # torch: imported by the one command using it

    from .models import model_spec

    config = profile.engine_config(profile.model)
    if Path(profile.model).expanduser().is_dir():  # a converted folder plans its own formats
        config = settled_config(config)
    device_type = "cpu" if profile.device == "cpu" else "cuda"
    geometry = model_spec(profile.model, config.vision, config.mmproj)
    plan = plan_memory(geometry, config, device_type)
    if gpu_mem_gib is not None:
        available, against = int(gpu_mem_gib * GIB), f"a {gpu_mem_gib:g} GiB card"
    elif device_type == "cpu":
        import psutil

        available, against = psutil.virtual_memory().available, "this machine's available RAM"
    elif profiles.cuda_available():
        import torch

        free, total = torch.cuda.mem_get_info()
        available, against = free, f"{torch.cuda.get_device_name()} ({free / GIB:.1f} of {total / GIB:.1f} GiB free)"
    else:
        raise UserError("no CUDA GPU is visible here to check against",
                        hint="pass the card's size, e.g. `ninfer profiles fit NAME --gpu-mem-gib 24`")
    if config.tensor_parallel > 1:
        against += f", per GPU of {config.tensor_parallel} (tensor_parallel)"
    verdict = check_fit(plan, available)
    refused = None  # what the engine would refuse whatever the memory
    if config.tensor_parallel > 1:
        from engine.parallel.support import check_settings

        try:
            check_settings(config, geometry, device_type)
        except UserError as exc:
            refused = f"{exc} ({exc.hint})"
    return {"profile": profile.name, "model": profile.model, "against": against,
            "fits": verdict.fits and refused is None, "refused": refused,
            "need_bytes": verdict.need, "available_bytes": available, "advice": refused or verdict.advice,
            "plan": plan.as_dict(), "rows": [[label, size, knob] for label, size, knob in plan.rows()]}


def _fit(args) -> int:
    """Exit status 0 when the plan fits, 2 when it does not (a script can test it as it tests `validate`)."""
    from engine.memory_plan import GIB

    profile = profiles.load(args.name or profiles.default_profile_name())
    if args.tensor_parallel is not None:
        profile = replace(profile, tensor_parallel=args.tensor_parallel)  # checked with the plan (EngineConfig)
    report = fit_report(profile, args.gpu_mem_gib)
    status = 0 if report["fits"] else 2
    if args.json:
        print(json.dumps(report, indent=2))
        return status
    where = "host RAM" if report["plan"]["device_type"] == "cpu" else "GPU"
    print(f"profile {profile.name}, model {profile.model}, against {report['against']}:")
    for label, size, knob in report["rows"]:
        if size:
            print(f"  {label:42s} {size / GIB:8.3f} GiB" + (f"   ({knob})" if knob else ""))
    print(f"  {'total on the ' + where:42s} {report['need_bytes'] / GIB:8.3f} GiB")
    host = report["plan"]["host_total"]
    if host:
        print(f"  {'host RAM (host KV tier, host state slots)':42s} {host / GIB:8.3f} GiB")
    verdict = "FITS" if report["fits"] else "REFUSED" if report["refused"] else "DOES NOT FIT"
    print(f"{verdict}: needs {report['need_bytes'] / GIB:.2f} GiB of {report['available_bytes'] / GIB:.2f} GiB")
    if report["advice"]:
        print(f"hint: {report['advice']}")
    return status
