"""Each script's signature: declared once in Python, listed in its ``.lua`` header, used
by name in its code, and the only way a call is built."""

from __future__ import annotations

import re
from importlib import resources

import pytest

from celery_redlock.engine import scripts
from celery_redlock.engine.keys import lock_keys
from celery_redlock.engine.scripts import ACQUIRE, INSPECT, RELEASE_SHARED, RENEW_MANY, SCRIPTS

#: One header line per name: ``-- KEYS[1]  lock  ...`` or ``-- ARGV[2]  ttl_ms  ...``.
ENTRY = re.compile(r"^-- (KEYS|ARGV)\[([^\]]*)\]\s+(\w+\*?)(?:\s|$)")
LIBRARIES = {library for script in SCRIPTS for library in script.libraries}


def lua_files() -> dict[str, str]:
    """Every ``.lua`` file of the package: its name without the suffix -> its text."""
    return {
        path.name.removesuffix(".lua"): path.read_text("utf-8")
        for path in resources.files(scripts).iterdir()
        if path.name.endswith(".lua")
    }


def header(text: str) -> list[str]:
    lines = text.splitlines()
    return lines[: next(i for i, line in enumerate(lines) if not line.startswith("--"))]


def declared_in(text: str) -> dict[str, list[tuple[str, str]]]:
    """The header's (position, name) entries, per ``KEYS`` and ``ARGV``."""
    found: dict[str, list[tuple[str, str]]] = {"KEYS": [], "ARGV": []}
    for line in header(text):
        match = ENTRY.match(line)
        if match:
            found[match[1]].append((match[2], match[3]))
    return found


def test_every_script_file_is_declared_and_every_library_is_used():
    """A ``.lua`` file is a library or the code of at least one declared script, and
    every declared script is exported: nothing in the directory runs undeclared."""
    files = lua_files()
    assert set(files) >= LIBRARIES
    assert set(files) - LIBRARIES == {script.file for script in SCRIPTS}
    assert {script.name for script in SCRIPTS} <= {
        name.lower()
        for name in scripts.__all__
        if isinstance(getattr(scripts, name), scripts.Script)
    }
    assert len({script.sha for script in SCRIPTS}) == len(SCRIPTS), "two scripts run one source"


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda script: script.name)
def test_the_header_names_the_declared_keys_and_argv_in_order(script):
    """The header lists each name of the declaration once, in its order, at its position
    (positions after a group, whose length varies, are free text); names elsewhere in
    the header are by name, never by ``ARGV[n]`` or ``KEYS[n]``."""
    text = lua_files()[script.file]
    found = declared_in(text)
    for part, names in (("KEYS", script.key_names), ("ARGV", script.arg_names)):
        assert [name for _, name in found[part]] == list(names), (script.name, part)
        for i, (position, name) in enumerate(found[part], start=1):
            if "*" in "".join(names[: i - 1]) or name.endswith("*"):
                break
            assert position == str(i), (script.name, part, name, position)
    for line in header(text):
        if not ENTRY.match(line):
            assert not re.search(r"(KEYS|ARGV)\[", line), (script.name, line)


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda script: script.name)
def test_the_code_reads_its_argv_into_locals_of_the_declared_names(script):
    """Outside a group, every ``ARGV[n]`` the code reads is bound once, to a local named
    as the declaration names position n (or to a parse of it), so the code reads by name."""
    code = "\n".join(lua_files()[script.file].splitlines()[len(header(lua_files()[script.file])) :])
    fixed = [name for name in script.arg_names]
    if any(name.endswith("*") for name in fixed):
        fixed = fixed[: next(i for i, name in enumerate(fixed) if name.endswith("*"))]
    for line in code.splitlines():
        reads = re.findall(r"ARGV\[(\d+)\]", line)
        if not reads or line.lstrip().startswith("--"):
            continue
        binding = re.match(r"\s*local ([\w, ]+) = (.*)$", line)
        assert binding, (script.name, line)
        names = [name.strip() for name in binding[1].split(",")]
        values = binding[2].split(", ") if len(names) > 1 else [binding[2]]
        for name, value in zip(names, values, strict=True):
            index = re.search(r"ARGV\[(\d+)\]", value)
            if index is None or int(index[1]) > len(fixed):
                continue
            declared = fixed[int(index[1]) - 1]
            # A local may hold the argument parsed (``ttl`` for ``ttl_ms``, ``grace``).
            assert (
                name == declared
                or declared.startswith(name)
                or name.startswith(declared.removesuffix("_ms"))
            ), (script.name, line, declared)


def test_a_missing_or_unknown_name_raises_at_once_naming_script_and_argument():
    """The builders check names as Python checks a call's keywords."""
    keys = lock_keys("sig")
    with pytest.raises(TypeError, match=r"release_shared\.on\(\) missing .*'attempt'"):
        RELEASE_SHARED.on(keys, token="t")
    with pytest.raises(TypeError, match=r"release_shared\.call\(\) got an unexpected .*'tokn'"):
        RELEASE_SHARED.call(channel="c", shared="s", holders="h", tokn="t", attempt="")
    with pytest.raises(TypeError, match=r"release_shared\.call\(\) takes 0 positional"):
        RELEASE_SHARED.call("c", "s", "h", "t", "")
    with pytest.raises(TypeError, match=r"renew_many\.on\(\): its keys are not fields"):
        RENEW_MANY.on(keys, leases=())


def test_positions_come_from_the_declaration_and_groups_spread_in_place():
    keys = lock_keys("sig")
    call = RELEASE_SHARED.on(keys, attempt=3, token="t")
    assert call.script is RELEASE_SHARED
    assert call.keys == (keys.channel, keys.shared, keys.holders) and call.args == ("t", 3)
    assert INSPECT.on(keys).keys == (keys.lock, keys.fence)
    assert RENEW_MANY.call(holds=["a", "b"], leases=["t", 1, "x", "t", 1, "x"]).keys == ("a", "b")
    argv = ACQUIRE.build_argv(
        token="t", ttl_ms=1, task_id="i", host="h", pid=2, acquired_at="0", task_name="n",
        blocking="", waiter_ms="", arrival="", channel="", attempt=1, grant_ms=5,
        handoff=("p", 1, 2, 3),
    )  # fmt: skip
    assert argv == ("t", 1, "i", "h", 2, "0", "n", "", "", "", "", 1, 5, "p", 1, 2, 3)
    assert ACQUIRE.build_keys(resources=keys.resource, record=(), abandoned="a") == (
        *keys.resource,
        "a",
    )


def test_a_declaration_that_cannot_name_its_arguments_is_refused():
    with pytest.raises(ValueError, match="declared twice"):
        scripts.Script("inspect", keys=("lock", "fence"), argv=("lock",))
    with pytest.raises(ValueError, match="cannot name"):
        scripts.Script("inspect", keys=("lock", "fence"), argv=("class",))


def test_variants_of_one_file_differ_only_in_their_prelude_constants():
    """acquire, acquire_wake and acquire_fair: one file, one signature; the algorithm
    is picked when the script is loaded, not by an argument of the call."""
    variants = [script for script in SCRIPTS if script.file == "acquire"]
    assert {script.name for script in variants} == {"acquire", "acquire_wake", "acquire_fair"}
    assert {(s.key_names, s.arg_names) for s in variants} == {
        (ACQUIRE.key_names, ACQUIRE.arg_names)
    }
    assert {s.constants["NAMING"] for s in variants} == {"", "wake", "fair"}
    for script in variants:
        assert f"local NAMING = '{script.constants['NAMING']}'" in script.source
