"""Run configuration: typed dataclasses, YAML recipes and ``--section.key value`` overrides.

A run is described by three sections::

    model:   fields of the arch's config dataclass (chosen by ``model.arch`` via the registry)
    data:    DataConfig   (which prepared dataset to read)
    train:   TrainConfig  (optimizer, schedule, evaluation, checkpointing, device)

:func:`load_config` reads a recipe (following ``base:`` inheritance, see
:mod:`energyformer.runs.recipe`) and imports the plugin modules it names (``imports:``). The
run-config parser (:func:`run_config_parser`, a `jsonargparse
<https://jsonargparse.readthedocs.io>`_ parser with the conventions of
:mod:`energyformer.runs.parser`, built from the three dataclasses) reads the command-line
overrides and then checks and converts every value against the field's type annotation. The
``model`` section is polymorphic: the parser is built for the config class of ``model.arch``
(the ``--model.arch`` override, else the recipe's; ``energyformer.models.registry.get_arch``).
The dataclasses then validate values in ``__post_init__``. Every error is a one-line
``ValueError`` naming the key and what was expected; unknown keys get a "did you mean" hint.
Renamed model keys are upgraded with the config class's ``upgrade_dict`` (a ``FutureWarning``
names the old and the new key).

:func:`save_config` writes the resolved config (no ``base:``, every value explicit), which
``load_config`` reads back equal.
"""
from __future__ import annotations

import copy
import dataclasses
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, ClassVar

import yaml

from energyformer._validate import check_choice, check_float, check_int, did_you_mean
from energyformer.models.base import ModelConfig
from energyformer.models.registry import ARCHS, get_arch
from energyformer.runs.parser import ArgParser, type_name
from energyformer.runs.recipe import IMPORTS_KEY, deep_merge, imports_source, read_recipe
from energyformer.utils.derived import Rule, derived_rules, fill_derived, given_values
from energyformer.utils.io import atomic_write_text
from energyformer.utils.plugins import load_listed_plugins, load_plugins

SECTIONS = ("model", "data", "train")
LR_SCHEDULES = ("cosine", "exponential", "constant", "wsd")
DTYPES = ("float32", "bfloat16", "auto")
PARALLEL = ("ddp", "fsdp")
FSDP_CHECKPOINTS = ("sharded", "full")
# train.depth_sampler (energyformer.train.depth) and the keys each one reads
DEPTH_SAMPLER_KEYS = {"fixed": (), "poisson_lognormal": ("depth_mean", "depth_max"),
                      "uniform": ("depth_min", "depth_max")}
DEPTH_SAMPLERS = tuple(DEPTH_SAMPLER_KEYS)
#: how a run draws its depth (docs/training.md, randomized depth): a resume keeps the run's values unless given
DEPTH_TRAIN_KEYS = ("depth_sampler", "depth_mean", "depth_min", "depth_max", "backprop_steps")
DEFAULT_OUT_DIR = "out/run"  # when there is no recipe file to name the run after


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

    Args:
        dataset: name of the prepared dataset folder under ``root``.
        root: parent folder of prepared datasets (relative to the working directory).
        data_dir: the data directory itself; overrides ``root/dataset``.

    Raises:
        ValueError: an empty string.
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
    """Optimization, evaluation, checkpointing and device options.

    Defaults follow nanoGPT's Shakespeare-char recipe and the NRGPT reference code: AdamW with
    beta2 0.99, weight decay 0.1 on >= 2-D parameters, grad clip 1.0, linear warmup then cosine
    decay to ``min_lr`` (``lr_schedule="exponential"`` gives the NRGPT scripts' exponential decay).

    ``None`` defaults are derived (the ``derived`` rules, filled in one step after the fields they
    read are checked): ``min_lr`` → ``learning_rate / 10``, ``lr_decay_steps`` → ``max_steps``,
    ``cooldown_steps`` → a tenth of ``lr_decay_steps`` with ``wsd`` (else 0), ``ckpt_interval`` →
    ``eval_interval``. ``compile=None`` means "on for CUDA, off
    otherwise" and ``device="auto"`` means CUDA when available, else CPU; both are decided when
    training starts. ``resume`` is ``"auto"`` (continue from a complete checkpoint in ``out_dir``
    if there is one), ``"never"`` (start fresh, overwriting) or the path of a run directory to
    continue from. ``init_from`` starts a fresh run (step 0, a new optimizer) from the weights of
    another run directory, e.g. one written by ``energyformer import-hf``, which has no train
    state to resume (fine-tuning). ``grad_clip=0`` disables clipping. ``out_dir`` defaults to
    ``out/<recipe file name>`` when the config comes from a recipe file (see :func:`load_config`).

    Args:
        out_dir: the run directory (checkpoints, logs, resolved config).
        max_steps: optimizer steps in all (a resumed run continues up to this step).
        batch_size: sequences per micro-batch.
        grad_accum_steps: micro-batches per optimizer step.
        learning_rate: peak learning rate after warmup.
        min_lr: learning rate at the end of the decay (default ``learning_rate / 10``).
        lr_schedule: ``"cosine"``, ``"exponential"``, ``"constant"`` or ``"wsd"`` (warmup, then
            constant, then a linear cooldown to ``min_lr`` over the last ``cooldown_steps`` before
            ``lr_decay_steps``).
        warmup_steps: linear warmup steps.
        lr_decay_steps: step at which the decay reaches ``min_lr`` (default ``max_steps``). Steps count
            from 0 (``optim.lr_at``), so with the default the last step, ``max_steps - 1``, is one step
            short of ``min_lr``: a wsd cooldown of ``c`` steps ends at ``min_lr + (learning_rate - min_lr) / c``
            (the default cooldown of 100 steps of 1000 stops 1% of the range above ``min_lr``; one of 1 step
            does not lower the rate at all). Give ``lr_decay_steps = max_steps - 1`` to end exactly at ``min_lr``.
        cooldown_steps: with ``lr_schedule="wsd"``, the steps of the linear cooldown that ends at
            ``lr_decay_steps`` (default a tenth of ``lr_decay_steps``); must be 0 (the default)
            with the other schedules.
        weight_decay: AdamW weight decay on matrices.
        beta1: AdamW beta1.
        beta2: AdamW beta2.
        grad_clip: gradient-norm clipping threshold; 0 disables it.
        eval_interval: steps between evaluations.
        eval_iters: batches per split in an evaluation.
        log_interval: steps between log lines.
        ckpt_interval: steps between checkpoints (default ``eval_interval``).
        seed: seed of every RNG.
        resume: ``"auto"``, ``"never"`` or a run directory to continue from.
        init_from: a run directory whose weights a fresh run starts from (fine-tuning; the model
            config must be that run's, dropout aside); null = random initialization.
        device: ``"auto"``, ``"cpu"``, ``"cuda"``, ``"cuda:N"`` or ``"mps"``.
        dtype: ``"auto"`` (bf16 autocast with fp32 master weights on CUDA, float32 elsewhere;
            docs/gpu.md), ``"float32"`` or ``"bfloat16"`` (autocast).
        compile: ``torch.compile`` the model; null = on for CUDA only.
        num_threads: CPU threads for torch; null = torch's default.
        tensorboard: also write TensorBoard logs to ``out_dir/tb``.
        wandb: also log to Weights & Biases (``pip install 'energyformer[wandb]'``; files in
            ``out_dir/wandb``; ``WANDB_MODE=offline`` needs no account); a resumed run continues
            the same W&B run.
        wandb_project: the W&B project (null: ``energyformer``).
        wandb_run_name: the W&B run name (null: the name of ``out_dir``).
        parallel: under torchrun, ``"ddp"`` (DistributedDataParallel) or ``"fsdp"`` (FSDP2
            ``fully_shard`` per layer / recurrent block); ignored by a single process.
        fsdp_checkpoint: how FSDP2 runs checkpoint: ``"sharded"`` (every rank writes its own
            shards of the model and optimizer state with ``torch.distributed.checkpoint``, no
            gather; the last checkpoint adds the single-file ``model.safetensors``; docs/gpu.md)
            or ``"full"`` (every checkpoint gathers the full state to rank 0 and writes one file).
        activation_checkpointing: recompute activations in the backward (per layer, per recurrent
            step, per CEM descent step): memory that does not grow with ``n_steps`` for about one
            extra forward of compute.
        deterministic: deterministic kernels (``torch.use_deterministic_algorithms``,
            ``CUBLAS_WORKSPACE_CONFIG``, cuDNN flags): bit-exact resume on CUDA too, slower
            (docs/gpu.md); the CPU is deterministic without it.
        depth_sampler: the number of recurrent steps of each optimizer step
            (:mod:`energyformer.train.depth`): ``"fixed"`` (the model's ``n_steps``, as before),
            ``"poisson_lognormal"`` (mean ``depth_mean``, capped at ``depth_max`` if given) or
            ``"uniform"`` (an integer in ``[depth_min, depth_max]``). Recurrent models only
            (NRGPT, GPT_Rec, CEM).
        depth_mean: the mean depth of ``poisson_lognormal`` (a number > 1); null otherwise.
        depth_min: the smallest depth of ``uniform`` (>= 1); null otherwise.
        depth_max: the largest depth of ``uniform``, and the optional cap of ``poisson_lognormal``
            (>= ``depth_min`` and >= ``depth_mean``); null with ``fixed``.
        backprop_steps: truncated back-propagation: a graph through the last ``k`` recurrent steps
            only (the earlier ones run under ``torch.no_grad()``); null = through every step.

    Raises:
        ValueError: any value out of range or of the wrong type, naming the option.
    """

    #: derived field -> rule (its value when left null), in order (:mod:`energyformer.utils.derived`)
    derived: ClassVar[dict[str, Rule]] = {
        "min_lr": lambda c: c.learning_rate / 10,
        "lr_decay_steps": lambda c: c.max_steps,
        "cooldown_steps": lambda c: c.lr_decay_steps // 10 if c.lr_schedule == "wsd" else 0,
        "ckpt_interval": lambda c: c.eval_interval,
    }
    out_dir: str = DEFAULT_OUT_DIR
    max_steps: int = 2000
    batch_size: int = 32
    grad_accum_steps: int = 1
    learning_rate: float = 1e-3
    min_lr: float | None = None
    lr_schedule: str = "cosine"
    warmup_steps: int = 100
    lr_decay_steps: int | None = None
    cooldown_steps: int | None = None
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
    init_from: str | None = None
    device: str = "auto"
    dtype: str = "auto"
    compile: bool | None = None
    num_threads: int | None = None
    tensorboard: bool = False
    wandb: bool = False
    wandb_project: str | None = None
    wandb_run_name: str | None = None
    parallel: str = "ddp"
    fsdp_checkpoint: str = "sharded"
    activation_checkpointing: bool = False
    deterministic: bool = False
    depth_sampler: str = "fixed"
    depth_mean: float | None = None
    depth_min: int | None = None
    depth_max: int | None = None
    backprop_steps: int | None = None

    def __post_init__(self) -> None:
        # the fields the derived rules read, then the one resolution step, then the rest
        _check_nonempty_str("train.out_dir", self.out_dir)
        check_int("train.max_steps", self.max_steps, 0)
        check_int("train.batch_size", self.batch_size, 1)
        check_int("train.grad_accum_steps", self.grad_accum_steps, 1)
        check_float("train.learning_rate", self.learning_rate, 0.0, strict=True)
        check_choice("train.lr_schedule", self.lr_schedule, LR_SCHEDULES)
        if self.lr_decay_steps is not None:  # read by cooldown_steps' rule
            check_int("train.lr_decay_steps", self.lr_decay_steps, 0)
        check_int("train.eval_interval", self.eval_interval, 1)
        fill_derived(self)
        check_float("train.min_lr", self.min_lr, 0.0, maximum=self.learning_rate)
        if self.lr_schedule == "exponential" and self.min_lr <= 0:
            raise ValueError("train.min_lr must be > 0 with train.lr_schedule='exponential'")
        check_int("train.warmup_steps", self.warmup_steps, 0)
        # lr_decay_steps < warmup_steps is allowed (short test runs): lr_at then warms up and
        # jumps to min_lr after warmup
        check_int("train.lr_decay_steps", self.lr_decay_steps, 0)
        check_int("train.cooldown_steps", self.cooldown_steps, 0)
        if self.cooldown_steps and self.lr_schedule != "wsd":
            raise ValueError(f"train.cooldown_steps={self.cooldown_steps} needs train.lr_schedule='wsd' "
                             f"(got {self.lr_schedule!r}); set it to 0 for the other schedules "
                             "(--train.cooldown_steps 0)")
        check_float("train.weight_decay", self.weight_decay, 0.0)
        check_float("train.beta1", self.beta1, 0.0, maximum=0.999999)
        check_float("train.beta2", self.beta2, 0.0, maximum=0.999999)
        check_float("train.grad_clip", self.grad_clip, 0.0)
        check_int("train.eval_iters", self.eval_iters, 1)
        check_int("train.log_interval", self.log_interval, 1)
        check_int("train.ckpt_interval", self.ckpt_interval, 1)
        check_int("train.seed", self.seed, 0)
        _check_nonempty_str("train.resume", self.resume)
        if self.init_from is not None:
            _check_nonempty_str("train.init_from", self.init_from)
        _check_device(self.device)
        check_choice("train.dtype", self.dtype, DTYPES)
        if self.compile is not None and not isinstance(self.compile, bool):
            raise ValueError(f"train.compile={self.compile!r} must be true, false or null (auto)")
        if self.num_threads is not None:
            check_int("train.num_threads", self.num_threads, 1)
        if not isinstance(self.tensorboard, bool):
            raise ValueError(f"train.tensorboard={self.tensorboard!r} must be true or false")
        if not isinstance(self.wandb, bool):
            raise ValueError(f"train.wandb={self.wandb!r} must be true or false")
        for key in ("wandb_project", "wandb_run_name"):
            if getattr(self, key) is not None:
                _check_nonempty_str(f"train.{key}", getattr(self, key))
        check_choice("train.parallel", self.parallel, PARALLEL)
        check_choice("train.fsdp_checkpoint", self.fsdp_checkpoint, FSDP_CHECKPOINTS)
        if not isinstance(self.deterministic, bool):
            raise ValueError(f"train.deterministic={self.deterministic!r} must be true or false")
        self._check_depth()

    def _check_depth(self) -> None:
        """The randomized-depth keys: which ones each ``depth_sampler`` reads, and their ranges."""
        sampler = check_choice("train.depth_sampler", self.depth_sampler, DEPTH_SAMPLERS)
        for key in ("depth_mean", "depth_min", "depth_max"):
            if getattr(self, key) is not None and key not in DEPTH_SAMPLER_KEYS[sampler]:
                users = [name for name, keys in DEPTH_SAMPLER_KEYS.items() if key in keys]
                raise ValueError(f"train.{key}={getattr(self, key)!r} is only read by train.depth_sampler "
                                 f"{' or '.join(repr(u) for u in users)}; got train.depth_sampler={sampler!r} "
                                 "(leave it null, or give train.depth_sampler too: resuming a run, the sampler "
                                 "and its keys are kept or replaced together)")
        if sampler == "poisson_lognormal":
            if self.depth_mean is None:
                raise ValueError("train.depth_sampler='poisson_lognormal' needs train.depth_mean, the mean depth "
                                 "(a number > 1)")
            self.depth_mean = check_float("train.depth_mean", self.depth_mean, 1.0, strict=True)
            if self.depth_max is not None:
                check_int("train.depth_max", self.depth_max, 1)
                if self.depth_max < self.depth_mean:
                    raise ValueError(f"train.depth_max={self.depth_max} must be >= train.depth_mean="
                                     f"{self.depth_mean:g} (the cap of the drawn depths)")
        if sampler == "uniform":
            for key in ("depth_min", "depth_max"):
                if getattr(self, key) is None:
                    raise ValueError(f"train.depth_sampler='uniform' needs train.{key} (an integer >= 1); "
                                     "the depth is drawn uniformly from [depth_min, depth_max]")
                check_int(f"train.{key}", getattr(self, key), 1)
            if self.depth_min > self.depth_max:
                raise ValueError(f"train.depth_min={self.depth_min} must be <= train.depth_max={self.depth_max}")
        if self.backprop_steps is not None:
            check_int("train.backprop_steps", self.backprop_steps, 1)

    @property
    def sequences_per_step(self) -> int:
        """Sequences per optimizer step: ``batch_size * grad_accum_steps``."""
        return self.batch_size * self.grad_accum_steps


#: TrainConfig fields whose None default is derived from other fields (kept on resume unless given)
DERIVED_TRAIN_KEYS = tuple(TrainConfig.derived)


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
    """A full run: ``model`` (the arch's ModelConfig), ``data`` and ``train`` sections.

    ``explicit`` (set by :func:`load_config`) names, per section, the keys the recipe or the
    command line gave and ``overridden`` the keys the command line gave; ``None`` when unknown.
    Resuming keeps the run's derived values (``DERIVED_TRAIN_KEYS``) unless they were given
    explicitly, and its ``lr_schedule`` and depth sampler unless the command line names them. ``imports`` are the plugin
    modules the run needs (``energyformer --import MODULE``, the recipe's ``imports:``), saved
    in its config.yaml so that a fresh process imports them before reading the model section.
    ``data_meta`` is the data's meta.json as :func:`load_config` read it to fill in
    ``model.vocab_size`` (``None`` when it did not), so that training reads the file once; it is
    not part of the config (not saved, not compared).
    """

    model: ModelConfig
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    explicit: dict[str, frozenset[str]] | None = field(default=None, compare=False, repr=False)
    overridden: dict[str, frozenset[str]] | None = field(default=None, compare=False, repr=False)
    imports: list[str] = field(default_factory=list)
    data_meta: dict[str, Any] | None = field(default=None, compare=False, repr=False)

    def to_dict(self) -> dict[str, Any]:
        """Plain nested dict (lists instead of tuples) in the recipe layout (``imports`` first, if any)."""
        imports = {IMPORTS_KEY: list(self.imports)} if self.imports else {}
        return _plain({**imports, "model": self.model.to_dict(), "data": dataclasses.asdict(self.data),
                       "train": dataclasses.asdict(self.train)})


# --------------------------------------------------------------------------------------------
# loading
# --------------------------------------------------------------------------------------------

def load_config(path_or_dict: str | Path | Mapping[str, Any], overrides: Sequence[str] = (),
                resolve_vocab: bool = False, default_vocab_size: int | None = None,
                imports: Sequence[str] = ()) -> RunConfig:
    """Build a :class:`RunConfig` from a YAML recipe (or dict) plus command-line overrides.

    Args:
        path_or_dict: path of a YAML recipe with ``model``/``data``/``train`` sections (and
            optionally ``base: other.yaml`` and ``imports: [module, ...]``), or the dict itself.
            A recipe file that does not set ``train.out_dir`` gets ``out/<file stem>``; a dict
            gets ``out/run``.
        overrides: CLI tokens such as ``["--train.max_steps", "2000", "--model.n_steps=6"]``,
            read by the run-config parser (:func:`run_config_parser`, the conventions of
            :mod:`energyformer.runs.parser`: ``-`` or ``_`` in key names, a boolean key alone
            means true, ``inf``/``nan`` are numbers, ``none``/``null`` is None for an optional
            key). ``--help`` prints that parser's help (every key of the arch) and exits.
        resolve_vocab: when ``model.vocab_size`` is not given, read it from ``meta.json`` in the
            data directory (``energyformer.data.load_meta``).
        default_vocab_size: with ``resolve_vocab``, the vocab size to use when that ``meta.json``
            does not exist (e.g. to inspect a recipe before the data is prepared); ``None`` makes
            a missing ``meta.json`` an error.
        imports: plugin modules added to the recipe's top-level ``imports:`` list. All of them
            are imported (:func:`~energyformer.utils.plugins.load_plugins`) before the model
            section is read, and the returned config keeps them (``save_config`` writes them).

    Returns:
        the validated run config (every ``None`` default that depends on other fields resolved).

    Raises:
        FileNotFoundError: the recipe file (or a base recipe) or, with ``resolve_vocab``, the
            data meta.json is missing.
        ValueError: one line naming the key: a plugin module that fails to import, malformed YAML or override,
            an inheritance cycle, unknown section/key (with the valid ones and a "did you mean"), a value of the wrong
            type (with the expected type) or an invalid value (from the dataclass).
        SystemExit: ``--help`` among the overrides (status 0, after printing the help).
    """
    raw, stem, recipe_imports = _read_raw(path_or_dict)
    # checked and imported (a plugin may register the arch the recipe names, an ArchSpec): the
    # recipe's, then the extra ones, once each
    if isinstance(path_or_dict, (str, Path)):  # an error names the file that lists them
        recipe_imports = load_listed_plugins(recipe_imports, imports_source(path_or_dict))
    imports = load_plugins(recipe_imports, [imports] if isinstance(imports, str) else list(imports))
    arch = _arch_override(overrides) or raw["model"].get("arch")
    if arch is None:
        raise ValueError(f"the model section needs an 'arch' key, one of {sorted(ARCHS)}")
    _, cfg_cls = get_arch(arch)  # an unknown arch: one line listing the registered ones
    override_parser = run_config_parser(cfg_cls, overrides=True)
    if any(tok in ("--help", "-h") for tok in overrides):  # the help shows the recipe's values, overridden
        shown = copy.deepcopy(raw)
        try:
            rest = override_parser.parse_args([t for t in overrides if t not in ("--help", "-h")],
                                              defaults=False).as_dict()
        except (SystemExit, ValueError):  # a bad override: the recipe's values (the run reports it)
            rest = {}
        for section in SECTIONS:
            shown[section].update(rest.get(section) or {})
        _recipe_defaults(override_parser, shown, cfg_cls)
        override_parser.set_defaults({"model.arch": arch})
    given = override_parser.parse_args(list(overrides), defaults=False).as_dict()
    given = {section: dict(given.get(section) or {}) for section in SECTIONS}
    given["model"].pop("arch", None)
    # old key spellings are renamed in the recipe and in the overrides separately, so that an
    # override under the old name replaces the recipe's value under the new one
    raw["model"] = cfg_cls.upgrade_dict({k: v for k, v in raw["model"].items() if k != "arch"})
    given["model"] = cfg_cls.upgrade_dict(given["model"])
    classes = {"model": cfg_cls, "data": DataConfig, "train": TrainConfig}
    for section, cls in classes.items():
        _check_keys(cls, raw[section], section)
    _rederive(raw, given, classes, cfg_cls)
    for section in classes:
        raw[section].update(given[section])
    if stem is not None and "out_dir" not in raw["train"]:
        raw["train"]["out_dir"] = f"out/{stem}"

    parser = run_config_parser(cfg_cls)
    ns = parser.parse_object(raw)
    # each section is built (and validated) once, the data first when it gives the vocabulary
    meta, data = None, None
    if resolve_vocab and raw["model"].get("vocab_size") is None:
        data = DataConfig(**ns.data.as_dict())
        ns.model.vocab_size, meta = _vocab_from_meta(data.path, default_vocab_size)
    model = _build_model_config(cfg_cls, ns.model.as_dict())
    data = data if data is not None else DataConfig(**ns.data.as_dict())
    train = TrainConfig(**ns.train.as_dict())
    explicit = {section: frozenset(raw[section]) for section in SECTIONS}
    overridden = {section: frozenset(given[section]) for section in SECTIONS}
    return RunConfig(model=model, data=data, train=train, explicit=explicit, overridden=overridden,
                     imports=imports, data_meta=meta)


def _build_model_config(cfg_cls: type[ModelConfig], values: dict[str, Any]) -> ModelConfig:
    """``cfg_cls(**values)``, an invalid value's message naming its key as the recipe and the command
    line spell it (``model.d_model=-4 …``, as ``train.`` and ``data.`` keys are named): the config
    classes, also built in Python, name the bare field."""
    try:
        return cfg_cls(**values)
    except ValueError as e:
        key = str(e).split("=", 1)[0]
        if key in {f.name for f in fields(cfg_cls)}:
            raise type(e)(f"model.{e}") from None
        raise


def _rederive(raw: dict[str, Any], given: dict[str, dict[str, Any]], classes: dict[str, type],
              cfg_cls: type[ModelConfig]) -> None:
    """Let the recipe's derived values derive again from the overridden values (in place).

    A run's saved ``config.yaml`` holds every derived value (``attn_n_steps``, ``d_ff``, the
    schedule's step counts, ...), so a recipe read from it would keep them when an override changes
    their inputs (``--model.n_steps 3`` leaving ``attn_n_steps`` at the old 2). In a section that
    has overrides and holds every field of its class (as :func:`save_config` writes it: a saved
    config, not a hand-written recipe, whose ``min_lr: 1e-4`` is the author's choice even where it
    equals the rule), a derived key whose recipe value equals what its rule gives from the recipe's
    own values counts as derived (:func:`~energyformer.utils.derived.given_values`) and is dropped
    before the overrides apply, so the built config derives it from the new values; a value
    different from its rule, or a derived key the overrides name, is kept. A recipe section that
    does not build on its own (e.g. no ``vocab_size`` yet) is left as it is.
    """
    todo = [section for section, cls in classes.items()
            if given[section] and _written_in_full(cls, raw[section])
            and any(k not in given[section] for k in derived_rules(cls))]
    if not todo:
        return
    ns = run_config_parser(cfg_cls).parse_object(copy.deepcopy(raw))
    for section in todo:
        cls = classes[section]
        try:
            before = cls(**getattr(ns, section).as_dict())
        except (TypeError, ValueError):  # the final build reports it, with the overrides applied
            continue
        kept = given_values(before)
        for key in derived_rules(cls):
            if key in raw[section] and key not in kept and key not in given[section]:
                del raw[section][key]


def _written_in_full(cls: type, section: Mapping[str, Any]) -> bool:
    """Whether a recipe section names every field of ``cls``, as a saved config.yaml does."""
    return all(f.name in section for f in dataclasses.fields(cls) if f.init)


def _recipe_defaults(parser: RunConfigParser, raw: dict[str, Any], cfg_cls: type[ModelConfig]) -> None:
    """Make the recipe's values the defaults ``--help`` shows (keys the parser lacks are skipped:
    the recipe's own check names them when it is parsed)."""
    from jsonargparse import ArgumentError

    sections = {**raw, "model": cfg_cls.upgrade_dict({k: v for k, v in raw["model"].items() if k != "arch"})}
    for section in SECTIONS:
        for key, value in (sections.get(section) or {}).items():
            try:
                parser.set_defaults({f"{section}.{key}": value})
            except (ArgumentError, KeyError, TypeError, ValueError):
                pass


def save_config(run_cfg: RunConfig, path: str | Path) -> Path:
    """Write the resolved config as YAML (atomically); ``load_config(path)`` reads it back equal."""
    text = yaml.safe_dump(run_cfg.to_dict(), sort_keys=False, default_flow_style=False)
    return atomic_write_text(Path(path), text)


class RunConfigParser(ArgParser):
    """The parser of ``--section.key value`` overrides: unknown tokens get the run-config message
    (did you mean, the valid keys or sections)."""

    noun = "override "
    model_cls: type[ModelConfig]

    def unrecognized(self, tokens: list[str]) -> str:
        tok = tokens[0]
        if not tok.startswith("--"):
            return f"unexpected argument {tok!r}; overrides look like --train.max_steps 2000 or --model.n_steps=6"
        key = tok[2:].split("=", 1)[0]
        parts = key.split(".")
        if len(parts) != 2 or not all(parts):
            return (f"override --{key} must name a section and a key, like --train.max_steps; "
                    f"sections are {list(SECTIONS)}")
        if parts[0] not in SECTIONS:
            return f"unknown config section {parts[0]!r} in override --{key}; expected one of {list(SECTIONS)}"
        classes = {"model": self.model_cls, "data": DataConfig, "train": TrainConfig}
        return unknown_key_message(classes[parts[0]], parts[0], parts[1])


def run_config_parser(model_config_cls: type[ModelConfig], overrides: bool = False) -> RunConfigParser:
    """The parser of a run whose model section is ``model_config_cls``: ``--model.*``,
    ``--data.*`` and ``--train.*``, typed by the three dataclasses.

    ``overrides`` (the parser of command-line overrides) adds ``--model.arch`` and the old names
    of renamed model keys (``model_config_cls.renamed_keys``) as options whose value is kept as
    given (``ModelConfig.upgrade_dict`` renames them, with a ``FutureWarning``). Its help (``format_help()``)
    lists every key with its type and default;
    ``energyformer train RECIPE --help`` prints it.
    """
    parser = RunConfigParser(prog=f"run config (model.arch={model_config_cls.arch})",
                             description="Keys of a run recipe; override any with --section.key VALUE.")
    parser.model_cls = model_config_cls
    parser.add_class_arguments(model_config_cls, "model", help=f"model ({model_config_cls.__name__})")
    if overrides:
        parser.add_argument("--model.arch", type=str, help=f"the arch, one of {sorted(ARCHS)}")
        for old, new in model_config_cls.renamed_keys.items():
            parser.add_argument(f"--model.{old}", type=str, help=f"deprecated: the old name of --model.{new}")
    parser.add_class_arguments(DataConfig, "data", help="data (DataConfig)")
    parser.add_class_arguments(TrainConfig, "train", help="train (TrainConfig)")
    return parser


def _arch_override(tokens: Sequence[str]) -> str | None:
    """The value of the last ``--model.arch`` token (the parser is built for that arch)."""
    arch = None
    for i, tok in enumerate(tokens):
        name, eq, value = tok.partition("=")
        if name == "--model.arch":
            arch = value if eq else (tokens[i + 1] if i + 1 < len(tokens) else None)
    return arch


def _read_raw(path_or_dict: str | Path | Mapping[str, Any]) -> tuple[dict[str, Any], str | None, Any]:
    """``(recipe with bases merged, file stem or None, its imports as written)``, every section
    present as a dict (the imports are checked by :func:`~energyformer.utils.plugins.load_plugins`)."""
    if isinstance(path_or_dict, Mapping):
        raw, stem = dict(path_or_dict), None
        if "base" in raw:  # a dict may extend a recipe file too (relative to the working directory)
            base = read_recipe(raw.pop("base"))
            raw = deep_merge(base, {k: ({} if v is None else v) for k, v in raw.items()
                                    if not (k == IMPORTS_KEY and v is None)})  # imports None: none added
    elif isinstance(path_or_dict, (str, Path)):
        raw, stem = read_recipe(path_or_dict), Path(path_or_dict).stem
    else:
        raise ValueError(f"load_config expects a YAML path or a dict, got {type(path_or_dict).__name__}")
    unknown = sorted(set(raw) - set(SECTIONS) - {IMPORTS_KEY})
    if unknown:
        raise ValueError(f"unknown config section(s) {unknown}; expected some of {list(SECTIONS)} "
                         f"(and base, {IMPORTS_KEY})")
    out = {}
    for section in SECTIONS:
        value = raw.get(section)
        if value is None:
            value = {}
        if not isinstance(value, Mapping):
            raise ValueError(f"config section {section!r} must be a mapping of keys to values, got {value!r}")
        out[section] = dict(value)
    return out, stem, raw.get(IMPORTS_KEY)  # None: none; load_plugins refuses "" or a mapping


def unknown_key_message(cls: type, section: str, key: str) -> str:
    """``unknown config key 'train.max_step' (did you mean 'max_steps'?) ...; valid keys: [...]``."""
    valid = [f.name for f in fields(cls) if f.init] + (["arch"] if section == "model" else [])
    hint = did_you_mean(str(key), valid)
    what = f"for arch {getattr(cls, 'arch', '')!r}" if section == "model" else f"in section {section!r}"
    return f"unknown config key '{section}.{key}'{hint} {what}; valid keys: {sorted(valid)}"


def _check_keys(cls: type, values: Mapping[str, Any], section: str) -> None:
    """Reject a recipe key that ``cls`` does not have (with a hint)."""
    valid = {f.name for f in fields(cls) if f.init}
    for key in values:
        if key not in valid:
            raise ValueError(unknown_key_message(cls, section, key))


__all__ = ["DataConfig", "TrainConfig", "RunConfig", "load_config", "save_config", "run_config_parser",
           "build_model_from_recipe", "type_name", "unknown_key_message"]


def _vocab_from_meta(data_dir: Path, default: int | None) -> tuple[int, dict[str, Any] | None]:
    """``(vocab_size, the meta dict read)`` of the data in ``data_dir``; ``(default, None)`` without a
    meta.json when a default is given."""
    from energyformer.data import load_meta

    try:
        meta = load_meta(data_dir)
    except FileNotFoundError:
        if default is not None:
            return default, None
        raise FileNotFoundError(
            f"model.vocab_size is not set and {str(data_dir / 'meta.json')!r} does not exist; prepare the "
            "data first (energyformer prepare <dataset>) or pass --model.vocab_size N") from None
    return check_int(f"vocab_size in {data_dir / 'meta.json'}", meta["vocab_size"], 1), meta


def _plain(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    return obj


def build_model_from_recipe(path: str | Path, **overrides: Any):
    """A freshly initialized model from a YAML recipe's ``model`` section.

    ``overrides`` replace model fields (``vocab_size=65, n_steps=6``). Without ``vocab_size``
    in the recipe or the overrides, it is read from the recipe's data ``meta.json``
    (``data.root`` is relative to the working directory).

    Raises:
        FileNotFoundError: the recipe does not exist, or its data ``meta.json`` is needed and
            missing (the message says to pass ``vocab_size``).
        ValueError: unknown keys or invalid values (one line naming the key).
    """
    from energyformer.models.registry import build_model

    tokens = [t for k, v in overrides.items() for t in (f"--model.{k}", v if isinstance(v, str) else json.dumps(v))]
    return build_model(load_config(path, tokens, resolve_vocab=True).model)
