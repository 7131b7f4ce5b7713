"""Tests of the target contract and its helpers (targets/)."""
