"""The configuration space (``dpfsdp_verify.config.space``): axes that validate themselves, the
combination rules (checked against ``RunSpec``'s own), seeds derived by name, and every default
and seed defined once (a grep of the package for strays)."""

import ast
import pathlib
import random
import re

import pytest

from dpfsdp_verify.config import defaults, space
from dpfsdp_verify.config.space import AXES, combination_problem, seed_for

PKG = pathlib.Path(space.__file__).parent.parent  # the package (space is in config/)
ROOT = PKG.parent


def test_seed_for_is_stable_distinct_and_follows_the_run_seed():
    # pinned: a stable hash (blake2b), never Python's salted hash(): the same on every machine and run
    assert seed_for(0, "noise_calibration", "fresh_job", 2) == 2051836852
    names = [("noise_calibration", "fresh_job", ws) for ws in range(1, 9)] + [
        ("trajectory", "noisy_update", ws) for ws in range(1, 9)] + [("checkpoint_resume", "noise_run", 2)]
    seeds = {seed_for(7, *n) for n in names}
    assert len(seeds) == len(names), "every named stream its own seed"
    assert all(0 <= s < space.SEED_MODULUS for s in seeds)
    assert seed_for(7, "a", 1) != seed_for(8, "a", 1)
    assert seed_for(7, "a", 1) != seed_for(7, "a", "1")  # names are typed: 1 and "1" are different streams
    assert space.adjacent(space.SEED_MODULUS - 1, 1) == 0
    with pytest.raises(ValueError, match="run seed must be an int"):
        seed_for("7", "a")


def test_axes_validate_themselves():
    assert AXES["world_size"].check(0) == "world_size 0: must be in 1..16"
    assert AXES["physical_batch_size"].check(0) is None  # 0: none
    assert "must be in (0, 1]" in AXES["sample_rate"].check(0.0)
    assert "choose from fp32,bf16-fsdp,bf16-autocast" in AXES["precision"].check("fp16")
    assert AXES["steps"].check(True) == "steps True: must be an integer"
    with pytest.raises(ValueError, match="lr 1.5: must be in"):
        AXES["lr"].validate(1.5)
    with pytest.raises(KeyError, match="no axis 'nope'"):
        space.axis("nope")
    assert "precision bf16-fsdp is bf16 compute over float32" in combination_problem(precision="bf16-fsdp",
                                                                                     dtype="float64")
    for a in AXES.values():  # every explore range lies inside its axis
        ex = getattr(a, "explore", None)
        if isinstance(a, space.Choice):
            assert all(a.check(v) is None for v in ex)
        elif ex:
            assert a.check(ex[0]) is None and a.check(ex[1]) is None, a.name


def test_the_space_names_what_the_package_runs():
    from dpfsdp_verify import models
    from dpfsdp_verify.targets import base

    assert space.MODELS == models.MODEL_NAMES
    assert set(space.EXPLORE_MODELS) <= set(models.MODEL_DIMS)
    assert base.PRECISIONS == AXES["precision"].values and base.SEEDINGS == AXES["seeding"].values
    spec = base.RunSpec()
    assert {k: getattr(spec, k) for k in defaults.SPEC_DEFAULTS} == defaults.SPEC_DEFAULTS


def test_combination_rules_agree_with_runspec():
    """``combination_problem`` and ``RunSpec.__post_init__`` accept and refuse the same points."""
    from dpfsdp_verify.targets.base import RunSpec

    rng = random.Random(5)
    seen = {True: 0, False: 0}
    for _ in range(400):
        c = dict(world_size=rng.randint(1, 4), dtype=rng.choice(("float64", "float32")),
                 precision=rng.choice(AXES["precision"].values), sampling=rng.choice(("fixed", "poisson")),
                 sample_rate=rng.choice((0.01, 0.1, 0.25, 1.0)), samples_per_rank=rng.randint(1, 8),
                 physical_batch_size=rng.choice((0, 0, 2)), resume_at=rng.choice((0, 0, 1, 3)), steps=rng.randint(1, 4))
        problem = combination_problem(**c)
        fields = dict(dtype=c["dtype"], precision=c["precision"], sampling=c["sampling"], steps=c["steps"],
                      physical_batch_size=c["physical_batch_size"], resume_at=c["resume_at"])
        if c["resume_at"]:
            fields.update(phase="save", checkpoint_dir="x")
        if c["sampling"] == "poisson":
            fields.update(sample_rate=c["sample_rate"], dataset_size=c["samples_per_rank"] * c["world_size"],
                          epochs=c["steps"])
        try:
            RunSpec(**fields)
            ok = True
        except ValueError:
            ok = False
        assert ok == (problem is None), (c, problem)
        seen[ok] += 1
    assert seen[True] > 50 and seen[False] > 50


# -- every default and seed defined once --------------------------------------------------------
#: the defaults only defaults.py may assign (a module may re-export one by importing it)
DEFAULT_NAMES = ("DEFAULT_GRAD_SAMPLE_MODE", "POISSON_DEFAULTS", "DEFAULT_WORLD_SIZES", "MAX_GLOO_WORLD_SIZE",
                 "DEFAULT_TIMEOUT_S", "WIDE_WORLD_SIZE", "HORIZON_STEPS", "HORIZON_SAMPLE_RATE",
                 "HORIZON_SAMPLES_PER_RANK", "DEFAULT_EXPLORE_S")
#: a seed picked by arithmetic on a literal or another seed: ``point.seed(4242 + ws)``, ``noise_seed=base + 3``
SEED_FIELD = re.compile(r"\b(noise|sampling|batch|model)_seed\s*=\s*(?!seed_for|adjacent|point\.seed_for|"
                        r"point\.poisson_seed\(\))[^,)\n]*[+*]")
#: the contract's own seed arithmetic (RunSpec semantics every target implements, documented in
#: targets/base.py): not a stream picked by a check
SEMANTICS = {"targets/base.py", "targets/opacus_target.py", "properties/analysis/compare.py", "gate/scale.py"}


def _code(path: pathlib.Path) -> str:
    """The file without comments and docstrings/strings (so prose about seeds is not flagged)."""
    src = path.read_text()
    out = []
    import io
    import tokenize

    for tok in tokenize.generate_tokens(io.StringIO(src).readline):
        if tok.type in (tokenize.COMMENT, tokenize.STRING):
            continue
        out.append(tok.string)
    return " ".join(out)


def test_every_default_and_seed_is_defined_once():
    strays = []
    for path in sorted(PKG.rglob("*.py")):
        rel = str(path.relative_to(PKG))
        if rel in ("config/defaults.py", "config/space.py"):
            continue
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            targets = (node.targets if isinstance(node, ast.Assign) else [node.target]
                       if isinstance(node, ast.AnnAssign) else [])
            for t in targets:
                for name in ([t] if isinstance(t, ast.Name) else getattr(t, "elts", [])):
                    if isinstance(name, ast.Name) and name.id in DEFAULT_NAMES and rel != "gate/plan.py":
                        strays.append(f"{rel}:{node.lineno}: assigns the default {name.id} (defaults.py's)")
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "seed" \
                    and rel.startswith("properties/"):
                strays.append(f"{rel}:{node.lineno}: Point.seed(base) picks a stream by offset: "
                              "use point.seed_for(name)")
            if isinstance(node, ast.keyword) and node.arg == "default" and rel == "gate/cli.py" \
                    and isinstance(node.value, ast.Constant) and isinstance(node.value.value, (int, float)) \
                    and not isinstance(node.value.value, bool) and node.value.value != 0:
                strays.append(f"{rel}:{node.value.lineno}: a literal CLI default {node.value.value!r} (defaults.py's)")
        code = _code(path)
        if rel not in SEMANTICS:
            strays += [f"{rel}: a seed picked by offset: {m.group(0)!r}" for m in SEED_FIELD.finditer(code)]
            if "crc32" in code:
                strays.append(f"{rel}: a seed hashed by hand (crc32): use space.seed_for")
        if (re.search(r"world_sizes\s*:[^=]*=\s*\(\s*1\s*,\s*2\s*\)", code)
                or re.search(r"=\s*\"1,2\"", path.read_text())):
            strays.append(f"{rel}: the default world sizes written again (defaults.DEFAULT_WORLD_SIZES)")
    assert not strays, "\n".join(strays)


def test_the_grep_sees_a_stray(tmp_path):
    """The check above is not blind: each pattern flags a line written the old way."""
    assert SEED_FIELD.search("noise_seed=point.seed(4242 + ws))")
    assert SEED_FIELD.search("noise_seed=(base_seed + i) % 2 ** 31")
    assert not SEED_FIELD.search('noise_seed=point.seed_for("noise_run", ws))')
    f = tmp_path / "x.py"
    f.write_text('"""noise_seed + 3 in prose"""\nx = 1  # sampling_seed=s + 1\n')
    assert not SEED_FIELD.search(_code(f))


def test_the_docs_option_table_is_the_space():
    text = (ROOT / "docs" / "explore.md").read_text()
    table = text.split("<!-- space-table -->")[1].split("<!-- /space-table -->")[0].strip()
    assert table == space.option_table(), "regenerate it from space.option_table()"


def test_typed_axis_lookups_say_which_kind():
    """``choice`` / ``integer`` / ``real`` give an axis typed by its kind (no ``type: ignore`` at a
    lookup), and a lookup of the wrong kind or an axis exploration never draws says so."""
    assert space.choice("precision").values == AXES["precision"].values
    assert space.integer("local_batch").drawn == (1, 64)
    assert space.real("noise_multiplier").drawn == (0.5, 4.0)
    with pytest.raises(TypeError, match="'lr' is a Real, not a Integer"):
        space.integer("lr")
    with pytest.raises(ValueError, match="axis max_grad_norm is not explored"):
        _ = space.real("max_grad_norm").drawn
