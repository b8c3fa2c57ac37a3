"""Hugging Face transformers integration: export / import, Auto classes, generate, stock Llama and GPT-2
(energyformer.hf; docs/baselines.md §3, docs/cem.md §2). Offline: HF_HUB_OFFLINE=1 (conftest)."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch

pytest.importorskip("transformers")

from run_helpers import CHARS, char_meta, make_run  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

import energyformer.hf  # noqa: E402,F401  (registers the Auto classes)
from energyformer.cli import main  # noqa: E402
from energyformer.data import CharTokenizer  # noqa: E402
from energyformer.hf.export import export_run, import_hf  # noqa: E402
from energyformer.runs.rundir import load_run  # noqa: E402

ARCHS = ["gpt", "llama", "cem", "nrgpt", "gpt_rec"]
TEXT = "the cat sat on a mat."


def _export(tmp_path, spec, name="run", **kw):
    run = make_run(tmp_path / name, spec)
    out = export_run(run, tmp_path / f"hf_{name}", **kw)
    return run, out


def _ours(run):
    return load_run(run)[0]


@pytest.mark.parametrize("arch", ARCHS)
def test_export_reproduces_our_logits_and_tokenizer(tmp_path, arch):
    run, out = _export(tmp_path, {"arch": arch})
    tok = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out)
    assert type(model).__name__.startswith("Energyformer") and model.config.model_type == f"energyformer_{arch}"
    ids = tok(TEXT)["input_ids"]
    assert ids == CharTokenizer(CHARS).encode(TEXT) and tok.decode(ids) == TEXT
    x = torch.tensor([ids])
    with torch.no_grad():
        torch.testing.assert_close(model(x).logits, _ours(run)(x)[0], atol=0, rtol=0)
    emb = model.get_input_embeddings()  # what resize_token_embeddings and other HF tools call
    assert isinstance(emb, torch.nn.Embedding) and emb.num_embeddings == len(CHARS)
    assert model.get_output_embeddings().out_features == len(CHARS)
    assert json.loads((out / "generation_config.json").read_text())["use_cache"] is True


def test_tied_head_is_stored_once_and_tied_after_loading(tmp_path):
    from safetensors import safe_open

    _, out = _export(tmp_path, {"arch": "cem", "tie_embeddings": True})
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert "model.embed.weight" in names and "model.lm_head.weight" not in names
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.model.lm_head.weight is model.model.embed.weight


def test_padded_batch_gives_each_row_its_unpadded_logits(tmp_path):
    run, out = _export(tmp_path, {"arch": "nrgpt"})
    tok, model, ours = AutoTokenizer.from_pretrained(out), AutoModelForCausalLM.from_pretrained(out), _ours(run)
    texts = ["the cat", "a dog ran on", "so"]
    enc = tok(texts, return_tensors="pt", padding=True)
    assert tok.padding_side == "left" and (enc["attention_mask"] == 0).any()
    with torch.no_grad():
        logits = model(**enc).logits
        for row, text in enumerate(texts):
            n = len(text)
            ref = ours(torch.tensor([tok(text)["input_ids"]]))[0][0]
            torch.testing.assert_close(logits[row, -n:], ref, atol=1e-6, rtol=0)


@pytest.mark.parametrize("arch", ["nrgpt", "gpt", "cem", "llama", "gpt_rec"])
@pytest.mark.parametrize("use_cache", [True, False])
def test_greedy_generate_equals_ours_also_past_block_size(tmp_path, arch, use_cache):
    """With the cache (the default) both restart it past block_size by the same rule; without, both
    slide a block_size window. Either way the tokens are ours exactly."""
    run, out = _export(tmp_path, {"arch": arch})
    tok, model, ours = AutoTokenizer.from_pretrained(out), AutoModelForCausalLM.from_pretrained(out), _ours(run)
    x = torch.tensor([tok("the cat")["input_ids"]])
    n_new = 40  # 7 + 40 > block_size 32
    hf_out = model.generate(x, max_new_tokens=n_new, do_sample=False, use_cache=use_cache)
    ref = ours.generate(x, n_new, temperature=0, use_cache=use_cache)
    assert hf_out.shape == (1, 7 + n_new)
    assert torch.equal(hf_out, ref)


def test_generate_uses_the_kv_cache_by_default(tmp_path):
    """Each decoding step after the prompt runs one token through the model."""
    _, out = _export(tmp_path, {"arch": "nrgpt"})
    tok, model = AutoTokenizer.from_pretrained(out), AutoModelForCausalLM.from_pretrained(out)
    lengths = []
    real = model.model.forward
    model.model.forward = lambda ids, *a, **k: (lengths.append(ids.shape[1]), real(ids, *a, **k))[1]
    model.generate(torch.tensor([tok("the cat")["input_ids"]]), max_new_tokens=5, do_sample=False)
    assert lengths == [7, 1, 1, 1, 1]


def test_batched_left_padded_generate_equals_one_prompt_at_a_time(tmp_path):
    _, out = _export(tmp_path, {"arch": "gpt_rec"})
    tok, model = AutoTokenizer.from_pretrained(out), AutoModelForCausalLM.from_pretrained(out)
    texts = ["the cat", "a dog ran on"]
    enc = tok(texts, return_tensors="pt", padding=True)
    batched = model.generate(**enc, max_new_tokens=6, do_sample=False)
    for row, text in enumerate(texts):
        single = model.generate(**tok([text], return_tensors="pt"), max_new_tokens=6, do_sample=False)
        assert tok.decode(batched[row], skip_special_tokens=True) == tok.decode(single[0])


def test_sampling_options(tmp_path):
    _, out = _export(tmp_path, {"arch": "nrgpt"})
    tok, model = AutoTokenizer.from_pretrained(out), AutoModelForCausalLM.from_pretrained(out)
    x = tok(["the cat"], return_tensors="pt")
    greedy = model.generate(**x, max_new_tokens=8, do_sample=False)

    def sample(seed, **kw):
        torch.manual_seed(seed)
        return model.generate(**x, max_new_tokens=8, do_sample=True, **kw)

    a, b = sample(0, temperature=1.5), sample(0, temperature=1.5)
    assert torch.equal(a, b) and not torch.equal(a, greedy)  # seeded sampling is reproducible
    assert int(a.max()) < len(CHARS)  # never the <pad> id or beyond the vocabulary
    assert torch.equal(sample(1, top_k=1), greedy)  # top-k = 1 is greedy
    assert torch.equal(sample(2, top_p=1e-6), greedy)  # a tiny nucleus keeps only the top token
    # a huge repetition penalty forbids every token already in the context
    rep = model.generate(**x, max_new_tokens=8, do_sample=False, repetition_penalty=1e9)[0].tolist()
    assert len(set(rep)) == len(set(rep[:7])) + 8


@pytest.mark.parametrize("use_cache", [True, False])
def test_a_prompt_longer_than_the_context_keeps_its_last_block_size_tokens_everywhere(tmp_path, capsys, use_cache):
    """One behaviour (docs/models.md): the export's generate, our generate and `energyformer sample`
    keep the whole prompt in the output and continue from its last block_size tokens; the export
    and sample say so in one warning."""
    run, out = _export(tmp_path, {"arch": "gpt"})
    tok, model, ours = AutoTokenizer.from_pretrained(out), AutoModelForCausalLM.from_pretrained(out), _ours(run)
    text = ("the cat sat on a mat. " * 3)[:40]  # 40 tokens, block_size 32
    x = torch.tensor([tok(text)["input_ids"]])
    with pytest.warns(UserWarning, match=r"^the prompt has 40 tokens, more than the model's block_size=32: only "
                                         r"its last 32 tokens are the context"):
        hf_out = model.generate(x, max_new_tokens=6, do_sample=False, use_cache=use_cache)
    ref = ours.generate(x, 6, temperature=0, use_cache=use_cache)
    assert torch.equal(hf_out, ref) and torch.equal(hf_out[:, :40], x)
    assert torch.equal(ours.generate(x[:, -32:], 6, temperature=0, use_cache=use_cache)[:, 32:], ref[:, 40:])
    capsys.readouterr()
    assert main(["sample", str(run), "--prompt", text, "--max-new-tokens", "6", "--temperature", "0",
                 "--use-cache", str(use_cache).lower()]) == 0
    captured = capsys.readouterr()
    assert captured.out == tok.decode(ref[0].tolist()) + "\n"
    assert captured.err.splitlines() == ["warning: the prompt has 40 tokens, more than the model's block_size=32: "
                                         "only its last 32 tokens are the context (the text keeps the whole prompt)"]


def test_model_kwargs_pass_through_and_are_checked(tmp_path):
    run, out = _export(tmp_path, {"arch": "nrgpt"})
    model, ours = AutoModelForCausalLM.from_pretrained(out), _ours(run)
    x = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        torch.testing.assert_close(model(x, n_steps=5).logits, ours(x, n_steps=5)[0], atol=0, rtol=0)
    gpt = AutoModelForCausalLM.from_pretrained(_export(tmp_path, {"arch": "gpt"}, name="g")[1])
    with pytest.raises(ValueError, match="n_steps"):
        gpt(x, n_steps=2)


# --- stock transformers classes ---------------------------------------------------------------

_STOCK_SCRIPT = textwrap.dedent("""
    import json, sys, torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    text, results = sys.argv[1], {}
    for folder in sys.argv[2:]:
        tok, model = AutoTokenizer.from_pretrained(folder), AutoModelForCausalLM.from_pretrained(folder)
        assert tok.pad_token is None and len(tok) == model.config.vocab_size  # no <pad> past the vocabulary
        tok.pad_token_id = model.generation_config.pad_token_id  # how to pad a batch (docs/hf.md)
        ids = tok(text)["input_ids"]
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0]
            # a left-padded batch (the pad id must be a real embedding row of the stock model)
            batch = tok([text, text[:3]], return_tensors="pt", padding=True)
            padded = model.generate(**batch, max_new_tokens=4, do_sample=False)
            single = model.generate(**tok([text[:3]], return_tensors="pt"), max_new_tokens=4, do_sample=False)
        results[folder] = {"cls": type(model).__name__, "ids": ids, "logits": logits.tolist(),
                           "padded_row": tok.decode(padded[1][-7:], skip_special_tokens=True),
                           "single": tok.decode(single[0], skip_special_tokens=True)}
    assert not any(m.startswith("energyformer") for m in sys.modules), "energyformer was imported"
    print(json.dumps(results))
""")

STOCK_CASES = {  # name: (run spec, --as)
    "llama_gqa_tied": ({"arch": "llama", "n_kv_heads": 1, "tie_embeddings": True}, "llama"),
    "cem_llama": ({"arch": "cem", "rope": "llama", "per_step_scale": True}, "llama"),
    "cem_llama_up_tied": ({"arch": "cem", "rope": "llama", "mlp_tie": "up", "tie_embeddings": True}, "llama"),
    "gpt_gelu_tied": ({"arch": "gpt", "activation": "gelu", "tie_embeddings": True}, "gpt2"),
    "gpt_relu_nobias": ({"arch": "gpt", "activation": "relu", "bias": False}, "gpt2"),
    # the bundled recipe's GPT: an untied head with a bias, folded into ln_f (vocab_size 73 <= d_model 80)
    "gpt_head_bias": ({"arch": "gpt", "d_model": 80}, "gpt2"),
}


@pytest.fixture(scope="module")
def stock_exports(tmp_path_factory):
    """Every case exported, then loaded in one fresh Python that never imports energyformer."""
    root = tmp_path_factory.mktemp("stock")
    runs = {name: _export(root, spec, name=name, as_=as_) for name, (spec, as_) in STOCK_CASES.items()}
    res = subprocess.run([sys.executable, "-c", _STOCK_SCRIPT, TEXT] + [str(out) for _, out in runs.values()],
                         capture_output=True, text=True, env={"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"})
    assert res.returncode == 0, res.stderr[-2000:]
    loaded = json.loads(res.stdout.strip().splitlines()[-1])
    return {name: (run, loaded[str(out)]) for name, (run, out) in runs.items()}


@pytest.mark.parametrize("name", list(STOCK_CASES))
def test_stock_export_loads_without_energyformer_with_our_logits(stock_exports, name):
    """--as llama (our Llama; CEM at T=1 with llama RoPE, docs/cem.md §2) and --as gpt2 (our GPT)."""
    run, got = stock_exports[name]
    assert got["cls"] == {"llama": "LlamaForCausalLM", "gpt2": "GPT2LMHeadModel"}[STOCK_CASES[name][1]]
    with torch.no_grad():
        ref = _ours(run)(torch.tensor([got["ids"]]))[0][0]
    torch.testing.assert_close(torch.tensor(got["logits"]), ref, atol=2e-5, rtol=0)
    assert got["padded_row"].endswith(got["single"][-4:]) and len(got["padded_row"]) == len(got["single"])


def test_export_as_llama_refuses_a_cem_that_is_not_a_llama(tmp_path):
    run = make_run(tmp_path / "run", {"arch": "cem", "rope": "exact", "n_steps": 2})
    with pytest.raises(ValueError, match=r"attn_n_steps=2 \(needs 1\).*rope='exact' \(needs 'llama'\)"):
        export_run(run, tmp_path / "out", as_="llama")


def test_export_as_gpt2_refuses_an_lm_head_bias(tmp_path):
    run = make_run(tmp_path / "run", {"arch": "gpt"})  # bias=true, untied head with bias, vocab 73 > d_model 16
    with pytest.raises(ValueError, match="LM head has a bias .* cannot be folded .*vocab_size=73 > d_model=16"):
        export_run(run, tmp_path / "out", as_="gpt2")


@pytest.mark.parametrize("spec,as_", [({"arch": "llama", "n_kv_heads": 1}, "llama"),
                                      ({"arch": "gpt", "activation": "gelu", "tie_embeddings": True}, "gpt2"),
                                      ({"arch": "nrgpt", "eta_param": "c_diag_gamma"}, "energyformer")])
def test_import_hf_round_trip(tmp_path, spec, as_):
    run, out = _export(tmp_path, spec, as_=as_)
    back = import_hf(out, tmp_path / "back")
    x = torch.tensor([CharTokenizer(CHARS).encode(TEXT)])
    model, _, meta = load_run(back)
    assert meta["tokenizer"] == "char" and meta["chars"] == CHARS
    with torch.no_grad():
        torch.testing.assert_close(model(x)[0], _ours(run)(x)[0], atol=2e-5, rtol=0)
    export_run(back, tmp_path / "again")  # an imported run is complete: it exports again


def test_bpe_run_exports_its_tokenizer(tmp_path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer, bpe.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    bpe.train_from_iterator([TEXT * 20, "ROMEO: the dog"], trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    meta = {**char_meta(), "tokenizer": "bpe", "bpe": json.loads(bpe.to_str()), "vocab_size": bpe.get_vocab_size()}
    meta.pop("chars")
    run = make_run(tmp_path / "run", {"arch": "gpt", "vocab_size": bpe.get_vocab_size()}, meta=meta)
    out = export_run(run, tmp_path / "hf")
    tok = AutoTokenizer.from_pretrained(out)
    assert tok("the dog ran")["input_ids"] == bpe.encode("the dog ran").ids
    assert tok.decode(tok("ROMEO: the ñ")["input_ids"]) == "ROMEO: the ñ"
    back = load_run(import_hf(out, tmp_path / "back"))[2]
    assert back["tokenizer"] == "bpe" and back["bpe"]["model"]["type"] == "BPE"


# --- bad input ---------------------------------------------------------------------------------

def test_export_of_an_incomplete_run_is_one_line_error(tmp_path, capsys):
    run = make_run(tmp_path / "run", {"arch": "gpt"}, complete=False)
    assert main(["export", str(run), "--to", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: run ") and "is incomplete" in err and "\n" not in err


def test_import_of_another_model_type_is_one_line_error(tmp_path, capsys):
    (tmp_path / "bert").mkdir()
    (tmp_path / "bert" / "config.json").write_text(json.dumps({"model_type": "bert"}))
    assert main(["import-hf", str(tmp_path / "bert"), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip()
    assert "model_type='bert'" in err and "llama, gpt2" in err and "\n" not in err


def test_export_bad_format_and_target(tmp_path, capsys):
    run = make_run(tmp_path / "run", {"arch": "gpt"})
    assert main(["export", str(run), "--to", str(tmp_path / "o"), "--as", "bert"]) == 2
    assert "--as 'bert' is not a format" in capsys.readouterr().err
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x.txt").write_text("x")
    with pytest.raises(ValueError, match="non-empty folder"):
        export_run(run, tmp_path / "full")


def test_cli_export_and_import_hf(tmp_path, capsys):
    run = make_run(tmp_path / "run", {"arch": "llama"})
    assert main(["export", str(run), "--to", str(tmp_path / "hf"), "--as", "llama"]) == 0
    assert str(tmp_path / "hf") in capsys.readouterr().out
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["model_type"] == "llama"
    assert main(["import-hf", str(tmp_path / "hf"), "--out", str(tmp_path / "back")]) == 0
    assert load_run(tmp_path / "back")[1].model.arch == "llama"


def test_an_imported_run_is_fine_tuned_with_init_from(tmp_path, capsys):
    """import-hf writes weights but no train state: training on it names the command that fine-tunes
    it (--train.init_from), and that fresh run's first loss is the imported model's loss."""
    from helpers import make_data_dir
    from run_helpers import CHARS

    from energyformer.data import BatchSampler, load_split
    from energyformer.runs.config import load_config

    _, out = _export(tmp_path, {"arch": "nrgpt"})
    data, imp, ft = make_data_dir(tmp_path / "data", chars=CHARS), tmp_path / "imp", tmp_path / "ft"
    assert main(["import-hf", str(out), "--out", str(imp)]) == 0
    recipe = str(imp / "config.yaml")
    args = ["--data.data_dir", str(data), "--train.max_steps", "2", "--train.batch_size", "4",
            "--train.eval_iters", "1", "--train.log_interval", "1", "--train.warmup_steps", "1",
            "--train.device", "cpu"]
    hint = f"to fine-tune it, start a new run from its weights: energyformer train {recipe} --train.init_from {imp} "
    # (the second: the imported config names a dataset that is not prepared; the hint comes first)
    for argv in (["train", recipe, "--train.out_dir", str(imp), *args], ["train", recipe, "--train.out_dir", str(imp)],
                 ["train", str(imp)]):
        capsys.readouterr()
        assert main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("error: ") and "\n" not in err and "no training state" in err and hint in err, err

    # the imported config names no dataset (not its own folder): without data, the hint says to give it
    assert load_config(recipe).data.dataset == "none"
    capsys.readouterr()
    assert main(["train", recipe, "--train.init_from", str(imp), "--train.out_dir", str(ft)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err, err
    assert "names no dataset (an `energyformer import-hf` run has no training data)" in err
    assert "--data.dataset NAME or --data.data_dir DIR" in err and "prepare text" not in err
    assert main(["train", recipe, "--train.init_from", str(imp), "--train.out_dir", str(ft), *args]) == 0
    first = json.loads((ft / "metrics.jsonl").read_text().splitlines()[0])
    assert first["step"] == 1  # its train loss is taken before the first update: the imported weights'
    cfg = load_config(recipe)
    sampler = BatchSampler(load_split(data, "train"), 4, cfg.model.block_size,
                           torch.Generator().manual_seed(cfg.train.seed))
    x, y = sampler.next_step(1)[0]
    with torch.no_grad():
        imported_loss = load_run(imp)[0].train()(x, y)[1].item()
    assert first["train_loss"] == pytest.approx(imported_loss, rel=1e-6, abs=0)
    assert main(["train", recipe, "--train.out_dir", str(tmp_path / "scratch"), *args]) == 0  # without init_from
    scratch = json.loads((tmp_path / "scratch" / "metrics.jsonl").read_text().splitlines()[0])
    assert scratch["train_loss"] != pytest.approx(imported_loss, rel=1e-3)

    # the fine-tuned run resumes like any run (init_from kept); another model is refused by its keys
    assert main(["train", recipe, "--train.init_from", str(imp), "--train.out_dir", str(ft), *args,
                 "--train.max_steps", "3"]) == 0
    assert json.loads((ft / "summary.json").read_text())["resumed_from"] == 2
    capsys.readouterr()
    assert main(["train", recipe, "--train.init_from", str(imp), "--train.out_dir", str(tmp_path / "other"), *args,
                 "--model.n_steps", "3"]) == 2
    assert "holds a different model (its vs this run's: {'n_steps': (2, 3)})" in capsys.readouterr().err


def test_export_and_import_show_no_progress_bar_unless_verbose(tmp_path, capfd):
    """transformers draws "Writing model shards" / "Loading weights" bars; our commands turn them
    off (and restore the setting) unless --verbose is given."""
    from transformers.utils import logging as hf_logging

    hf_logging.enable_progress_bar()  # transformers' default, whatever an earlier test left
    bar = ("it/s]", "█", "Writing model shards", "Loading weights")
    run = make_run(tmp_path / "run", {"arch": "nrgpt"})
    assert main(["export", str(run), "--to", str(tmp_path / "hf")]) == 0
    assert main(["import-hf", str(tmp_path / "hf"), "--out", str(tmp_path / "back")]) == 0
    out = capfd.readouterr()
    assert not any(b in out.err + out.out for b in bar), out.err
    assert hf_logging.is_progress_bar_enabled()  # restored
    assert main(["export", str(run), "--to", str(tmp_path / "hf2"), "--verbose"]) == 0
    assert "Writing model shards" in capfd.readouterr().err


def test_generate_takes_n_steps_and_stop_tol_through_transformers(tmp_path):
    run, out = _export(tmp_path, {"arch": "nrgpt"})
    model, ours = AutoModelForCausalLM.from_pretrained(out), _ours(run)
    x = torch.tensor([[1, 2, 3, 4]])
    got = model.generate(x, max_new_tokens=5, do_sample=False, n_steps=6, stop_tol=1e-9)
    assert got.tolist() == ours.generate(x, 5, temperature=0, n_steps=6, stop_tol=1e-9).tolist()


def test_beam_search_works_by_recomputing(tmp_path):
    run, out = _export(tmp_path, {"arch": "nrgpt"})
    model, ours = AutoModelForCausalLM.from_pretrained(out), _ours(run)
    x = torch.tensor([[1, 2, 3, 4]])
    got = model.generate(x, max_new_tokens=1, do_sample=False, num_beams=3, num_return_sequences=3)
    with torch.no_grad():
        top = ours(x)[0][0, -1].topk(3).indices.tolist()
    assert got[:, -1].tolist() == top  # one step of beam search: the three most likely tokens, in order
    assert model.generate(x, max_new_tokens=4, num_beams=2, do_sample=False).shape == (1, 8)


@pytest.mark.parametrize("as_,spec", [("energyformer", {"arch": "nrgpt"}), ("gpt2", {"arch": "gpt", "bias": False})])
def test_newlines_survive_batch_decode_and_no_pad_warning(tmp_path, capfd, recwarn, as_, spec):
    """The pad token is never a real character (energyformer: a dedicated <pad> the model never embeds;
    stock: none), so skip_special_tokens keeps newlines; neither export nor load warns about a pad id."""
    text = "the cat\nsat on\n\na mat.\n"
    _, out = _export(tmp_path, spec, as_=as_)
    tok, model = AutoTokenizer.from_pretrained(out), AutoModelForCausalLM.from_pretrained(out)
    ids = tok([text, "a\n"], padding=as_ == "energyformer")["input_ids"]
    assert tok.batch_decode(ids, skip_special_tokens=True) == [text, "a\n"]
    pad = getattr(model.config, "pad_token_id", None)
    assert pad is None or pad < model.config.vocab_size
    if as_ != "energyformer":
        assert len(tok) == model.config.vocab_size
    err = capfd.readouterr().err
    assert "pad_token_id" not in err and not [w for w in recwarn if "pad" in str(w.message)], err


def test_sample_takes_n_steps_and_stop_tol(tmp_path, capsys):
    """`energyformer sample --n-steps/--stop-tol`: the text of our generate with those options."""
    run = make_run(tmp_path / "run", {"arch": "nrgpt"})
    tok = CharTokenizer(CHARS)
    want = tok.decode(_ours(run).generate(torch.tensor([tok.encode("the ")]), 12, temperature=0, n_steps=5,
                                          stop_tol=1e-9)[0].tolist())
    args = ["sample", str(run), "--prompt", "the ", "--max-new-tokens", "12", "--temperature", "0"]
    assert main([*args, "--n-steps", "5", "--stop-tol", "1e-9"]) == 0
    assert capsys.readouterr().out == want + "\n"
    gpt = make_run(tmp_path / "gpt", {"arch": "gpt"})
    assert main(["sample", str(gpt), "--n-steps", "3"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --n-steps is not an option of the 'gpt' model") and err.count("\n") == 1


def test_export_writes_a_model_card_with_config_data_params_losses(tmp_path):
    run = make_run(tmp_path / "run", {"arch": "nrgpt"})
    (run / "metrics.jsonl").write_text(json.dumps({"step": 10, "train_loss": 2.5}) + "\n"
                                       + json.dumps({"step": 20, "train_loss": 2.25, "val_loss": 2.375}) + "\n")
    out = export_run(run, tmp_path / "hf")
    card = (out / "README.md").read_text()
    n = sum(p.numel() for p in _ours(run).parameters())
    assert f"parameters: {n:,}" in card and "tokenizer `char` (73 ids)" in card
    assert "train loss: 2.2500 (step 20)" in card and "val loss: 2.3750 (step 20)" in card
    assert "arch: nrgpt" in card and "n_steps: 2" in card and "trust_remote_code=True" in card


def test_export_of_an_unfinished_run_warns_and_its_card_says_step_of_max_steps(tmp_path, recwarn):
    run = make_run(tmp_path / "run", {"arch": "gpt"})  # a committed checkpoint of step 1, no summary.json
    max_steps = load_run(run)[1].train.max_steps
    with pytest.warns(UserWarning, match=rf"^exporting an unfinished run: '.*run' at step 1 of {max_steps}, "
                                         r"unfinished \(no training running\); the model card says so$"):
        out = export_run(run, tmp_path / "hf")
    assert f"at step 1 of {max_steps}, unfinished (no training running) as `energyformer`." in \
        (out / "README.md").read_text()
    (run / "summary.json").write_text("{}")  # finished
    recwarn.clear()
    out = export_run(run, tmp_path / "hf2")
    assert not [w for w in recwarn if "unfinished" in str(w.message)]
    assert f"at step 1 of {max_steps} as `energyformer`." in (out / "README.md").read_text()

