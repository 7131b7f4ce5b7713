"""Properties, the checks: one module per property id, each defining ``PROPERTY``."""
