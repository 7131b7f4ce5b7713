"""Tests of the fuzz drivers and strategies (fuzz/)."""
