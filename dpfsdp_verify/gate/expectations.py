"""Known failures, checked in: ``dpfsdp-verify run --expect FILE``.

A fork's CI must be able to say "these failures are known; anything else is news". An
expectations file (TOML) lists failures by property, a subset of config keys, status and
diagnosis, each with a reason. Against a run's verdicts (``apply``):

* a failing verdict (``fail``/``hang``/``error``) that an entry lists is *expected*: its status
  stays what it was, reports mark it (JSON ``"expected": true``, JUnit ``skipped`` of type
  ``expected_failure``, ``xfail`` in the tables);
* a failing verdict no entry lists is *unexpected* -> exit 1;
* an entry is *strict*, like pytest's ``xfail(strict=True)``: every non-skipped verdict it selects
  (same property, config keys equal) must fail with its status and diagnosis. If one passes (or
  fails differently) the entry *no longer holds* -> exit 1, so the file cannot rot;
* an entry that selects no verdict of this run (its property or world size was not selected) is
  *not exercised*: reported, not an error, so a narrowed run can use the same file;
* an entry with a ``when`` condition (torch / opacus version ranges, backend, device type) that
  the run's environment does not meet is *not applicable*: it expects nothing and cannot "no
  longer hold" (a bug that only some torch releases show is listed for those).

``internal_error`` (a bug in the suite) can never be expected.

File format (``version = 1``)::

    version = 1
    description = "known failures of upstream opacus 1.6.0 (ghost_fsdp)"   # optional

    [[expect]]
    property = "PROPERTY_ID"               # a property id (dpfsdp-verify list)
    config = { world_size = 2, reduction = "sum" }   # keys of the verdict's config to match;
                                           # a list means any of: world_size = [2, 3]; a
                                           # comparison matches numbers: world_size = ">= 2"
    status = "fail"                        # optional: fail (default), hang or error; a list means
                                           # any of (a divergence gloo aborts on one machine and
                                           # stalls on another: ["error", "hang"])
    diagnosis = "mismatch"                 # required: the verdict's diagnosis; a list means any
                                           # of (one bug whose symptom depends on the draws)
    reason = "why it fails, who owns it"   # required
    link = "https://..."                   # optional
    when = { torch = ">= 2.13", opacus = ">= 1.6, < 1.7", backend = "gloo", device = "cpu" }
                                           # (and transformers = ">= 5.0" for the real architectures)
                                           # optional: the environments the entry holds in (every
                                           # key given must match; versions: comma-separated
                                           # clauses, release numbers compared; a list = any of)

``--expect`` takes a path, or the name of a file bundled with the package
(``dpfsdp_verify/properties/known_failures/NAME.toml``, e.g. ``--expect opacus-1.6.0``; they live
beside the properties because they name them).

The same format is written here too: ``baseline`` (``dpfsdp-verify run --write-expect FILE``) lists
a run's failures, one entry per cause, as a file that ``--expect FILE`` accepts exactly.
"""

from __future__ import annotations

import json
import operator
import os
import re
import sys
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

from ..errors import HintedError
from .causes import Cause
from ..verdict import CONFIG_KEYS, DIAGNOSES, FAILING, INTERNAL_ERROR, Verdict, config_label

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised only on Python 3.10 (tomli is a dependency there)
    import tomli as tomllib

FORMAT_VERSION = 1
BUNDLED_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "properties", "known_failures")
EXPECTABLE_STATUSES = ("fail", "hang", "error")
_TOP_KEYS = ("version", "description", "expect")
_ENTRY_KEYS = ("property", "config", "status", "diagnosis", "reason", "link", "when")
#: ``when`` keys: version ranges of the packages, and the run's backend / device type
_WHEN_VERSIONS = ("torch", "opacus", "transformers")
_WHEN_CHOICES = {"backend": ("gloo", "nccl"), "device": ("cpu", "cuda")}
_WHEN_KEYS = _WHEN_VERSIONS + tuple(_WHEN_CHOICES)
_SCALARS = (str, int, float, bool)


class ExpectationsError(HintedError):
    """The expectations file cannot be used; the message is one line, ``hint`` says what to do."""


def bundled() -> Dict[str, str]:
    """``{name: path}`` of the expectation files shipped with the package."""
    if not os.path.isdir(BUNDLED_DIR):
        return {}
    return {f[:-5]: os.path.join(BUNDLED_DIR, f) for f in sorted(os.listdir(BUNDLED_DIR)) if f.endswith(".toml")}


def resolve(ref: str) -> str:
    """The file ``--expect REF`` names: an existing path, else a bundled name."""
    if os.path.isfile(ref):
        return ref
    shipped = bundled()
    name = ref[:-5] if ref.endswith(".toml") else ref
    if os.sep not in ref and name in shipped:
        return shipped[name]
    raise ExpectationsError(f"--expect {ref}: no such file", "give a path to a TOML expectations file, or a bundled "
                            f"name: {', '.join(shipped) or '(none)'}")


def _fmt(v: Any) -> str:
    if isinstance(v, list):
        return "[" + ",".join(_fmt(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ",".join(f"{k}={_fmt(x)}" for k, x in v.items()) + "}"
    return str(v)


#: a comparison a config value may be matched with instead of equality: ``">= 2"``, ``"> 1"``,
#: ``"< 8"``, ``"<= 4"``, ``"!= 3"`` (an operator, a number); it matches numbers only
_COMPARISON = re.compile(r"^\s*(>=|<=|!=|>|<)\s*(-?\d+(?:\.\d+)?)\s*$")
_COMPARE = {">=": operator.ge, "<=": operator.le, "!=": operator.ne, ">": operator.gt, "<": operator.lt}


#: one clause of a version range: an operator and a release (``>= 2.13``, ``< 2.15.1``, ``== 2.11``)
_VERSION_CLAUSE = re.compile(r"^\s*(>=|<=|==|!=|>|<)\s*(\d+(?:\.\d+)*)\s*$")
_VERSION_COMPARE = {**_COMPARE, "==": operator.eq}


def release(version: str) -> Optional[tuple]:
    """The release numbers of a version string as a tuple of ints (``"2.11.0+cu130"`` -> ``(2, 11, 0)``,
    ``"2.13.0a0+git1"`` -> ``(2, 13, 0)``: local and pre-release parts are ignored); ``None`` if it
    has none."""
    m = re.match(r"\s*v?(\d+(?:\.\d+)*)", version or "")
    return tuple(int(x) for x in m.group(1).split(".")) if m else None


def _version_clauses(text: str):
    """``[(operator, release)]`` of a version range (``">= 2.13, < 2.15"``); ``None`` if malformed."""
    clauses = []
    for part in text.split(","):
        m = _VERSION_CLAUSE.match(part)
        if m is None:
            return None
        clauses.append((_VERSION_COMPARE[m.group(1)], release(m.group(2))))
    return clauses


def version_in_range(version: Optional[str], text: str) -> bool:
    """Whether ``version`` meets every clause of the range ``text``, on release numbers padded with
    zeros (``2.13`` == ``2.13.0``); an absent version (package not installed) meets none."""
    got = release(version) if version else None
    if got is None:
        return False
    for op, want in _version_clauses(text) or ():
        n = max(len(got), len(want))
        if not op(got + (0,) * (n - len(got)), want + (0,) * (n - len(want))):
            return False
    return True


def _comparison(want: Any):
    """``(operator, number)`` when ``want`` is a comparison string, else ``None``."""
    m = _COMPARISON.match(want) if isinstance(want, str) else None
    return None if m is None else (_COMPARE[m.group(1)], float(m.group(2)))


def _matches(want: Any, got: Any) -> bool:
    compare = _comparison(want)
    if compare is not None:
        # a world size is a number: a comparison never matches a string or a boolean
        return isinstance(got, (int, float)) and not isinstance(got, bool) and compare[0](got, compare[1])
    if isinstance(want, list):
        return any(_matches(w, got) for w in want)
    if isinstance(want, dict):
        return isinstance(got, dict) and all(k in got and _matches(w, got[k]) for k, w in want.items())
    if isinstance(want, bool) or isinstance(got, bool):
        return want is got
    return want == got


@dataclass(frozen=True)
class Entry:
    """One known failure (one ``[[expect]]`` table)."""

    index: int  # 1-based position in the file
    property: str
    config: Dict[str, Any]
    #: a diagnosis, or a list of them (any of)
    diagnosis: Any
    reason: str
    #: a status, or a list of them (any of)
    status: Any = "fail"
    link: str = ""
    #: the environments the entry holds in (``when``; empty: every one)
    when: Dict[str, Any] = field(default_factory=dict)

    def applies(self, env: Dict[str, Optional[str]]) -> bool:
        """Whether the run's environment ``env`` (``environment()``) meets ``when``."""
        return not self.unmet_conditions(env)

    def unmet_conditions(self, env: Dict[str, Optional[str]]) -> List[str]:
        """The ``when`` conditions ``env`` does not meet, as ``"torch 2.11.0 is not >= 2.13"``."""
        out = []
        for key, want in self.when.items():
            got = env.get(key)
            wants = want if isinstance(want, list) else [want]
            ok = (any(version_in_range(got, w) for w in wants) if key in _WHEN_VERSIONS else got in wants)
            if not ok:
                out.append(f"{key} {got or '(none)'} is not {' or '.join(wants)}")
        return out

    def label(self) -> str:
        cfg = " ".join(f"{k}={_fmt(v)}" for k, v in self.config.items())
        head = f"#{self.index} {self.property}" + (f" {cfg}" if cfg else "")
        return head + f": {_fmt(self.status)} ({_fmt(self.diagnosis)})"

    def describe_reason(self) -> str:
        return self.reason + (f" ({self.link})" if self.link else "")

    def selects(self, v: Verdict) -> bool:
        """Same property and every listed config key equal (a verdict without the key: no)."""
        return v.property == self.property and all(k in v.config and _matches(w, v.config[k])
                                                   for k, w in self.config.items())

    def covers(self, v: Verdict) -> bool:
        """``selects`` and failed exactly as listed."""
        return self.selects(v) and _matches(self.status, v.status) and _matches(self.diagnosis, v.diagnosis)

    def to_json(self) -> Dict[str, Any]:
        d = {"index": self.index, "property": self.property, "config": dict(self.config), "status": self.status,
             "diagnosis": self.diagnosis, "reason": self.reason}
        if self.link:
            d["link"] = self.link
        if self.when:
            d["when"] = dict(self.when)
        return d


@dataclass
class Expectations:
    file: str
    entries: List[Entry]
    description: str = ""


def _check_value(where: str, key: str, v: Any, depth: int = 0) -> None:
    if isinstance(v, str) and v.strip()[:1] in ("<", ">", "=", "!") and _comparison(v) is None:
        raise ExpectationsError(f"{where}: config.{key} = {v!r} is not a comparison",
                                "write an operator (>=, >, <=, <, !=) and a number, e.g. world_size = \">= 2\"")
    if isinstance(v, _SCALARS):
        return
    if isinstance(v, list) and v and depth == 0 and all(isinstance(x, _SCALARS + (dict,)) for x in v):
        for x in v:
            _check_value(where, key, x, depth + 1)
        return
    if isinstance(v, dict) and v and depth <= 1:
        for k, x in v.items():
            _check_value(where, f"{key}.{k}", x, depth + 1)
        return
    raise ExpectationsError(f"{where}: config.{key} = {v!r} is not a value to match",
                            "use a string, number or boolean, or a non-empty list of them (any of)")


def parse(text: str, file: str = "<expectations>", properties: Optional[Sequence[str]] = None) -> Expectations:
    """Check and parse an expectations file's text. Raises ``ExpectationsError`` (one line)."""
    if properties is None:
        from ..properties import PROPERTIES

        properties = list(PROPERTIES)
    name = os.path.basename(file)
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ExpectationsError(f"{name}: not valid TOML: {e}",
                                "see the format in docs/gate.md (Expectations)") from None
    unknown = [k for k in data if k not in _TOP_KEYS]
    if unknown:
        raise ExpectationsError(f"{name}: unknown top-level key {', '.join(map(repr, unknown))}",
                                f"allowed: {', '.join(_TOP_KEYS)}")
    if data.get("version") != FORMAT_VERSION:
        raise ExpectationsError(f"{name}: version = {data.get('version')!r}; this dpfsdp-verify reads version "
                                f"{FORMAT_VERSION}", f"put 'version = {FORMAT_VERSION}' at the top of the file")
    raw = data.get("expect", [])
    if not isinstance(raw, list) or not all(isinstance(e, dict) for e in raw):
        raise ExpectationsError(f"{name}: 'expect' must be an array of tables", "write each entry as [[expect]]")
    entries = [_parse_entry(f"{name}: [[expect]] #{i}", i, e, properties) for i, e in enumerate(raw, start=1)]
    description = data.get("description", "")
    if not isinstance(description, str):
        raise ExpectationsError(f"{name}: 'description' must be a string", "or leave it out")
    return Expectations(file, entries, description)


def _parse_entry(where: str, i: int, e: dict, properties: Sequence[str]) -> Entry:
    """Check and parse one ``[[expect]]`` table (the ``i``-th). Raises ``ExpectationsError``."""
    bad = [k for k in e if k not in _ENTRY_KEYS]
    if bad:
        raise ExpectationsError(f"{where}: unknown key {', '.join(map(repr, bad))}",
                                f"allowed: {', '.join(_ENTRY_KEYS)}")
    for k in ("property", "diagnosis", "reason"):
        if k == "diagnosis" and isinstance(e.get(k), list) and e[k]:
            continue
        if not isinstance(e.get(k), str) or not e[k].strip():
            raise ExpectationsError(f"{where}: '{k}' is missing or not a non-empty string",
                                    "every entry needs property, diagnosis and reason")
    if e["property"] not in properties:
        raise ExpectationsError(f"{where}: unknown property {e['property']!r}",
                                f"choose from {', '.join(properties)}")
    status = e.get("status", "fail")
    for one in (status if isinstance(status, list) and status else [status]):
        if one not in EXPECTABLE_STATUSES:
            raise ExpectationsError(f"{where}: status {one!r} cannot be expected",
                                    f"choose from {', '.join(EXPECTABLE_STATUSES)} (or a list of them)")
    for diagnosis in (e["diagnosis"] if isinstance(e["diagnosis"], list) else [e["diagnosis"]]):
        if diagnosis == INTERNAL_ERROR:
            raise ExpectationsError(f"{where}: diagnosis 'internal_error' is a bug in dpfsdp-verify and cannot be "
                                    "expected", "report it instead")
        if diagnosis not in DIAGNOSES:
            raise ExpectationsError(f"{where}: unknown diagnosis {diagnosis!r}",
                                    f"choose from {', '.join(d for d in DIAGNOSES if d != INTERNAL_ERROR)}")
    config = e.get("config", {})
    if not isinstance(config, dict):
        raise ExpectationsError(f"{where}: 'config' must be a table", "e.g. config = { world_size = 2 }")
    unknown_keys = [k for k in config if k not in CONFIG_KEYS]
    if unknown_keys:
        raise ExpectationsError(f"{where}: unknown config key {', '.join(map(repr, unknown_keys))}",
                                f"choose from {', '.join(CONFIG_KEYS)}")
    for k, v in config.items():
        _check_value(where, k, v)
    link = e.get("link", "")
    if not isinstance(link, str):
        raise ExpectationsError(f"{where}: 'link' must be a string", "e.g. link = \"https://...\"")
    return Entry(i, e["property"], dict(config), e["diagnosis"], e["reason"].strip(), status, link,
                 _parse_when(where, e.get("when", {})))


def _parse_when(where: str, when: Any) -> Dict[str, Any]:
    """Check ``when``: a table of ``torch`` / ``opacus`` version ranges and ``backend`` / ``device``
    choices, each a string or a non-empty list of them (any of). Raises ``ExpectationsError``."""
    example = 'e.g. when = { torch = ">= 2.13", backend = "gloo" }'
    if not isinstance(when, dict):
        raise ExpectationsError(f"{where}: 'when' must be a table", example)
    for key, want in when.items():
        if key not in _WHEN_KEYS:
            raise ExpectationsError(f"{where}: unknown when key {key!r}", f"choose from {', '.join(_WHEN_KEYS)}")
        wants = want if isinstance(want, list) and want else [want]
        for w in wants:
            if not isinstance(w, str):
                raise ExpectationsError(f"{where}: when.{key} = {want!r} is not a string or a list of strings", example)
            if key in _WHEN_VERSIONS and _version_clauses(w) is None:
                raise ExpectationsError(f"{where}: when.{key} = {w!r} is not a version range",
                                        f"comma-separated clauses of an operator (>=, >, <=, <, ==, !=) and a release, "
                                        f"e.g. {key} = \">= 2.13, < 2.15\"")
            if key in _WHEN_CHOICES and w not in _WHEN_CHOICES[key]:
                raise ExpectationsError(f"{where}: when.{key} = {w!r} is not one of {', '.join(_WHEN_CHOICES[key])}",
                                        example)
    return dict(when)


def environment(backend: str = "gloo") -> Dict[str, Optional[str]]:
    """What ``when`` is matched against: the torch version (the imported torch's ``__version__``,
    else the installed distribution's; nothing is imported), the opacus one (the imported opacus',
    else the importable one's), the installed transformers distribution's (the real architectures;
    ``None`` without it), the run's backend and the device type its ranks compute on
    (``harness.backends``: cpu under gloo, cuda under nccl)."""
    from importlib import metadata

    from ..harness.backends import BACKENDS
    from .target_info import opacus_info

    torch = sys.modules.get("torch")
    torch_version = getattr(torch, "__version__", None)
    if torch_version is None:
        try:
            torch_version = metadata.version("torch")
        except metadata.PackageNotFoundError:
            torch_version = None
    opacus = opacus_info() or {}
    device = BACKENDS[backend].device_type if backend in BACKENDS else None
    try:
        transformers_version: Optional[str] = metadata.version("transformers")
    except metadata.PackageNotFoundError:
        transformers_version = None
    return {"torch": str(torch_version) if torch_version else None, "opacus": opacus.get("version"),
            "transformers": transformers_version, "backend": backend, "device": device}


def load(ref: str, properties: Optional[Sequence[str]] = None) -> Expectations:
    """``resolve`` + read + ``parse``. Raises ``ExpectationsError``."""
    path = resolve(ref)
    try:
        with open(path, "rb") as f:
            text = f.read().decode("utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ExpectationsError(f"--expect {ref}: cannot read it: {e}", "give a readable UTF-8 TOML file") from None
    return parse(text, path, properties)


@dataclass
class Unmet:
    """An entry that selected verdicts which did not fail as it says."""

    entry: Entry
    verdicts: List[Verdict]
    message: str


@dataclass
class Outcome:
    """A run's verdicts judged against an expectations file."""

    file: str
    entries: List[Entry]
    expected: Dict[int, Entry] = field(default_factory=dict)  # id(verdict) -> the entry listing it
    unexpected: List[Verdict] = field(default_factory=list)
    unmet: List[Unmet] = field(default_factory=list)
    not_exercised: List[Entry] = field(default_factory=list)
    #: entries whose ``when`` this run's environment does not meet, each with the conditions unmet
    not_applicable: List[Tuple[Entry, List[str]]] = field(default_factory=list)
    #: the environment ``when`` was matched against (``environment()``)
    environment: Dict[str, Optional[str]] = field(default_factory=dict)

    def entry_for(self, v: Verdict) -> Optional[Entry]:
        return self.expected.get(id(v))

    def is_expected(self, v: Verdict) -> bool:
        return id(v) in self.expected

    @property
    def holds(self) -> bool:
        """No unexpected failure and every exercised entry still holds."""
        return not self.unexpected and not self.unmet

    def to_json(self) -> Dict[str, Any]:

        return {
            "file": self.file,
            "entries": len(self.entries),
            "expected_failures": len(self.expected),
            "unexpected_failures": len(self.unexpected),
            "unmet": [{"entry": u.entry.to_json(), "message": u.message,
                       "verdicts": [{"property": v.property, "label": config_label(v.config), "status": v.status,
                                     "diagnosis": v.diagnosis} for v in u.verdicts]} for u in self.unmet],
            "not_exercised": [e.to_json() for e in self.not_exercised],
            "not_applicable": [{"entry": e.to_json(), "unmet": unmet} for e, unmet in self.not_applicable],
            "environment": dict(self.environment),
        }


def apply(exp: Expectations, verdicts: Sequence[Verdict], env: Optional[Dict[str, Optional[str]]] = None) -> Outcome:
    """Judge ``verdicts`` against ``exp`` (see the module docstring) in the environment ``env``
    (default: ``environment()``, the gloo backend's)."""

    env = environment() if env is None else env
    out = Outcome(exp.file, list(exp.entries), environment=dict(env))
    entries = []
    for e in exp.entries:
        unmet = e.unmet_conditions(env)
        if unmet:
            out.not_applicable.append((e, unmet))
        else:
            entries.append(e)
    for v in verdicts:
        if v.status not in FAILING:
            continue
        entry = None if v.diagnosis == INTERNAL_ERROR else next((e for e in entries if e.covers(v)), None)
        if entry is None:
            out.unexpected.append(v)
        else:
            out.expected[id(v)] = entry
    for e in entries:
        selected = [v for v in verdicts if e.selects(v) and v.status != "skip"]
        if not selected:
            out.not_exercised.append(e)
            continue
        other = [v for v in selected if not e.covers(v)]
        if other:
            what = "; ".join(f"{v.label} "
                             + ("passed" if v.status == "pass" else f"{v.status} ({v.diagnosis})") for v in other)
            out.unmet.append(Unmet(e, other, f"expectation {e.label()} no longer holds: {what}. Remove or narrow the "
                                             f"entry in {os.path.basename(exp.file)}"))
    return out


# -- the file written: a baseline (``dpfsdp-verify run --write-expect FILE``) ------------------------------

#: config keys never written: one value per run, and matching them would only narrow the entry
SKIP_KEYS = ("grad_sample_mode",)


def _constraint(key: str, group: Sequence[Verdict], others: Sequence[Verdict]) -> Optional[Any]:
    """What ``key`` must match for the verdicts of ``group`` (``None``: not every one has a value)."""
    values: List[Any] = []
    for v in group:
        x = v.config.get(key)
        if x is None:
            return None
        if x not in values:
            values.append(x)
    if key == "world_size" and all(isinstance(x, int) and not isinstance(x, bool) for x in values):
        low = min(values)
        if all(o.config.get(key) in values for o in others if isinstance(o.config.get(key), int)
               and o.config[key] >= low):
            return f">= {low}"
    return values[0] if len(values) == 1 else sorted(values, key=str)


def generalise(group: Sequence[Verdict], others: Sequence[Verdict]) -> Optional[Dict[str, Any]]:
    """The smallest ``config`` (greedy) that selects every verdict of ``group`` and none of ``others``
    (the same property's other non-skipped verdicts); ``None`` when the keys cannot tell them apart."""
    config: Dict[str, Any] = {}
    left = list(others)
    keys = [k for k in dict.fromkeys(k for v in group for k in v.config) if k not in SKIP_KEYS]
    while left:
        best, best_out = None, 0
        for k in keys:
            want = None if k in config else _constraint(k, group, left)
            if want is None:
                continue
            out = sum(1 for o in left if k not in o.config or not _matches(want, o.config[k]))
            if out > best_out:
                best, best_out = (k, want), out
        if best is None:
            return None
        config[best[0]] = best[1]
        left = [o for o in left if best[0] in o.config and _matches(best[1], o.config[best[0]])]
    return config


def when(env: Dict[str, Optional[str]]) -> Dict[str, str]:
    """The environment an entry was seen in: this opacus release, this torch minor series, backend."""
    out: Dict[str, str] = {}
    if env.get("opacus") and release(env["opacus"] or ""):
        out["opacus"] = "== " + ".".join(map(str, release(env["opacus"] or "") or ()))
    torch = release(env.get("torch") or "")
    if torch and len(torch) >= 2:
        out["torch"] = f">= {torch[0]}.{torch[1]}, < {torch[0]}.{torch[1] + 1}"
    if env.get("backend"):
        out["backend"] = str(env["backend"])
    return out


def baseline_failures(verdicts: Sequence[Verdict]) -> List[Verdict]:
    """The failures a baseline lists: every failing verdict but a bug in the suite."""
    return [v for v in verdicts if v.status in FAILING and v.diagnosis != INTERNAL_ERROR]


def entries(verdicts: Sequence[Verdict], env: Dict[str, Optional[str]], found: Sequence[Cause],
            exact: bool = False) -> List[Dict[str, Any]]:
    """The ``[[expect]]`` tables of the failures of ``verdicts``, grouped by cause as ``found``
    (``causes.group(baseline_failures(verdicts))``); ``exact``: every entry with a verdict's whole
    configuration (the baseline's text, below)."""
    stamp = when(env)
    out = []
    for cause in found:
        reason = cause.reason
        for prop in cause.properties:
            group = [v for v in cause.verdicts if v.property == prop]
            others = [v for v in verdicts if v.property == prop and v.status != "skip" and v not in group]
            config = None if exact else generalise(group, others)
            configs = [config] if config is not None else [
                {k: x for k, x in v.config.items() if x is not None and k not in SKIP_KEYS} for v in group]
            statuses = sorted({v.status for v in group})
            for cfg in configs:
                out.append({"property": prop, "config": cfg, "status": statuses[0] if len(statuses) == 1
                            else statuses, "diagnosis": group[0].diagnosis, "reason": reason,
                            "when": dict(stamp)})
    return out


def _toml_value(x: Any) -> str:
    if isinstance(x, bool):
        return "true" if x else "false"
    if isinstance(x, (int, float)):
        return repr(x)
    if isinstance(x, list):
        return "[" + ", ".join(_toml_value(y) for y in x) + "]"
    if isinstance(x, dict):
        return "{ " + ", ".join(f"{k} = {_toml_value(y)}" for k, y in x.items()) + " }"
    # a JSON string is a TOML basic string, but for JSON's surrogate-pair escapes of characters
    # beyond the BMP, which TOML refuses: those are written as themselves
    return json.dumps(str(x), ensure_ascii=False)


def to_toml(tables: Sequence[Dict[str, Any]], description: str) -> str:
    lines = [f"version = {FORMAT_VERSION}", f"description = {_toml_value(description)}", ""]
    for t in tables:
        lines.append("[[expect]]")
        lines += [f"{k} = {_toml_value(x)}" for k, x in t.items()]
        lines.append("")
    return "\n".join(lines)


def baseline(verdicts: Sequence[Verdict], env: Dict[str, Optional[str]], description: str,
             found: Sequence[Cause]) -> str:
    """``--write-expect FILE``'s text: the run's failures as an expectations file that a following
    ``--expect FILE`` run accepts exactly (mypy's and ruff's baselines, phpstan's
    ``--generate-baseline``). One entry per cause (``found``: ``causes.group`` of
    ``baseline_failures``) and property: its ``config`` generalised as
    far as the run's verdicts allow -- a key is left out when the entry selects no verdict that did
    not fail this way without it; a world size from which every verdict failed is ``">= N"`` -- its
    ``reason`` the cause in words, its ``when`` the environment (the opacus release, the torch minor
    series, the backend). The text is parsed and judged against ``verdicts`` (``apply``): it must
    hold, or each cause falls back to one entry per verdict with its whole configuration."""
    text = to_toml(entries(verdicts, env, found), description)
    if not apply(parse(text), verdicts, env).holds:  # a generalisation too wide: list every verdict
        text = to_toml(entries(verdicts, env, found, exact=True), description)
    return text


__all__ = ["FORMAT_VERSION", "BUNDLED_DIR", "EXPECTABLE_STATUSES", "ExpectationsError", "bundled", "resolve", "Entry",
           "Expectations", "parse", "load", "Unmet", "Outcome", "apply", "environment", "release", "version_in_range",
           "SKIP_KEYS", "generalise", "when", "baseline_failures", "entries", "to_toml", "baseline"]
