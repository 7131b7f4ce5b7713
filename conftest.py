"""Repo-root conftest: makes ``fixtures`` importable and enables pytester for the plugin's tests.

The dpfsdp-verify pytest plugin itself is loaded through its ``pytest11`` entry point (it is
installed with the package), exactly as in a user's project.
"""

pytest_plugins = ["pytester"]
