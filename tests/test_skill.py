"""SKILL.md names only things that exist: every file, test, command, make target and identifier in its code spans.

Code spans are classified as: ``zerodiff ...`` commands (parsed by the real CLI parser, not run), ``python``/
``pytest`` commands (their scripts, test files and test functions must exist), ``make`` targets (must be in the
Makefile), paths (``a/b.py``, ``a/b.py::test_x``; ``<op>`` is replaced by ``rmsnorm``, the worked example) and
identifiers (a ``def``/``class``/assignment of that name in kernels/ or tests/; an all-caps word may instead be
one the commands print). Other spans (prose such as
printed messages or expressions) are left alone.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SKILL = ROOT / "SKILL.md"
GATES = ("victim-in-batch", "negative control", "mutation", "gradient check", "end-to-end", "locate", "baseline")


def _spans() -> list:
    text = SKILL.read_text()
    return [s.replace("<op>", "rmsnorm") for s in re.findall(r"`([^`\n]+)`", text)]


def _check_path(p: str) -> None:
    path, _, func = p.partition("::")
    f = ROOT / path
    assert f.exists(), f"SKILL.md names {path}, which does not exist"
    if func:
        assert re.search(rf"^def {re.escape(func)}\b", f.read_text(), re.M), f"{path} has no test {func}"


def _check_zerodiff(cmd: str) -> None:
    from zerodiff.cli import build_parser

    argv = shlex.split(cmd)[1:]
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:  # argparse: unknown subcommand or option
        raise AssertionError(f"SKILL.md command {cmd!r} does not parse: exit {e.code}") from None
    assert getattr(args, "func", None) is not None, cmd


def _check_python(cmd: str) -> None:
    argv = shlex.split(cmd)
    argv = argv[1:]
    if argv[:2] == ["-m", "pytest"]:
        argv = argv[2:]
    elif argv and argv[0] == "-m":
        import importlib.util

        assert importlib.util.find_spec(argv[1]) is not None, cmd
        return
    for a in argv:
        if not a.startswith("-") and ("/" in a or a.endswith(".py")):
            _check_path(a)


def _identifier_defined(name: str, printed: bool = False) -> bool:
    """``name`` has a def / class / assignment in kernels/zerodiff or tests/ (``printed``: or occurs as a word in
    the package's source, e.g. a word the commands print)."""
    pat = re.compile(rf"^\s*(def|class)\s+{re.escape(name)}\b|^\s*{re.escape(name)}\s*(:[^=]*)?=", re.M)
    word = re.compile(rf"\b{re.escape(name)}\b")
    for d in ("kernels/zerodiff", "tests"):
        for f in (ROOT / d).rglob("*.py"):
            text = f.read_text()
            if pat.search(text) or (printed and d == "kernels/zerodiff" and word.search(text)):
                return True
    return False


def _classify(span: str):
    head = span.split()[0]
    if head == "zerodiff":
        return "zerodiff"
    if head in ("python", "python3", ".venv/bin/python", "pytest"):
        return "python"
    if head == "make":
        return "make"
    if " " not in span and re.fullmatch(r"[\w./<>-]+(::\w+)?", span) and ("/" in span or span.endswith(".md")):
        return "path"
    if re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", span) and (span.isupper() or "_" in span or span[0].isupper()):
        return "identifier"
    return None


def test_skill_names_the_gates():
    text = SKILL.read_text().lower()
    for g in GATES:
        assert g in text, g
    assert len(re.findall(r"^## Gate \d", SKILL.read_text(), re.M)) >= 7


def test_every_command_file_and_name_in_skill_exists():
    spans = _spans()
    kinds = {}
    for s in spans:
        kind = _classify(s)
        kinds.setdefault(kind, []).append(s)
        if kind == "zerodiff":
            _check_zerodiff(s)
        elif kind == "python":
            if s.split()[0] == "pytest":
                s = "python -m " + s
            _check_python(s)
        elif kind == "make":
            targets = set(re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), re.M))
            for t in s.split()[1:]:
                assert t in targets, f"SKILL.md names make target {t!r}, not in the Makefile"
        elif kind == "path":
            if s.startswith("layers."):
                continue
            _check_path(s)
        elif kind == "identifier":
            ok = _identifier_defined(s, printed=s.isupper())
            assert ok, f"SKILL.md names {s!r}, defined nowhere in kernels/ or tests/"
    # the classification really found things to check
    assert len(kinds.get("zerodiff", [])) >= 6 and len(kinds.get("path", [])) >= 10
    assert len(kinds.get("python", [])) >= 3 and len(kinds.get("identifier", [])) >= 5


@pytest.mark.parametrize("bad", ["zerodiff check --no-such-flag", "zerodiff nosuchcommand"])
def test_the_command_check_can_fail(bad):
    with pytest.raises(AssertionError):
        _check_zerodiff(bad)


def test_the_path_check_can_fail():
    with pytest.raises(AssertionError):
        _check_path("tests/test_rmsnorm.py::test_no_such_test")
    assert not _identifier_defined("NoSuchIdentifierAnywhere")
