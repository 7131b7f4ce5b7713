"""Tests of loop and model features that cut across the properties: accumulation, resume, Poisson, sequences,
fine-tuning, precision, meshes."""
