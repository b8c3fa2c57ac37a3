"""Helpers with no energyformer dependencies (the bottom floor): atomic file writes (``io``),
devices (``device``) and small name → object registries (``registry``)."""
