"""``python -m energyformer ...`` runs the command-line interface (see ``energyformer.cli``)."""
from energyformer.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
