"""The package layout that pyproject.toml cannot state alone (metadata and extras: pyproject.toml).

The recipes under ``configs/`` ship inside the package as ``energyformer/configs/`` (a
directory mapping: the clone keeps them at the top, where the docs and experiments name them),
so ``energyformer train shakespeare_char/nrgpt.yaml`` works from an installed wheel
(:mod:`energyformer.utils.bundled`).
"""
from setuptools import find_namespace_packages, find_packages, setup

RECIPES = ["energyformer.configs", *(f"energyformer.configs.{p}" for p in find_namespace_packages(where="configs"))]

setup(packages=[*find_packages(include=["energyformer*"]), *RECIPES],
      package_dir={"energyformer.configs": "configs"},
      package_data={p: ["*.yaml"] for p in RECIPES})
