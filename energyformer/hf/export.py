"""``energyformer export`` and ``energyformer import-hf``: run directories ↔ Hugging Face folders.

``export_run(RUN, to=DIR)`` writes ``config.json``, ``model.safetensors`` (a tied LM head
stored once, declared in the config), ``generation_config.json``, the run's tokenizer
(``tokenizer.json`` + ``tokenizer_config.json``, a ``PreTrainedTokenizerFast``), a model card
(``README.md``, :mod:`energyformer.hf.model_card`) and the family's code with an ``auto_map``
(:mod:`energyformer.hf.remote_code`: ``trust_remote_code=True`` loads it without energyformer;
docs/hf.md §2), so that::

    import energyformer.hf                          # registers the energyformer_* model types
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok, model = AutoTokenizer.from_pretrained(DIR), AutoModelForCausalLM.from_pretrained(DIR)

gives our logits exactly. ``as_="llama"`` writes a stock ``LlamaForCausalLM`` folder (our Llama,
or a CEM that equals one, see :mod:`energyformer.hf.convert`), ``as_="gpt2"`` a stock
``GPT2LMHeadModel`` folder (our GPT); neither needs energyformer to load.

``import_hf(DIR, out=RUN)`` reads a stock Llama or GPT-2 folder (or one of ours) into a run
directory that every energyformer command reads (``sample``, ``eval``, ``export``).
"""
from __future__ import annotations

import contextlib
import json
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    GPT2LMHeadModel,
    LlamaForCausalLM,
)

from energyformer.data.meta import NO_DATASET
from energyformer.hf.configuration import EnergyformerConfig, config_for
from energyformer.hf.convert import from_gpt2, from_llama, to_gpt2, to_llama
from energyformer.hf.model_card import write_model_card
from energyformer.hf.modeling import model_class
from energyformer.hf.remote_code import auto_map, write_remote_code
from energyformer.hf.tokenizer import char_vocab, run_tokenizer
from energyformer.models.registry import LANGUAGE_MODELS, build_model
from energyformer.runs.checkpoint import find_checkpoint
from energyformer.runs.config import DataConfig, RunConfig
from energyformer.runs.layout import CHECKPOINTS_DIR, METRICS_FILE, STATE_FILE, SUMMARY_FILE
from energyformer.runs.rundir import (
    CONFIG_FILE,
    MARKER_FILE,
    META_FILE,
    WEIGHTS_FILE,
    load_run,
    progress_note,
    run_progress,
    write_run_files,
)
from energyformer.runs.weights import save_weights
from energyformer.utils.io import atomic_write_json, usual_mode
from energyformer.utils.plugins import load_listed_plugins

#: ``as_`` values of :func:`export_run`
EXPORT_FORMATS = ("energyformer", "llama", "gpt2")
#: stock model types :func:`import_hf` reads (besides energyformer_*)
IMPORT_TYPES = ("llama", "gpt2")


@contextlib.contextmanager
def progress_bars(show: bool):
    """Inside the block, transformers' and huggingface_hub's progress bars ("Writing model shards",
    "Loading weights") are off unless ``show``; the setting is restored after. ``show=True``
    leaves the setting as it is (``HF_HUB_DISABLE_PROGRESS_BARS=1`` still wins)."""
    from transformers.utils import logging as hf_logging

    turn_off = not show and hf_logging.is_progress_bar_enabled()
    if turn_off:
        hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if turn_off:
            hf_logging.enable_progress_bar()


def check_complete_run(run_dir: str | Path) -> Path:
    """``run_dir`` as a Path if it holds a complete checkpoint.

    Raises:
        FileNotFoundError: no such directory.
        ValueError: an incomplete run (no ``checkpoint.json`` listing existing files: training
            has not written a checkpoint yet, or was cut while writing one).
    """
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise FileNotFoundError(f"run directory {str(run_dir)!r} does not exist")
    if find_checkpoint(run_dir) is None:
        raise ValueError(f"run {str(run_dir)!r} is incomplete: no complete checkpoint ({MARKER_FILE} listing "
                         f"{CONFIG_FILE}, {META_FILE}, {WEIGHTS_FILE}); let `energyformer train` write one first")
    return run_dir


def _check_target(to: Path) -> None:
    if to.exists() and not to.is_dir():
        raise ValueError(f"--to {str(to)!r} is a file; expected a folder")
    if to.is_dir() and any(to.iterdir()) and not (to / "config.json").is_file():
        raise ValueError(f"--to {str(to)!r} is a non-empty folder that is not an exported model; "
                         "choose an empty or new folder")


#: the files an export (ours or transformers' save_pretrained, any format) may leave in its folder
EXPORT_FILE_PATTERNS = ("config.json", "generation_config.json", "model.safetensors", "model-*-of-*.safetensors",
                        "model.safetensors.index.json", "pytorch_model*.bin", "pytorch_model.bin.index.json",
                        "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                        "vocab.json", "vocab.txt", "merges.txt", "tokenizer.model", "chat_template.jinja",
                        "README.md", "energyformer_*.py", "*_energyformer.py")


def _remove_earlier_export(to: Path) -> None:
    """Delete an earlier export's files from ``to`` so that none of them outlives the new export (a
    BPE ``vocab.json`` beside a new character tokenizer, stale shards or remote code); files no
    export writes are left alone."""
    for pattern in EXPORT_FILE_PATTERNS:
        for old in to.glob(pattern):
            if old.is_file():
                old.unlink()


def export_run(run_dir: str | Path, to: str | Path, as_: str = "energyformer", progress: bool = False) -> Path:
    """Write the run's model and tokenizer as a Hugging Face folder ``to``; returns ``to``.

    Args:
        run_dir: a run directory with a complete checkpoint.
        to: the output folder (created; an earlier export there is replaced: its files are deleted
            first, see ``EXPORT_FILE_PATTERNS``; files no export writes are kept).
        as_: ``"energyformer"`` (our model classes, any family), ``"llama"`` (stock Llama: our
            Llama, or CEM at T = 1 with ``rope: llama``, ``interaction: lowrank``, no
            preconditioner) or ``"gpt2"`` (stock GPT-2: our GPT without an LM-head bias).
        progress: show transformers' progress bars while writing (see :func:`progress_bars`).

    A run that has not finished (no ``summary.json``: still training, or stopped before
    ``max_steps``) is exported at its committed checkpoint with a one-line warning, and its model
    card says "step 100 of 1000, unfinished".

    Raises:
        ValueError: ``as_`` unknown, an incomplete run, a model the format cannot represent
            (the option is named), a tokenizer that cannot be exported, a bad ``to``.
        FileNotFoundError: missing run directory or files.
    """
    if as_ not in EXPORT_FORMATS:
        raise ValueError(f"--as {as_!r} is not a format; expected one of {', '.join(EXPORT_FORMATS)}")
    run_dir, to = check_complete_run(run_dir), Path(to)
    _check_target(to)
    model, run_cfg, meta = load_run(run_dir)
    stage = run_progress(run_dir, run_cfg)  # (``progress`` is the progress-bar flag)
    if not stage["finished"]:
        warnings.warn(f"exporting an unfinished run: {str(run_dir)!r} at {progress_note(stage)}"
                      + ("; later checkpoints will differ" if stage["pid"] is not None else "")
                      + "; the model card says so", UserWarning, stacklevel=2)
    c = model.config
    # a stock model embeds every id it is given, so the <pad> past its vocabulary cannot be used, and a
    # real token as pad would be a special token that decode(skip_special_tokens=True) deletes: none
    tokenizer = run_tokenizer(meta, run_dir, model_max_length=c.block_size, pad=as_ == "energyformer")
    if as_ == "energyformer":
        hf = model_class(c.arch)(config_for(c, imports=run_cfg.imports))
        hf.model.load_state_dict(model.state_dict())
    else:
        hf_config, state = (to_llama if as_ == "llama" else to_gpt2)(model)
        hf = (LlamaForCausalLM if as_ == "llama" else GPT2LMHeadModel)(hf_config)
        result = hf.load_state_dict(state, strict=False)
        missing = set(result.missing_keys) - ({"lm_head.weight"} if c.tie_embeddings else set())
        if missing or result.unexpected_keys:  # a bug in convert.py, not a user error
            raise RuntimeError(f"conversion left {sorted(missing)} missing, {result.unexpected_keys} unexpected")
    hf.generation_config = generation_config(tokenizer, c.vocab_size, use_cache=True)
    if tokenizer.pad_token_id is not None and tokenizer.pad_token_id < c.vocab_size:
        hf.config.pad_token_id = tokenizer.pad_token_id  # else the tokenizer's own <pad>, never embedded
    remote_code = as_ == "energyformer" and not run_cfg.imports
    if remote_code:
        hf.config.auto_map = auto_map(c.arch)
    to.mkdir(parents=True, exist_ok=True)
    _remove_earlier_export(to)
    with progress_bars(progress):
        hf.eval().save_pretrained(to)
        tokenizer.save_pretrained(to)
    for f in to.iterdir():  # safetensors writes 0600; an export is for others to read
        if f.is_file():
            usual_mode(f)
    if remote_code:
        write_remote_code(c.arch, to)
    write_model_card(to, run_dir, model, run_cfg, meta, find_checkpoint(run_dir) or {}, as_, remote_code,
                     progress=stage)
    return to


def generation_config(tokenizer: Any, vocab_size: int, use_cache: bool) -> GenerationConfig:
    """Defaults for ``generate``: the pad id (id 0 without a pad token: any real id, the attention mask hides it),
    the KV cache on, and ids the tokenizer never produces (a vocabulary padded past the tokenizer's)
    suppressed, as ``energyformer sample`` does with ``vocab_limit``."""
    real = tokenizer.vocab_size  # the tokenizer's own ids; <pad> and other added tokens come after
    suppress = list(range(min(real, vocab_size), vocab_size))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0  # stock: id 0, masked anyway
    return GenerationConfig(pad_token_id=pad, use_cache=use_cache,
                            suppress_tokens=suppress or None)


def _check_run_target(out: Path, force: bool) -> None:
    """``out`` may receive an imported run: new, empty, or (with ``force``) a run, whose checkpoints
    and training records are removed (they belong to the model being replaced)."""
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {str(out)!r} is a file; expected a folder")
    if not out.is_dir() or not any(out.iterdir()):
        return
    if not force:
        raise ValueError(f"--out {str(out)!r} already holds files (an earlier import?); pass --force to "
                         "overwrite them or choose another --out")
    if not (out / CONFIG_FILE).is_file():
        raise ValueError(f"--out {str(out)!r} is a non-empty folder that is not a run directory; "
                         "choose an empty or new folder")
    shutil.rmtree(out / CHECKPOINTS_DIR, ignore_errors=True)
    for name in (STATE_FILE, METRICS_FILE, SUMMARY_FILE):
        (out / name).unlink(missing_ok=True)


def import_hf(src: str | Path, out: str | Path, progress: bool = False, force: bool = False) -> Path:
    """Read a Hugging Face folder (stock Llama or GPT-2, or one exported by energyformer) into
    the run directory ``out`` (``config.yaml``, ``meta.json``, ``model.safetensors`` and a
    ``checkpoint.json`` marking it complete; no train state, so it cannot be resumed: fine-tune
    it with ``train.init_from``). Returns ``out``. ``progress`` shows transformers' progress
    bars while loading (see :func:`progress_bars`). ``force`` overwrites a run already in ``out``.
    The config names no dataset (``data.dataset: none``): a fine-tuning gives its data.

    The tokenizer is kept: a character tokenizer of ours becomes a ``char`` meta.json, any
    other ``tokenizers`` tokenizer a ``bpe`` one (its JSON inside meta.json).

    Raises:
        FileNotFoundError: no ``config.json`` in ``src``.
        ValueError: another model type (named), options our classes lack, no tokenizer in
            ``src``, or ``out`` already holds files (without ``force``; with it, files that are
            not a run's).
    """
    src, out = Path(src), Path(out)
    if not (src / "config.json").is_file():
        raise FileNotFoundError(f"{str(src / 'config.json')!r} not found; expected a Hugging Face model folder")
    raw = json.loads((src / "config.json").read_text(encoding="utf-8"))
    model_type = raw.get("model_type")
    if model_type not in IMPORT_TYPES and not str(model_type).startswith("energyformer_"):
        raise ValueError(f"{str(src)!r} holds model_type={model_type!r}; import-hf reads "
                         f"{', '.join(IMPORT_TYPES)} or energyformer_* folders")
    _check_run_target(out, force)
    imports: list[str] = []
    if str(model_type).startswith("energyformer_"):
        # an export of a run with plugins lists them: imported first (a plugin arch registers its model
        # type with transformers here), and kept in the run's config.yaml
        imports = load_listed_plugins(raw.get("imports"), src / "config.json")
        arch = (raw.get("energyformer") or {}).get("arch")
        if isinstance(arch, str) and arch not in LANGUAGE_MODELS:
            raise ValueError(f"{str(src / 'config.json')!r} holds arch {arch!r}, which is not a registered "
                             f"language model ({', '.join(LANGUAGE_MODELS)}); a plugin's arch needs its module: "
                             "energyformer --import MODULE import-hf ...")
        if isinstance(arch, str):
            model_class(arch)  # a plugin's arch: its classes, registered with the Auto classes
    hf_config = AutoConfig.from_pretrained(src)
    with progress_bars(progress):
        hf = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    state = dict(hf.state_dict())
    if isinstance(hf_config, EnergyformerConfig):
        model_config = hf_config.model_config()
        state = {k[len("model."):]: v for k, v in state.items()}
    elif model_type == "llama":
        model_config, state = from_llama(hf_config, state)
    else:
        model_config, state = from_gpt2(hf_config, state)
    model = build_model(model_config)
    model.load_state_dict(state, strict=True)
    meta = _tokenizer_meta(src, model_config.vocab_size)
    if meta["vocab_size"] > model_config.vocab_size:
        raise ValueError(f"the tokenizer of {str(src)!r} has {meta['vocab_size']} ids but the model only "
                         f"{model_config.vocab_size}")
    meta.update({"format_version": 1, "n_train": 0, "n_val": 0, "source": f"import-hf {src}"})
    out.mkdir(parents=True, exist_ok=True)
    write_run_files(out, RunConfig(model=model_config, data=DataConfig(dataset=NO_DATASET), imports=imports), meta)
    save_weights(model, out / WEIGHTS_FILE, {"step": "0"})
    atomic_write_json(out / MARKER_FILE, {"format_version": 1, "step": 0, "best_val_loss": None,
                                          "files": [CONFIG_FILE, META_FILE, WEIGHTS_FILE],
                                          "imported_from": str(src)})
    return out


def _tokenizer_meta(src: Path, vocab_size: int) -> dict[str, Any]:
    """meta.json fields for the tokenizer of ``src``; added tokens past the model's vocabulary
    (the ``<pad>`` an export appends) are dropped: the model cannot embed them."""
    try:
        tok = AutoTokenizer.from_pretrained(src)
    except (OSError, ValueError) as e:
        raise ValueError(f"no tokenizer could be read from {str(src)!r} ({e}); import-hf needs the "
                         "folder's tokenizer.json") from None
    if not getattr(tok, "is_fast", False):
        raise ValueError(f"the tokenizer of {str(src)!r} is not a fast (tokenizers) tokenizer")
    chars = char_vocab(tok)
    if chars is not None:
        return {"tokenizer": "char", "chars": chars, "vocab_size": len(chars)}
    spec = json.loads(tok.backend_tokenizer.to_str())
    spec["added_tokens"] = [t for t in spec.get("added_tokens") or [] if t["id"] < vocab_size]
    from tokenizers import Tokenizer

    n = Tokenizer.from_str(json.dumps(spec)).get_vocab_size()
    return {"tokenizer": "bpe", "bpe": spec, "vocab_size": n}
