"""Properties, pure analysis: statistics, fits and comparisons against the float64 reference, returning findings
(no sentences, no ranks started)."""
