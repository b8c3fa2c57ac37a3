"""Helpers with no energyformer dependencies (the bottom import level): atomic file writes (``io``),
devices (``device``) and small name → object registries (``registry``)."""
