"""The package layout that pyproject.toml cannot state alone (metadata and extras: pyproject.toml).

The recipes under ``configs/`` ship inside the package as ``energyformer/configs/`` (a
directory mapping: the clone keeps them at the top, where the docs and experiments name them),
so ``energyformer train shakespeare_char/nrgpt.yaml`` works from an installed wheel
(:mod:`energyformer.utils.bundled`). The model zoo's entries (``energyformer/zoo/NAME/``: config, meta,
weights, card) ship as package data of the namespace packages ``energyformer.zoo.*``
(:mod:`energyformer.runs.zoo`).
"""
from setuptools import find_namespace_packages, find_packages, setup

RECIPES = ["energyformer.configs", *(f"energyformer.configs.{p}" for p in find_namespace_packages(where="configs"))]

ZOO = ["energyformer.zoo", *(f"energyformer.zoo.{p}" for p in find_namespace_packages(where="energyformer/zoo"))]
ZOO_FILES = ["*.json", "*.yaml", "*.md", "*.safetensors"]

setup(packages=[*find_packages(include=["energyformer*"]), *RECIPES, *ZOO],
      package_dir={"energyformer.configs": "configs"},
      package_data={**{p: ["*.yaml"] for p in RECIPES}, **{p: ZOO_FILES for p in ZOO}})
