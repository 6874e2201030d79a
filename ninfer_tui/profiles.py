"""Launch profiles: a named, validated TOML file of engine, server and sampling settings.

Built-in profiles ship in the wheel (`profiles/` → `ninfer_tui.builtin_profiles`); user profiles in
`<config dir>/profiles/NAME.toml` add to them or override them. A profile may `extends = "other"` and change a
few keys; command-line flags override keys last. Every key is checked for type and range, and an error names
the file, the key and what is allowed.
"""
from __future__ import annotations

import math
import os
import re
import reprlib
import stat
import tomllib
from dataclasses import dataclass, field, fields
from importlib import resources
from pathlib import Path
from typing import Any

import tomli_w

from engine.config import (
    DEVICES,
    DRAFT_TOKENS,
    DTYPES,
    KV_DTYPES,
    MAX_DRAFT_TOKENS,
    SPEC_METHODS,
    WEIGHT_FORMATS,
    WEIGHT_LAYOUTS,
    WeightFormats,
)
from engine.errors import UserError

from . import paths

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
FIRST_RUN_CPU = "cpu-default"
FIRST_RUN_GPU = "8k-speed"
MAX_FILE_BYTES = 1 << 20  # a profile is a few dozen lines; anything this big is not one
_short = reprlib.Repr()  # values quoted in errors: bounded in length and depth (a file may nest thousands deep)
_short.maxlevel, _short.maxstring, _short.maxother = 3, 60, 60


@dataclass(frozen=True)
class Rule:
    kind: type
    choices: tuple = ()
    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False  # lo itself is not allowed
    hi_open: bool = False  # hi itself is not allowed

    def allowed(self) -> str:
        if self.choices:
            return "one of " + ", ".join(repr(c) for c in self.choices)
        name = {bool: "true or false", str: "a string", int: "an integer", float: "a finite number"}[self.kind]
        if self.lo is not None or self.hi is not None:
            lo = "" if self.lo is None else f"{'>' if self.lo_open else '>='} {self.lo}"
            hi = "" if self.hi is None else f"{'<' if self.hi_open else '<='} {self.hi}"
            name += " " + " and ".join(x for x in (lo, hi) if x)
        return name


# The ranges a profile may give each key; what an engine key does is said once, in EngineConfig's help.
ENGINE_RULES: dict[str, Rule] = {
    "description": Rule(str),  # one line shown in lists
    "model": Rule(str),
    "device": Rule(str, DEVICES),
    "threads": Rule(int, lo=0, hi=4096),
    "dtype": Rule(str, DTYPES),
    "max_context": Rule(int, lo=128, hi=1 << 20),
    "kv_capacity": Rule(int, lo=0, hi=1 << 24),
    "kv_dtype": Rule(str, KV_DTYPES),
    "prefill_chunk": Rule(int, lo=16, hi=65536),
    "graph_prefill_tokens": Rule(int, lo=0, hi=65536),
    "max_concurrency": Rule(int, lo=1, hi=256),
    "max_pending_requests": Rule(int, lo=0, hi=100000),
    "tensor_parallel": Rule(int, lo=1, hi=64),
    "spec": Rule(str, SPEC_METHODS),
    "draft_tokens": Rule(int, lo=1, hi=MAX_DRAFT_TOKENS),
    "drafter": Rule(str),
    "lm_head_draft": Rule(bool),
    "draft_vocab": Rule(int, lo=0, hi=1 << 20),
    "adaptive_drafts": Rule(bool),
    "draft_acceptance": Rule(float, lo=0, hi=1, hi_open=True),
    "host_kv_mib": Rule(int, lo=0, hi=1 << 24),
    "host_state_slots": Rule(int, lo=0, hi=1024),
    "held_disk_mib": Rule(int, lo=0, hi=1 << 24),
    "cuda_graphs": Rule(bool),
    "weight_layout": Rule(str, WEIGHT_LAYOUTS),
    "held_sequences": Rule(int, lo=0, hi=64),
    "mmproj": Rule(str),
    "image_max_pixels": Rule(int, lo=4096, hi=1 << 26),
    "image_max_mib": Rule(int, lo=1, hi=1024),
    "max_images": Rule(int, lo=0, hi=256),
    "video_max_frames": Rule(int, lo=0, hi=768),
    "video_max_pixels": Rule(int, lo=4096, hi=1 << 24),
    "video_max_mib": Rule(int, lo=1, hi=1024),
    "video_decode_s": Rule(int, lo=1, hi=3600),
    "host": Rule(str),  # where `ninfer serve` listens
    "port": Rule(int, lo=1, hi=65535),
}
SAMPLING_RULES: dict[str, Rule] = {
    "temperature": Rule(float, lo=0, hi=5),
    "top_p": Rule(float, lo=0, hi=1, lo_open=True),
    "top_k": Rule(int, lo=0, hi=1 << 20),
    "min_p": Rule(float, lo=0, hi=0.999),
    "repeat_penalty": Rule(float, lo=0, hi=10, lo_open=True),
    "max_tokens": Rule(int, lo=1, hi=1 << 20),
}
WEIGHT_RULE = Rule(str, WEIGHT_FORMATS)
TABLES = {"sampling": SAMPLING_RULES, "weights": {k: WEIGHT_RULE for k in WeightFormats().as_dict()}}


@dataclass(frozen=True)
class SamplingDefaults:
    temperature: float = 0.7
    top_p: float = 0.95
    top_k: int = 0
    min_p: float = 0.0
    repeat_penalty: float = 1.0
    max_tokens: int = 512


@dataclass(frozen=True)
class Profile:
    name: str
    description: str = ""
    model: str = "smollm2-135m"
    device: str = "auto"
    threads: int = 0
    dtype: str = "auto"
    weights: WeightFormats = field(default_factory=WeightFormats)
    max_context: int = 8192
    kv_capacity: int = 0
    kv_dtype: str = "auto"
    prefill_chunk: int = 512
    graph_prefill_tokens: int = 128
    max_concurrency: int = 1
    max_pending_requests: int = 8
    tensor_parallel: int = 1
    spec: str = "none"
    draft_tokens: int = DRAFT_TOKENS
    drafter: str = ""
    lm_head_draft: bool = False
    draft_vocab: int = 0
    adaptive_drafts: bool = True
    draft_acceptance: float = 0.0
    host_kv_mib: int = 0
    host_state_slots: int = 0
    held_disk_mib: int = 0
    cuda_graphs: bool = True
    weight_layout: str = "auto"
    held_sequences: int = 2
    mmproj: str = ""
    image_max_pixels: int = 1 << 20
    image_max_mib: int = 20
    max_images: int = 16
    video_max_frames: int = 64
    video_max_pixels: int = 768 * 32 * 32
    video_max_mib: int = 64
    video_decode_s: int = 60
    host: str = "127.0.0.1"
    port: int = 8080
    sampling: SamplingDefaults = field(default_factory=SamplingDefaults)
    source: str = field(default="", compare=False)  # the file it came from (its top layer)
    builtin: bool = field(default=False, compare=False)

    def to_dict(self) -> dict[str, Any]:
        """The resolved profile as TOML-ready keys (extends folded in)."""
        out: dict[str, Any] = {}
        for f in fields(self):
            if f.name in ("name", "source", "builtin"):
                continue
            value = getattr(self, f.name)
            if f.name == "weights":
                value = value.as_dict()
            elif f.name == "sampling":
                value = {g.name: getattr(value, g.name) for g in fields(value)}
            out[f.name] = value
        return out

    def engine_config(self, model_path: str):
        """The EngineConfig for this profile with the model resolved to a loadable reference (every key the two
        share by name); kernel tiles chosen on this machine and the compiled CPU kernels persist in the cache dir,
        held conversations written to disk and the record of converted shards verified in the state dir."""
        from engine.config import EngineConfig

        shared = ({f.name for f in fields(EngineConfig)} & {f.name for f in fields(self)}) - {"model"}
        try:
            return EngineConfig(**{name: getattr(self, name) for name in shared}, model=model_path,
                                kernel_cache=str(paths.cache_dir() / "kernel-tiles.json"),
                                cpu_kernels_dir=str(paths.cache_dir() / "cpu-kernels"),
                                held_dir=str(paths.state_dir() / "held"),
                                verified_shards=str(paths.state_dir() / "verified-shards.json"))
        except UserError as exc:
            raise UserError(f"profile {self.name} ({self.source}): {exc}", hint=exc.hint) from None


# ---- reading and checking files ----------------------------------------------------------------------------

def _type_name(value: Any) -> str:
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string", dict: "a table",
            list: "an array"}.get(type(value), type(value).__name__)


def _check_value(where: str, key: str, value: Any, rule: Rule) -> Any:
    ok = isinstance(value, rule.kind) and not (rule.kind is int and isinstance(value, bool))
    if rule.kind is float and isinstance(value, int) and not isinstance(value, bool):
        value, ok = float(value), True
    if not ok:
        raise UserError(f"{where}: key {key!r} is {_type_name(value)} ({_short.repr(value)}); "
                        f"allowed: {rule.allowed()}")
    if rule.kind is float and not math.isfinite(value):  # nan passes every range comparison
        raise UserError(f"{where}: key {key!r} = {value!r} is not a finite number; allowed: {rule.allowed()}")
    bad = (rule.choices and value not in rule.choices) or (
        rule.lo is not None and (value <= rule.lo if rule.lo_open else value < rule.lo)) or (
        rule.hi is not None and (value >= rule.hi if rule.hi_open else value > rule.hi))
    if bad:
        raise UserError(f"{where}: key {key!r} = {value!r} is out of range; allowed: {rule.allowed()}")
    return value


def check_layer(raw: dict, where: str) -> dict:
    """Type- and range-check one file's keys (all optional); returns them with numbers normalised."""
    out: dict[str, Any] = {}
    for key, value in raw.items():
        if key == "extends":
            if not isinstance(value, str) or not NAME_RE.match(value):
                raise UserError(f"{where}: key 'extends' must name another profile, got {_short.repr(value)}")
            out[key] = value
        elif key == "weights" and isinstance(value, str):
            out[key] = _check_value(where, key, value, WEIGHT_RULE)
        elif key in TABLES:
            if not isinstance(value, dict):
                raise UserError(f"{where}: key {key!r} must be a table ([{key}])"
                                + (" or a format string" if key == "weights" else ""))
            rules = TABLES[key]
            table = {}
            for sub, v in value.items():
                if sub not in rules:
                    raise UserError(f"{where}: unknown key '{key}.{sub}'", hint="allowed: " + ", ".join(rules))
                table[sub] = _check_value(where, f"{key}.{sub}", v, rules[sub])
            out[key] = table
        elif key in ENGINE_RULES:
            out[key] = _check_value(where, key, value, ENGINE_RULES[key])
        else:
            raise UserError(f"{where}: unknown key {key!r}",
                            hint="allowed keys: " + ", ".join(["extends", *ENGINE_RULES, *TABLES]))
    return out


def _file_kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device")):
        if test(mode):
            return name
    return "not a regular file"


def read_text(path: Path, what: str = "profile") -> str:
    """A profile (or settings) file's text. Opened without blocking and checked to be a regular file before
    reading, so a FIFO or a device named like a profile is an error, not a hang; its size and encoding are checked
    too."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        try:
            mode = os.fstat(fd).st_mode  # on the descriptor: a directory cannot become a file object
            if not stat.S_ISREG(mode):
                raise UserError(f"{path}: is {_file_kind(mode)}, not a {what} file",
                                hint=f"a {what} file is a regular TOML file; move this one away")
            with os.fdopen(fd, "rb", closefd=False) as f:
                data = f.read(MAX_FILE_BYTES + 1)
        finally:
            os.close(fd)
    except OSError as exc:
        raise UserError(f"cannot read {what} {path}: {exc.strerror}") from None
    if len(data) > MAX_FILE_BYTES:
        raise UserError(f"{path}: is over {MAX_FILE_BYTES >> 20} MiB, not a {what} file")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UserError(f"{path}: is not UTF-8 text (byte 0x{data[exc.start]:02x} at offset {exc.start})",
                        hint="TOML files are UTF-8; fix or remove the file") from None


def read_file(path: Path) -> dict:
    text = read_text(path)
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise UserError(f"{path}: not valid TOML: {exc}", hint="fix the file, or check it with "
                        "`ninfer profiles validate FILE`") from None
    except RecursionError:
        raise UserError(f"{path}: not valid TOML: arrays or tables nested too deeply",
                        hint="a profile's values are flat: numbers, strings and the [sampling]/[weights] "
                        "tables") from None
    return check_layer(raw, str(path))


def _merge(base: dict, top: dict) -> dict:
    out = dict(base)
    for key, value in top.items():
        if key == "weights" and isinstance(value, str):
            out[key] = value
        elif key in TABLES and isinstance(out.get(key), dict):
            out[key] = {**out[key], **value}
        else:
            out[key] = value
    out.pop("extends", None)
    return out


def build(name: str, merged: dict, source: str, builtin: bool = False) -> Profile:
    values = {k: v for k, v in merged.items() if k not in ("extends", "weights", "sampling")}
    weights = merged.get("weights", "auto")
    wf = WeightFormats.uniform(weights) if isinstance(weights, str) else WeightFormats(**weights)
    return Profile(name=name, weights=wf, sampling=SamplingDefaults(**merged.get("sampling", {})), source=source,
                   builtin=builtin, **values)


# ---- where profiles live ------------------------------------------------------------------------------------

def user_dir() -> Path:
    d = paths.config_dir() / "profiles"
    d.mkdir(parents=True, exist_ok=True)
    return d


def builtin_files() -> dict[str, Path]:
    try:
        root = resources.files("ninfer_tui.builtin_profiles")
    except ModuleNotFoundError:  # a source checkout that is not installed (e.g. a GPU box running from the tree)
        root = Path(__file__).resolve().parent.parent / "profiles"
    return {Path(p.name).stem: Path(str(p)) for p in root.iterdir() if p.name.endswith(".toml")}


def user_files() -> dict[str, Path]:
    return {p.stem: p for p in sorted(user_dir().glob("*.toml"))}


def find_file(name: str) -> tuple[Path, bool]:
    """(file, is_builtin) for a profile name; a user file wins over the built-in of the same name."""
    users, builtins = user_files(), builtin_files()
    if name in users:
        return users[name], False
    if name in builtins:
        return builtins[name], True
    raise UserError(f"no profile named {name!r}", hint="profiles: " + ", ".join(sorted({*users, *builtins}))
                    + " (see `ninfer profiles list`)")


def _resolve_raw(name: str, path: Path, chain: tuple[str, ...] = ()) -> dict:
    if name in chain:
        raise UserError(f"{path}: 'extends' makes a cycle: {' -> '.join((*chain, name))}",
                        hint="remove 'extends' from one of these profiles")
    layer = read_file(path)
    base_name = layer.get("extends")
    if base_name is None:
        return _merge({}, layer)
    if base_name == name:  # a user file that extends the built-in it overrides
        builtins = builtin_files()
        if base_name not in builtins or path == builtins[base_name]:
            raise UserError(f"{path}: 'extends' makes a cycle: {name} -> {name}")
        base = _resolve_raw(base_name, builtins[base_name], (*chain, name + " (user)"))
    else:
        base_path, _ = find_file(base_name)
        base = _resolve_raw(base_name, base_path, (*chain, name))
    return _merge(base, layer)


def load(name: str) -> Profile:
    path, builtin = find_file(name)
    return build(name, _resolve_raw(name, path), str(path), builtin)


def load_path(path: Path) -> Profile:
    """A profile file anywhere on disk (for `validate FILE`); its `extends` resolves against known profiles."""
    if not os.path.lexists(path):
        raise UserError(f"profile file {path} does not exist")
    profile = build(path.stem, _resolve_raw(path.stem + " (file)", path), str(path))
    profile.engine_config(profile.model)  # cross-key checks (kv_capacity >= max_context, ...)
    return profile


def validate(ref: str) -> Profile:
    """A profile named `ref`, or the file at `ref` (a path: it exists, or has a '/' or a .toml suffix), checked
    as a launch would check it (cross-key checks included)."""
    path = Path(ref).expanduser()
    if os.path.lexists(path) or os.sep in ref or ref.endswith(".toml"):
        return load_path(path)
    if not NAME_RE.match(ref):
        raise UserError(f"{ref!r} is neither a profile name nor a file")
    profile = load(ref)
    profile.engine_config(profile.model)
    return profile


@dataclass(frozen=True)
class BadProfile:
    name: str
    path: str
    cause: str


def scan() -> tuple[list[Profile], list[BadProfile]]:
    """Every profile that loads, and for each one that does not, its file and why: one bad file (or one that
    extends it) does not hide the others."""
    users, builtins = user_files(), builtin_files()
    good, bad = [], []
    for name in sorted({*builtins, *users}):
        try:
            good.append(load(name))
        except UserError as exc:
            bad.append(BadProfile(name, str(users.get(name) or builtins[name]), str(exc)))
    return good, bad


def with_overrides(profile: Profile, overrides: dict) -> Profile:
    """The profile with command-line keys on top (checked like a file's keys)."""
    if not overrides:
        return profile
    layer = check_layer(overrides, "command line")
    return build(profile.name, _merge(profile.to_dict(), layer), profile.source, profile.builtin)


def parse_set(items: list[str]) -> dict:
    """`--set key=value` pairs; values are TOML (numbers, true/false, "strings"), bare words become strings."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, text = item.partition("=")
        if not sep or not key.strip():
            raise UserError(f"--set {item!r} is not KEY=VALUE", hint="e.g. --set max_context=16384")
        try:
            value = tomllib.loads(f"v = {text.strip()}")["v"]
        except tomllib.TOMLDecodeError:
            value = text.strip()
        target = out
        *parents, leaf = key.strip().split(".")
        for p in parents:
            target = target.setdefault(p, {})
        target[leaf] = value
    return out


# ---- the default profile -----------------------------------------------------------------------------------

def settings_path() -> Path:
    return paths.config_dir() / "settings.toml"


def read_settings() -> dict:
    path = settings_path()
    if not os.path.lexists(path):
        return {}
    try:
        return tomllib.loads(read_text(path, "settings"))
    except (tomllib.TOMLDecodeError, RecursionError) as exc:
        raise UserError(f"{path}: not valid TOML: {exc}", hint=f"fix or delete {path}") from None


def set_default(name: str) -> None:
    find_file(name)
    settings = read_settings()
    settings["default_profile"] = name
    settings_path().write_text(tomli_w.dumps(settings), encoding="utf-8")


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def default_profile_name(announce=None) -> str:
    """The profile used when none is named: the one set by `ninfer profiles use`, else a first-run pick that
    fits the machine (saved, and said once through `announce`)."""
    chosen = read_settings().get("default_profile")
    if chosen:
        return chosen
    if not cuda_available():
        pick, why = FIRST_RUN_CPU, "no CUDA GPU found"
    else:
        from .models import REGISTRY, is_pulled

        gpu = load(FIRST_RUN_GPU)
        if gpu.model in REGISTRY and not is_pulled(REGISTRY[gpu.model]):
            pick, why = FIRST_RUN_CPU, f"a CUDA GPU is present, but {FIRST_RUN_GPU}'s model {gpu.model} is not " \
                                       "downloaded"
        else:
            pick, why = FIRST_RUN_GPU, "a CUDA GPU is present"
    set_default(pick)
    if announce:
        announce(f"first run: using profile {pick} ({why}); change it with `ninfer profiles use NAME`")
    return pick


def select(name: str | None, overrides: dict | None = None, announce=None) -> Profile:
    return with_overrides(load(name or default_profile_name(announce)), overrides or {})


def dump(data: dict) -> str:
    return tomli_w.dumps(data)
