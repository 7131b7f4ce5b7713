"""Tests of the properties (properties/): each check against the specimens built to break it, and upstream."""
