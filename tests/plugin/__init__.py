"""Tests of the pytest plugin (plugin/)."""
