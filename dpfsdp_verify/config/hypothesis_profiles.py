"""Hypothesis settings profiles for fuzzing DP-FSDP configurations: ``ci``, ``dev``, ``nightly``.

* ``ci`` -- deterministic (``derandomize=True``: the same examples on every run and every
  machine), 10 examples, no example database (nothing to share between CI runs, nothing written
  into the checkout), no deadline.
* ``dev`` (the default) -- random, 25 examples, failing examples saved to the database and
  replayed first next time.
* ``nightly`` -- random, 500 examples, database.

No profile has a deadline: an example's time is a distributed run whose first call on a fresh
worker group includes starting the ranks; the harness' watchdog bounds a hang, not hypothesis.

Choose a profile with the environment variable ``DPFSDP_HYPOTHESIS_PROFILE`` or the pytest option
``--dpfsdp-hypothesis-profile``. The profiles are registered with hypothesis as ``dpfsdp-ci``,
``dpfsdp-dev`` and ``dpfsdp-nightly`` (prefixed so they never clash with a project's own ``ci``).
``load_profile`` also makes the chosen one hypothesis' global default; ``profile_settings`` only
returns it (what the fuzz drivers use, so that merely importing this package changes nothing).

The database is a ``DirectoryBasedExampleDatabase`` in ``<root>/.hypothesis/dpfsdp-examples``:
``root`` is pytest's rootdir under the plugin, else ``DPFSDP_HYPOTHESIS_DB_ROOT``, else the current
directory. Hypothesis writes each example as its own file with an atomic rename, so several
``pytest -n`` workers can share it.

hypothesis is optional (``pip install hypothesis``, the ``fuzz`` extra): without it this module still
imports (the pytest plugin, loaded in every pytest session, registers the profiles through it),
``register_profiles`` does nothing, and asking for a profile raises ``ProfileError`` saying what to
install.
"""

from __future__ import annotations

import os
from typing import Any, Dict, Optional

#: hypothesis' names, or ``None`` each where it is not installed (hence ``Any``)
HealthCheck: Any
settings: Any
DirectoryBasedExampleDatabase: Any
try:
    from hypothesis import HealthCheck, settings
    from hypothesis.database import DirectoryBasedExampleDatabase
except ImportError as _e:  # the optional [fuzz] extra is not installed
    HealthCheck = settings = DirectoryBasedExampleDatabase = None
    MISSING: Optional[str] = (f"hypothesis is not importable ({type(_e).__name__}: {_e}); "
                              "pip install hypothesis (the 'fuzz' extra)")
else:
    MISSING = None

PROFILE_ENV = "DPFSDP_HYPOTHESIS_PROFILE"
DB_ROOT_ENV = "DPFSDP_HYPOTHESIS_DB_ROOT"
PROFILES = ("ci", "dev", "nightly")
DEFAULT_PROFILE = "dev"
PREFIX = "dpfsdp-"

#: examples are whole distributed runs: slow by hypothesis' standards, and strategies draw many
#: small integers; neither is a problem with the strategies
_SUPPRESSED = [HealthCheck.too_slow, HealthCheck.data_too_large] if HealthCheck is not None else []

_active: Optional[str] = None
_registered_root: Optional[str] = None


class ProfileError(ValueError):
    """An unknown profile name; the message lists the known ones."""


def database_path(root: Optional[str] = None) -> str:
    root = root or os.environ.get(DB_ROOT_ENV) or os.getcwd()
    return os.path.join(str(root), ".hypothesis", "dpfsdp-examples")


def register_profiles(root: Optional[str] = None) -> None:
    """Register ``dpfsdp-ci``, ``dpfsdp-dev`` and ``dpfsdp-nightly`` with hypothesis (idempotent;
    a new ``root`` re-registers them with a database there)."""
    global _registered_root
    if MISSING:
        return  # nothing to register with
    if root is None and _registered_root is not None:
        return  # keep the root the plugin (or an earlier caller) chose
    path = database_path(root)
    if _registered_root == path:
        return
    common: Dict[str, Any] = dict(deadline=None, print_blob=True, suppress_health_check=_SUPPRESSED)
    settings.register_profile(PREFIX + "ci", max_examples=10, derandomize=True, database=None, **common)
    db = DirectoryBasedExampleDatabase(path)
    settings.register_profile(PREFIX + "dev", max_examples=25, database=db, **common)
    settings.register_profile(PREFIX + "nightly", max_examples=500, database=db, **common)
    _registered_root = path


def resolve_name(name: Optional[str] = None) -> str:
    """The profile to use: ``name``, else the one ``load_profile`` loaded, else
    ``$DPFSDP_HYPOTHESIS_PROFILE``, else ``dev``. Raises ``ProfileError`` for an unknown name."""
    chosen = name or _active or os.environ.get(PROFILE_ENV) or DEFAULT_PROFILE
    chosen = chosen.strip()
    if chosen.startswith(PREFIX):
        chosen = chosen[len(PREFIX):]
    if chosen not in PROFILES:
        raise ProfileError(f"unknown hypothesis profile {chosen!r} (from {'argument' if name else PROFILE_ENV}); "
                           f"choose one of {', '.join(PROFILES)}")
    return chosen


def profile_settings(name: Optional[str] = None, root: Optional[str] = None) -> settings:
    """The ``settings`` object of a profile (see ``resolve_name``), without loading it globally."""
    if MISSING:
        raise ImportError(MISSING)
    register_profiles(root)
    return settings.get_profile(PREFIX + resolve_name(name))


def load_profile(name: Optional[str] = None, root: Optional[str] = None) -> str:
    """Make the profile hypothesis' global default (``settings.load_profile``) and the fuzz
    drivers' default; returns its short name."""
    global _active
    if MISSING:
        raise ProfileError(f"hypothesis profile {name or os.environ.get(PROFILE_ENV)!r} requested but {MISSING}")
    register_profiles(root)
    chosen = resolve_name(name)
    settings.load_profile(PREFIX + chosen)
    _active = chosen
    return chosen


def active_profile() -> Optional[str]:
    """The short name ``load_profile`` last loaded, or ``None``."""
    return _active


__all__ = ["register_profiles", "load_profile", "profile_settings", "resolve_name", "active_profile",
           "database_path", "ProfileError", "PROFILES", "DEFAULT_PROFILE", "PROFILE_ENV", "DB_ROOT_ENV",
           "PREFIX"]
