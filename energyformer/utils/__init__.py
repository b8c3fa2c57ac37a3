"""Helpers with no energyformer dependencies: atomic file writes (``io``) and devices (``device``)."""
