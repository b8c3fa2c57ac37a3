"""The run's tokenizer as a ``transformers`` ``PreTrainedTokenizerFast`` (docs/architecture.md §1).

- character level (``meta.json`` ``tokenizer: char``): a ``tokenizers`` ``WordLevel`` model over
  the run's characters (token ``i`` is ``chars[i]``, as :class:`energyformer.data.CharTokenizer`),
  a pre-tokenizer that isolates every character and a ``Fuse`` decoder, so
  ``encode``/``decode`` equal ours. A character outside the vocabulary is an error in
  ``encode`` (``tokenizers`` names the missing ``<unk>``), never dropped silently.
- BPE: the ``tokenizers`` JSON that ``meta.json`` holds (``tokenizer: bpe``, key ``bpe``), or a
  ``tokenizer.json`` file in the run directory, is wrapped as it is.

Both get a ``<pad>`` token appended after the model's vocabulary (id ``vocab_size`` of the
tokenizer) for batched, padded prompts (``pad=False``: none, for stock exports, whose models
embed every id; docs/hf.md): a dedicated token that is never a real character, so
``batch_decode(skip_special_tokens=True)`` keeps every newline. Padded positions are removed
before the model runs (see :mod:`energyformer.hf.modeling`), so the id never reaches the
embedding, and the model config does not claim it. No BOS/EOS: our models are trained without them.
"""
from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from transformers import PreTrainedTokenizerFast

PAD_TOKEN = "<pad>"
UNK_TOKEN = "<unk>"  # named in the error for an unknown character; not in the vocabulary
TOKENIZER_FILE = "tokenizer.json"


def char_tokenizer(chars: list[str], model_max_length: int | None = None, pad: bool = True) -> PreTrainedTokenizerFast:
    """A fast tokenizer equal to ``CharTokenizer(chars)``: one token per character.

    Raises:
        ValueError: ``chars`` empty or not distinct single characters.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    if not chars or any(not isinstance(c, str) or len(c) != 1 for c in chars) or len(set(chars)) != len(chars):
        raise ValueError(f"chars must be a non-empty list of distinct single characters; got {chars!r:.80}")
    tok = Tokenizer(models.WordLevel({c: i for i, c in enumerate(chars)}, unk_token=UNK_TOKEN))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return _wrap(tok, model_max_length, pad)


def bpe_tokenizer(tokenizer_json: str, model_max_length: int | None = None,
                  pad: bool = True) -> PreTrainedTokenizerFast:
    """A serialized ``tokenizers`` tokenizer (the text of a ``tokenizer.json``) as a fast
    tokenizer, plus ``<pad>`` if it has no pad token.

    Raises:
        ValueError: not a ``tokenizers`` JSON.
    """
    from tokenizers import Tokenizer

    try:
        tok = Tokenizer.from_str(tokenizer_json)
    except Exception as e:  # tokenizers raises its own exception type
        raise ValueError(f"not a tokenizers JSON ({e})") from None
    return _wrap(tok, model_max_length, pad)


def _wrap(tok: Any, model_max_length: int | None, pad: bool = True) -> PreTrainedTokenizerFast:
    kwargs = {} if model_max_length is None else {"model_max_length": model_max_length}
    # left padding: what batched generation needs (lm-eval and users may change it)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, clean_up_tokenization_spaces=False, padding_side="left",
                                   **kwargs)
    if pad and fast.pad_token is None:
        fast.add_special_tokens({"pad_token": PAD_TOKEN})
    return fast


def run_tokenizer(meta: Mapping[str, Any], run_dir: str | Path | None = None,
                  model_max_length: int | None = None, pad: bool = True) -> PreTrainedTokenizerFast:
    """The tokenizer of a run: a ``tokenizer.json`` in ``run_dir`` if there is one, else the one
    ``meta`` (the run's ``meta.json``) describes: ``char`` or ``bpe``.

    Raises:
        ValueError: another ``meta["tokenizer"]`` (e.g. ``gpt2``, read with tiktoken, is not
            converted yet), or a corrupt tokenizer.
    """
    import json

    if run_dir is not None and (Path(run_dir) / TOKENIZER_FILE).is_file():
        return bpe_tokenizer((Path(run_dir) / TOKENIZER_FILE).read_text(encoding="utf-8"), model_max_length, pad)
    kind = meta.get("tokenizer")
    if kind == "char":
        return char_tokenizer(list(meta["chars"]), model_max_length, pad)
    if kind == "bpe" and "bpe" in meta:
        return bpe_tokenizer(json.dumps(meta["bpe"]), model_max_length, pad)
    raise ValueError(f"tokenizer={kind!r} in meta.json cannot be exported to transformers yet; "
                     f"expected 'char' or 'bpe' (or a {TOKENIZER_FILE} in the run directory)")


def char_vocab(tokenizer: PreTrainedTokenizerFast) -> list[str] | None:
    """The characters of a tokenizer built by :func:`char_tokenizer` (``None`` for any other):
    what ``import-hf`` writes back as a char ``meta.json``."""
    import json

    spec = json.loads(tokenizer.backend_tokenizer.to_str())
    model = spec.get("model") or {}
    if model.get("type") != "WordLevel" or (spec.get("decoder") or {}).get("type") != "Fuse":
        return None
    vocab = model["vocab"]
    chars = sorted(vocab, key=vocab.get)
    if any(len(c) != 1 for c in chars) or [vocab[c] for c in chars] != list(range(len(chars))):
        return None
    return chars
