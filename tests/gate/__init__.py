"""Tests of the gate (gate/): the CLI, expectations, reports, torchrun jobs, the GPU check script."""
