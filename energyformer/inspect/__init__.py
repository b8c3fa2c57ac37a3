"""Energy inspection (docs/architecture.md §4): per layer, step, term and token energies of a run,
``‖∇E‖``, ``‖Δx‖`` and ``cos(Δx, −∇E)``, as JSON and plots (``energyformer inspect``)."""
from .energy import energy_report, inspect_run, plot_report

__all__ = ["energy_report", "inspect_run", "plot_report"]
