"""Run configuration: typed dataclasses, YAML recipes and ``--section.key value`` overrides.

A run is described by three sections (see the recipe format in DESIGN.md §1)::

    model:   fields of the arch's config dataclass (chosen by ``model.arch`` via the registry)
    data:    DataConfig   (which prepared dataset to read)
    train:   TrainConfig  (optimizer, schedule, evaluation, checkpointing, device)

``load_config`` reads a YAML file (or a dict), applies command-line overrides, coerces every
value to its dataclass field type and rejects unknown sections or keys with a ``ValueError`` that
names the key and lists the valid ones. ``save_config`` writes the resolved config so that
``load_config`` reads it back identically.

Why not OmegaConf structured configs: the ``model`` section is polymorphic (its dataclass depends
on ``model.arch``) and model configs use ``int | None`` unions and ``ClassVar`` fields; a small
explicit coercion keyed on the dataclass field types is shorter and gives clearer messages.
"""
from __future__ import annotations

import dataclasses
import difflib
import json
import math
import types
import typing
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Mapping, Sequence

import yaml

from energyformer._validate import check_choice, check_float, check_int
from energyformer.models.base import ModelConfig
from energyformer.models.registry import ARCHS, get_arch
from energyformer.train.checkpoint import atomic_write_text

SECTIONS = ("model", "data", "train")
LR_SCHEDULES = ("cosine", "exponential", "constant")
DTYPES = ("float32", "bfloat16")


def _check_nonempty_str(name: str, value: Any) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"{name}={value!r} must be a non-empty string")
    return value


@dataclass
class DataConfig:
    """Which prepared dataset to train on.

    The data lives in ``data_dir`` if given, else in ``root/dataset`` (``train.bin``, ``val.bin``,
    ``meta.json``; see ``energyformer.data``). ``data_dir`` stays ``None`` in saved configs so that
    overriding ``data.dataset`` or ``data.root`` keeps working; use :attr:`path` for the directory.
    """

    dataset: str = "shakespeare_char"
    root: str = "data"
    data_dir: str | None = None

    def __post_init__(self) -> None:
        _check_nonempty_str("data.dataset", self.dataset)
        _check_nonempty_str("data.root", self.root)
        if self.data_dir is not None:
            _check_nonempty_str("data.data_dir", self.data_dir)

    @property
    def path(self) -> Path:
        """The data directory: ``data_dir`` or ``root/dataset``."""
        return Path(self.data_dir) if self.data_dir is not None else Path(self.root) / self.dataset


@dataclass
class TrainConfig:
    """Optimization, evaluation, checkpointing and device options (SPEC §4.6/§4.7 defaults).

    Defaults follow nanoGPT's Shakespeare-char recipe and the NRGPT reference code: AdamW with
    beta2 0.99, weight decay 0.1 on >= 2-D parameters, grad clip 1.0, linear warmup then cosine
    decay to ``min_lr`` (``lr_schedule="exponential"`` gives the NRGPT scripts' exponential decay).

    ``None`` defaults are resolved here: ``min_lr`` → ``learning_rate / 10``, ``lr_decay_steps`` →
    ``max_steps``, ``ckpt_interval`` → ``eval_interval``. ``compile=None`` means "on for CUDA, off
    otherwise" and ``device="auto"`` means CUDA when available, else CPU; both are decided when
    training starts. ``resume`` is ``"auto"`` (continue from a complete checkpoint in ``out_dir``
    if there is one), ``"never"`` (start fresh, overwriting) or the path of a run directory to
    continue from. ``grad_clip=0`` disables clipping.

    Raises:
        ValueError: any value out of range or of the wrong type, naming the option.
    """

    out_dir: str = "out/run"
    max_steps: int = 2000
    batch_size: int = 32
    grad_accum_steps: int = 1
    learning_rate: float = 1e-3
    min_lr: float | None = None
    lr_schedule: str = "cosine"
    warmup_steps: int = 100
    lr_decay_steps: int | None = None
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.99
    grad_clip: float = 1.0
    eval_interval: int = 250
    eval_iters: int = 20
    log_interval: int = 10
    ckpt_interval: int | None = None
    seed: int = 1337
    resume: str = "auto"
    device: str = "auto"
    dtype: str = "float32"
    compile: bool | None = None
    num_threads: int | None = None
    tensorboard: bool = False

    def __post_init__(self) -> None:
        _check_nonempty_str("train.out_dir", self.out_dir)
        check_int("train.max_steps", self.max_steps, 0)
        check_int("train.batch_size", self.batch_size, 1)
        check_int("train.grad_accum_steps", self.grad_accum_steps, 1)
        check_float("train.learning_rate", self.learning_rate, 0.0, strict=True)
        if self.min_lr is None:
            self.min_lr = self.learning_rate / 10
        check_float("train.min_lr", self.min_lr, 0.0, maximum=self.learning_rate)
        check_choice("train.lr_schedule", self.lr_schedule, LR_SCHEDULES)
        if self.lr_schedule == "exponential" and self.min_lr <= 0:
            raise ValueError("train.min_lr must be > 0 with train.lr_schedule='exponential'")
        check_int("train.warmup_steps", self.warmup_steps, 0)
        if self.lr_decay_steps is None:
            self.lr_decay_steps = self.max_steps
        # lr_decay_steps < warmup_steps is allowed (short test runs): lr_at then warms up and
        # jumps to min_lr after warmup
        check_int("train.lr_decay_steps", self.lr_decay_steps, 0)
        check_float("train.weight_decay", self.weight_decay, 0.0)
        check_float("train.beta1", self.beta1, 0.0, maximum=0.999999)
        check_float("train.beta2", self.beta2, 0.0, maximum=0.999999)
        check_float("train.grad_clip", self.grad_clip, 0.0)
        check_int("train.eval_interval", self.eval_interval, 1)
        check_int("train.eval_iters", self.eval_iters, 1)
        check_int("train.log_interval", self.log_interval, 1)
        if self.ckpt_interval is None:
            self.ckpt_interval = self.eval_interval
        check_int("train.ckpt_interval", self.ckpt_interval, 1)
        check_int("train.seed", self.seed, 0)
        _check_nonempty_str("train.resume", self.resume)
        _check_device(self.device)
        check_choice("train.dtype", self.dtype, DTYPES)
        if self.compile is not None and not isinstance(self.compile, bool):
            raise ValueError(f"train.compile={self.compile!r} must be true, false or null (auto)")
        if self.num_threads is not None:
            check_int("train.num_threads", self.num_threads, 1)
        if not isinstance(self.tensorboard, bool):
            raise ValueError(f"train.tensorboard={self.tensorboard!r} must be true or false")

    @property
    def sequences_per_step(self) -> int:
        """Sequences per optimizer step: ``batch_size * grad_accum_steps``."""
        return self.batch_size * self.grad_accum_steps


def _check_device(device: Any) -> str:
    _check_nonempty_str("train.device", device)
    kind = device.split(":", 1)[0]
    check_choice("train.device", kind, ("auto", "cpu", "cuda", "mps"))
    if ":" in device:
        index = device.split(":", 1)[1]
        if kind in ("auto", "cpu") or not index.isdigit():
            raise ValueError(f"train.device={device!r} is not valid; expected 'auto', 'cpu', 'cuda', "
                             "'cuda:N' or 'mps'")
    return device


@dataclass
class RunConfig:
    """A full run: ``model`` (the arch's ModelConfig), ``data`` and ``train`` sections."""

    model: ModelConfig
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)

    def to_dict(self) -> dict[str, Any]:
        """Plain nested dict (lists instead of tuples) in the recipe layout."""
        return _plain({"model": self.model.to_dict(), "data": dataclasses.asdict(self.data),
                       "train": dataclasses.asdict(self.train)})


# --------------------------------------------------------------------------------------------
# loading, overrides, type coercion
# --------------------------------------------------------------------------------------------

def load_config(path_or_dict: str | Path | Mapping[str, Any], overrides: Sequence[str] = (),
                resolve_vocab: bool = False, default_vocab_size: int | None = None) -> RunConfig:
    """Build a :class:`RunConfig` from a YAML recipe (or dict) plus command-line overrides.

    Args:
        path_or_dict: path of a YAML file with ``model``/``data``/``train`` sections, or the dict.
        overrides: CLI tokens such as ``["--train.max_steps", "2000", "--model.n_steps=6"]``;
            values are coerced to the field's type (``"1e-3"`` → float, ``"null"`` → None for
            optional fields, ``"true"`` → bool).
        resolve_vocab: when ``model.vocab_size`` is not given, read it from ``meta.json`` in the
            data directory.
        default_vocab_size: with ``resolve_vocab``, the vocab size to use when that ``meta.json``
            does not exist (e.g. to inspect a recipe before the data is prepared); ``None`` makes
            a missing ``meta.json`` an error.

    Raises:
        FileNotFoundError: the recipe file, or (with ``resolve_vocab``) the data meta.json, is missing.
        ValueError: malformed YAML or override, unknown section/key (the message lists the valid
            ones), a value that cannot be coerced to its type, or any invalid value.
    """
    raw = _read_raw(path_or_dict)
    raw = {k: (dict(v) if isinstance(v, Mapping) else v) for k, v in raw.items()}
    for key, value in parse_overrides(overrides):
        section, name = key
        if section not in SECTIONS:
            raise ValueError(f"unknown config section {section!r} in override --{section}.{name}; "
                             f"expected one of {list(SECTIONS)}")
        raw.setdefault(section, {})
        if not isinstance(raw[section], dict):
            raise ValueError(f"config section {section!r} must be a mapping, got {raw[section]!r}")
        raw[section][name] = value

    unknown = sorted(set(raw) - set(SECTIONS))
    if unknown:
        raise ValueError(f"unknown config section(s) {unknown}; expected some of {list(SECTIONS)}")
    for section in SECTIONS:
        if raw.get(section) is None:
            raw[section] = {}
        if not isinstance(raw[section], dict):
            raise ValueError(f"config section {section!r} must be a mapping of keys to values, "
                             f"got {raw[section]!r}")

    data = _build_section(DataConfig, raw["data"], "data")
    train = _build_section(TrainConfig, raw["train"], "train")

    model_raw = dict(raw["model"])
    if "arch" not in model_raw:
        raise ValueError(f"the model section needs an 'arch' key, one of {sorted(ARCHS)}")
    arch = model_raw.pop("arch")
    if isinstance(arch, _FlagOnly) or not isinstance(arch, str):
        raise ValueError(f"model.arch={arch!r} must be one of {sorted(ARCHS)}")
    _, cfg_cls = get_arch(arch)
    if resolve_vocab and model_raw.get("vocab_size") is None:
        model_raw["vocab_size"] = _vocab_from_meta(data.path, default_vocab_size)
    model = _build_section(cfg_cls, model_raw, "model")
    return RunConfig(model=model, data=data, train=train)


def save_config(run_cfg: RunConfig, path: str | Path) -> Path:
    """Write the resolved config as YAML (atomically); ``load_config(path)`` reads it back equal."""
    text = yaml.safe_dump(run_cfg.to_dict(), sort_keys=False, default_flow_style=False)
    return atomic_write_text(Path(path), text)


class _FlagOnly:
    """Marker for an override flag given without a value (``--train.tensorboard``)."""

    def __repr__(self) -> str:
        return "<flag without value>"


_FLAG_ONLY = _FlagOnly()


def parse_overrides(tokens: Sequence[str]) -> list[tuple[tuple[str, str], Any]]:
    """Parse ``--section.key value`` / ``--section.key=value`` tokens.

    Returns ``[((section, key), raw_string_value), ...]`` in order (later ones win). A flag with
    no value (followed by another flag or the end) is accepted only for boolean fields, where it
    means ``true``; that check happens during coercion.

    Raises:
        ValueError: a token that is not ``--section.key``, or a key without a section.
    """
    out: list[tuple[tuple[str, str], Any]] = []
    tokens = list(tokens)
    i = 0
    while i < len(tokens):
        tok = tokens[i]
        if not isinstance(tok, str) or not tok.startswith("--"):
            raise ValueError(f"unexpected argument {tok!r}; overrides look like --train.max_steps 2000 "
                             "or --model.n_steps=6")
        body = tok[2:]
        if "=" in body:
            key, value = body.split("=", 1)
            i += 1
        elif i + 1 < len(tokens) and not tokens[i + 1].startswith("--"):
            key, value = body, tokens[i + 1]
            i += 2
        else:
            key, value = body, _FLAG_ONLY
            i += 1
        parts = key.split(".")
        if len(parts) != 2 or not all(parts):
            raise ValueError(f"override --{key} must name a section and a key, like --train.max_steps; "
                             f"sections are {list(SECTIONS)}")
        out.append(((parts[0], parts[1]), value))
    return out


def _read_raw(path_or_dict: str | Path | Mapping[str, Any]) -> dict[str, Any]:
    if isinstance(path_or_dict, Mapping):
        return dict(path_or_dict)
    if not isinstance(path_or_dict, (str, Path)):
        raise ValueError(f"load_config expects a YAML path or a dict, got {type(path_or_dict).__name__}")
    path = Path(path_or_dict)
    if not path.is_file():
        raise FileNotFoundError(f"config file {str(path)!r} does not exist"
                                + (" (it is a directory)" if path.is_dir() else ""))
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as e:
        raise ValueError(f"config file {str(path)!r} is not valid YAML: {e}") from None
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ValueError(f"config file {str(path)!r} must hold a mapping with sections {list(SECTIONS)}, "
                         f"got {type(raw).__name__}")
    return raw


def _vocab_from_meta(data_dir: Path, default: int | None) -> int:
    meta_path = data_dir / "meta.json"
    if not meta_path.is_file():
        if default is not None:
            return default
        raise FileNotFoundError(
            f"model.vocab_size is not set and {str(meta_path)!r} does not exist; prepare the data first "
            f"(energyformer prepare <dataset>) or pass --model.vocab_size N")
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
        vocab = meta["vocab_size"]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise ValueError(f"{str(meta_path)!r} has no readable 'vocab_size' ({e!r})") from None
    return check_int(f"vocab_size in {meta_path}", vocab, 1)


def _build_section(cls: type, values: Mapping[str, Any], section: str) -> Any:
    """Instantiate dataclass ``cls`` from ``values`` after checking keys and coercing types."""
    hints = typing.get_type_hints(cls)
    valid = [f.name for f in fields(cls) if f.init]
    kwargs = {}
    for key, value in values.items():
        if key not in valid:
            close = difflib.get_close_matches(str(key), valid, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            what = f"for arch {getattr(cls, 'arch', '')!r}" if section == "model" else f"in section {section!r}"
            raise ValueError(f"unknown config key '{section}.{key}'{hint} {what}; valid keys: {sorted(valid)}")
        kwargs[key] = coerce(value, hints[key], f"{section}.{key}")
    return cls(**kwargs)


_TRUE = {"true", "yes", "on", "1"}
_FALSE = {"false", "no", "off", "0"}


def _spells_none(value: Any, str_allowed: bool) -> bool:
    """``null``/``~``/``none``/``None`` mean None for an optional field (``--model.rope none``:
    in every option where both exist, ``"none"`` and ``None`` mean the same, e.g. ``norm``);
    ``""`` too unless the field also takes strings."""
    if not isinstance(value, str):
        return False
    v = value.strip().lower()
    return v in ("null", "~", "none") or (not str_allowed and v == "")


def coerce(value: Any, tp: Any, name: str) -> Any:
    """Convert ``value`` (a YAML value or a raw CLI string) to the annotated type ``tp``.

    Handles ``int``, ``float``, ``bool``, ``str``, ``X | None``, unions, ``tuple[...]`` and
    ``list[...]``; other annotations get the YAML-parsed value unchanged (the dataclass validates).

    Raises:
        ValueError: ``"name=value must be <type>"``.
    """
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        members = typing.get_args(tp)
        if type(None) in members and (value is None or _spells_none(value, str_allowed=str in members)):
            return None
        members = [m for m in members if m is not type(None)]
        if not isinstance(value, str):  # an exact type match wins (bool is not an int here)
            for m in members:
                if _is_instance(value, m):
                    return value
        # strings last, so that "1e-3" (a CLI token, or YAML 1.1's reading of 1e-3) becomes a
        # float in `float | str`
        for m in sorted(members, key=lambda m: m is str):
            try:
                return coerce(value, m, name)
            except ValueError:
                pass
        names = " or ".join(_type_name(m) for m in typing.get_args(tp))
        raise ValueError(f"{name}={_show(value)} must be {names}")
    if isinstance(value, _FlagOnly):
        if tp is bool:
            return True
        raise ValueError(f"override --{name} needs a value")
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
            return value.strip().lower() in _TRUE
        raise ValueError(f"{name}={_show(value)} must be a boolean (true/false)")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            s = value.strip().replace("_", "")
            try:
                return int(s)
            except ValueError:
                try:
                    f = float(s)
                except ValueError:
                    f = math.nan
                if math.isfinite(f) and f.is_integer():
                    return int(f)
        raise ValueError(f"{name}={_show(value)} must be an integer")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value.strip())
            except ValueError:
                pass
        raise ValueError(f"{name}={_show(value)} must be a number")
    if tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
        raise ValueError(f"{name}={_show(value)} must be a string")
    if origin in (tuple, list):
        if isinstance(value, str):
            try:
                value = yaml.safe_load(value)
            except yaml.YAMLError:
                raise ValueError(f"{name}={_show(value)} must be a list like [1, 2]") from None
        if not isinstance(value, (list, tuple)):
            raise ValueError(f"{name}={_show(value)} must be a list like [1, 2]")
        args = typing.get_args(tp)
        if origin is tuple and args and not (len(args) == 2 and args[1] is Ellipsis):
            if len(args) != len(value):
                raise ValueError(f"{name}={_show(value)} must have {len(args)} elements")
            items = [coerce(v, a, f"{name}[{i}]") for i, (v, a) in enumerate(zip(value, args))]
        elif args:
            items = [coerce(v, args[0], f"{name}[{i}]") for i, v in enumerate(value)]
        else:
            items = list(value)
        return tuple(items) if origin is tuple else items
    if isinstance(value, str):  # unknown annotation (e.g. Any): use YAML's reading of the string
        try:
            return yaml.safe_load(value)
        except yaml.YAMLError:
            return value
    return value


def _is_instance(value: Any, tp: Any) -> bool:
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if tp is float:
        return isinstance(value, float)
    if tp in (bool, str):
        return isinstance(value, tp)
    return False


def _type_name(tp: Any) -> str:
    if tp is type(None):
        return "null"
    return {int: "an integer", float: "a number", bool: "a boolean", str: "a string"}.get(tp, str(tp))


def _show(value: Any) -> str:
    return "(no value)" if isinstance(value, _FlagOnly) else repr(value)


def _plain(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    return obj
