"""Properties, the sentences verdicts are made of, built from findings (no statistics here)."""
