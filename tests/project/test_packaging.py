"""The installable package (docs/install.md): the wheel holds every module and bundled recipe, and
a wheel installed in a fresh environment runs the CLI and trains (slow)."""
import email
import os
import shutil
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest

from energyformer.utils.bundled import find_recipe, recipes_dir

ROOT = Path(__file__).resolve().parents[2]
SOURCE_FILES = ("pyproject.toml", "setup.py", "README.md")


def _source_copy(dest: Path) -> Path:
    """The files the build reads, copied (the build writes build/ and *.egg-info beside them)."""
    dest.mkdir(parents=True)
    for name in SOURCE_FILES:
        shutil.copy2(ROOT / name, dest / name)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    shutil.copytree(ROOT / "energyformer", dest / "energyformer", ignore=ignore)  # with its zoo/
    shutil.copytree(ROOT / "configs", dest / "configs", ignore=ignore)
    return dest


def _build(tmp: Path, *kinds: str) -> Path:
    pytest.importorskip("build", reason="python -m build needs the `build` package (the dev extra)")
    src = _source_copy(tmp / "src")
    out = tmp / "dist"
    subprocess.run([sys.executable, "-m", "build", "--no-isolation", *kinds, "--outdir", str(out), str(src)],
                   check=True, capture_output=True, text=True, timeout=300)
    return out


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    return next(_build(tmp_path_factory.mktemp("wheel"), "--wheel").glob("*.whl"))


def test_one_version_everywhere(capsys):
    """pyproject.toml (the wheel's version), ``__version__`` (``--version``), the newest CHANGELOG
    heading and the build commands of docs/install.md name one version."""
    import re

    import energyformer
    from energyformer.cli import main

    project = re.search(r'^version = "([^"]+)"$', (ROOT / "pyproject.toml").read_text(), re.M).group(1)
    changelog = re.search(r"^## (\S+) - ", (ROOT / "CHANGELOG.md").read_text(), re.M).group(1)
    assert energyformer.__version__ == project == changelog == "0.3.0"
    assert main(["--version"]) == 0 and capsys.readouterr().out.strip() == f"energyformer {project}"
    install = (ROOT / "docs" / "install.md").read_text()
    assert set(re.findall(r"energyformer-(\d[\w.]*?)(?:\.tar\.gz|-py3)", install)) == {project}


def test_wheel_holds_every_module_recipe_and_the_entry_point(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    modules = {p.relative_to(ROOT).as_posix() for p in (ROOT / "energyformer").rglob("*.py")}
    assert modules - names == set()
    recipes = {"energyformer/" + p.relative_to(ROOT).as_posix() for p in (ROOT / "configs").rglob("*.yaml")}
    assert len(recipes) > 20 and recipes - names == set()
    zoo = {p.relative_to(ROOT).as_posix() for p in (ROOT / "energyformer" / "zoo").rglob("*") if p.is_file()}
    assert any(z.endswith("model.safetensors") for z in zoo) and zoo - names == set()  # the model zoo ships
    info = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    assert "energyformer = energyformer.cli:main" in zipfile.ZipFile(wheel).read(info).decode()
    meta = email.message_from_bytes(zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("/METADATA"))))
    import energyformer

    assert meta["Version"] == energyformer.__version__  # the wheel's version is --version's
    requires = meta.get_all("Requires-Dist")
    assert "torch>=2.4" in requires
    assert {"hf", "eval", "data", "viz", "wandb", "dev"} <= set(meta.get_all("Provides-Extra"))
    assert not any(n.startswith(("tests/", "configs/")) for n in names)  # only the package


def test_find_recipe_prefers_a_file_here_then_the_bundled_one(tmp_path, monkeypatch):
    root = recipes_dir()
    assert root is not None and (root / "shakespeare_char" / "gpt.yaml").is_file()
    monkeypatch.chdir(tmp_path)
    bundled = str(root / "shakespeare_char" / "gpt.yaml")
    for name in ("shakespeare_char/gpt.yaml", "configs/shakespeare_char/gpt.yaml", "shakespeare_char/gpt"):
        assert find_recipe(name) == bundled
    (tmp_path / "shakespeare_char").mkdir()
    (tmp_path / "shakespeare_char" / "gpt.yaml").write_text("model: {arch: gpt}\n")
    assert find_recipe("shakespeare_char/gpt.yaml") == "shakespeare_char/gpt.yaml"  # a local file wins
    assert find_recipe("no/such.yaml") == "no/such.yaml"  # unchanged: the caller's error names it


def _fresh_env(tmp: Path) -> Path:
    """A venv that sees this environment's installed packages (torch, ...) through a ``.pth`` file
    (a plain path line: the editable install's finder in there is not loaded) but not this checkout."""
    import site
    import sysconfig

    env_dir = tmp / "env"
    venv.EnvBuilder(with_pip=False).create(env_dir)
    python = env_dir / "bin" / "python"
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             check=True, capture_output=True, text=True).stdout.strip()
    parents = [p for p in {*site.getsitepackages(), sysconfig.get_paths()["purelib"]} if Path(p).is_dir()]
    (Path(purelib) / "parent_env.pth").write_text("".join(p + "\n" for p in parents))
    return python


@pytest.mark.slow
def test_built_wheel_and_sdist_install_and_train_in_a_fresh_environment(tmp_path):
    dist = _build(tmp_path)  # sdist, then the wheel built from the sdist
    assert len(list(dist.glob("*.tar.gz"))) == 1
    python = _fresh_env(tmp_path)
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps",
                    "--ignore-installed", "--no-index", "-q", str(next(dist.glob("*.whl")))],
                   check=True, timeout=300)
    work = tmp_path / "work"
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    cli = str(python.parent / "energyformer")

    def run(*args: str) -> str:
        done = subprocess.run(args, cwd=work, env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr
        return done.stdout

    where = run(str(python), "-c", "import energyformer; print(energyformer.__file__)")
    assert where.startswith(str(tmp_path / "env")), where  # the wheel's copy, not the checkout's
    assert "prepare" in run(cli, "--help")
    (work / "tiny.txt").write_text("the cat sat on the mat.\n" * 200)
    run(cli, "prepare", "text", "tiny.txt", "--out", "data/tiny")
    out = run(cli, "train", "shakespeare_char/gpt.yaml", "--data.data_dir", "data/tiny",
              "--train.max_steps", "3", "--train.out_dir", "out/tiny", "--train.device", "cpu",
              "--model.d_model", "32", "--model.n_layers", "1", "--model.block_size", "16",
              "--train.batch_size", "2", "--train.eval_interval", "3", "--train.eval_iters", "1",
              "--train.warmup_steps", "1", "--train.compile", "false")
    assert "done: 3 steps" in out
    assert (work / "out" / "tiny" / "config.yaml").is_file()
    # the model zoo works from the wheel, offline, outside any clone
    assert run(cli, "sample", "zoo:nrgpt_shakespeare_char", "--prompt", "ROMEO:", "--max-new-tokens", "10",
               "--device", "cpu").startswith("ROMEO:")
    assert "zoo:cem_t2_shakespeare_char" in run(cli, "zoo")
