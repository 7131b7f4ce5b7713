"""Tests of the harness (harness/): launch, watchdog, proofs, zygotes, wording."""
