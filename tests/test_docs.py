"""The docs against the code, read as they are when the test runs.

* docs/configuration.md's table lists exactly the settings the package reads: every
  ``VLLM_KEEPALIVE_*`` name and ``--additional-config`` key the code reads is a row, every one
  listed is read, and every other variable the package reads from the environment is listed
  (or is one of its own hand-over variables, ``_KEEPALIVE_*``/``KEEPALIVE_EXECUTOR_*``); the
  vLLM and torch names listed are referenced in the package (or, for a vLLM flag keepalive
  does not read itself, in vLLM's own argument and environment definitions).
* docs/troubleshooting.md quotes keepalive's messages by a literal fragment each: every
  fragment is still literal text of the package, and every start-up refusal the package
  raises is quoted there.
* Every relative link of README.md and docs/ resolves to a file, and to a heading in it.
* The user docs carry no development history: no issue numbers, commit hashes or dates.

No engine, no process: the package is read with ``ast``.
"""

from __future__ import annotations

import ast
import importlib.util
import re
from collections.abc import Iterator
from functools import cache
from pathlib import Path

import pytest

pytestmark = pytest.mark.fast  # in `scripts/test.sh --fast`: see pyproject.toml

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "keepalive_executor"
DOCS = ROOT / "docs"
CONFIGURATION = DOCS / "configuration.md"
TROUBLESHOOTING = DOCS / "troubleshooting.md"
#: Where dated figures and the project's own history belong (not the user's path).
DEVELOPER_DOCS = {"development.md"}
#: Variables the package sets for its own processes (not settings): these name prefixes.
INTERNAL_PREFIXES = ("_KEEPALIVE_", "KEEPALIVE_EXECUTOR_")
#: Exceptions whose messages are the start-up refusals and call errors a user meets: each
#: ``raise`` of one must have a fragment quoted in docs/troubleshooting.md.
USER_ERRORS = {"KeepaliveConfigError", "TorchrunError", "LaunchError", "WorkerStartupError",
               "PayloadTooLargeError", "RpcSerializationError", "ReplyGatherError"}
ENV_VAR = re.compile(r"^_?[A-Z][A-Z0-9]*(?:_[A-Z0-9]+)*$")
KEEPALIVE_VAR = re.compile(r"^VLLM_KEEPALIVE_[A-Z0-9_]+$")


# ---------------------------------------------------------------------- reading markdown


def _without_fences(text: str) -> str:
    """``text`` with fenced code blocks blanked (their lines kept, emptied)."""
    out, fenced = [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            out.append("")
            continue
        out.append("" if fenced else line)
    return "\n".join(out)


def _cells(line: str) -> list[str]:
    """A table row's cells; a ``|`` inside a code span or escaped (``\\|``) is no border."""
    cells, cell, code, i = [], "", False, 0
    body = line.strip()
    body = body[1:] if body.startswith("|") else body
    while i < len(body):
        ch = body[i]
        if ch == "\\" and i + 1 < len(body) and body[i + 1] == "|":
            cell += "|"
            i += 2
            continue
        if ch == "`":
            code = not code
        if ch == "|" and not code:
            cells.append(cell.strip())
            cell = ""
        else:
            cell += ch
        i += 1
    if cell.strip():
        cells.append(cell.strip())
    return cells


def tables(text: str) -> Iterator[tuple[list[str], list[list[str]]]]:
    """Every table of a markdown text: (header cells, rows of cells)."""
    lines = _without_fences(text).splitlines()
    i = 0
    while i < len(lines) - 1:
        if lines[i].lstrip().startswith("|") and re.match(r"^\s*\|[\s:|-]+\|\s*$", lines[i + 1]):
            header = _cells(lines[i])
            rows = []
            i += 2
            while i < len(lines) and lines[i].lstrip().startswith("|"):
                rows.append(_cells(lines[i]))
                i += 1
            yield header, rows
        else:
            i += 1


def code_spans(cell: str) -> list[str]:
    return re.findall(r"`([^`]+)`", cell)


# ---------------------------------------------------------------------- reading the package


@cache
def package_sources() -> dict[Path, str]:
    return {p: p.read_text() for p in sorted(PACKAGE.rglob("*.py"))}


@cache
def package_trees() -> dict[Path, ast.Module]:
    return {p: ast.parse(src, str(p)) for p, src in package_sources().items()}


@cache
def string_literals() -> tuple[str, ...]:
    """Every string literal of the package, and every literal part of an f-string (adjacent
    literals are one constant already)."""
    out = []
    for tree in package_trees().values():
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                out.append(node.value)
    return tuple(out)


def _module_constants(tree: ast.Module) -> dict[str, list[str]]:
    """Module-level ``NAME = "text"`` and ``NAME = ("a", "b")``, imported names included
    (see :func:`_constants`)."""
    out: dict[str, list[str]] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target, value = node.targets[0], node.value
            if isinstance(target, ast.Name):
                strings = _strings(value)
                if strings:
                    out[target.id] = strings
            elif isinstance(target, ast.Tuple) and isinstance(value, ast.Tuple):
                for t, v in zip(target.elts, value.elts, strict=False):
                    if isinstance(t, ast.Name) and _strings(v):
                        out[t.id] = _strings(v)
    return out


def _strings(node: ast.AST) -> list[str]:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, (ast.Tuple, ast.List)):
        values = [e.value for e in node.elts
                  if isinstance(e, ast.Constant) and isinstance(e.value, str)]
        return values if len(values) == len(node.elts) else []
    return []


@cache
def _constants() -> dict[str, list[str]]:
    """Every module-level string constant of the package, by name (names are unique enough
    in this package that one table serves every module: ``ENV_SECRET`` is imported by the
    modules that read it under the same name)."""
    out: dict[str, list[str]] = {}
    for tree in package_trees().values():
        for name, values in _module_constants(tree).items():
            out.setdefault(name, [])
            out[name] += [v for v in values if v not in out[name]]
    return out


def _is_environ(node: ast.AST) -> bool:
    """``os.environ``, or a mapping the package names ``env``/``environ`` (a parameter that
    defaults to ``os.environ``)."""
    if isinstance(node, ast.Attribute):
        return node.attr == "environ" and isinstance(node.value, ast.Name) \
            and node.value.id == "os"
    return isinstance(node, ast.Name) and node.id in ("env", "environ")


def _loop_values(tree: ast.Module, constants: dict[str, list[str]]) -> dict[str, list[str]]:
    """``for k in NAMES`` (loops and comprehensions): k's possible values."""
    out: dict[str, list[str]] = {}
    for node in ast.walk(tree):
        pairs = []
        if isinstance(node, ast.For):
            pairs.append((node.target, node.iter))
        elif isinstance(node, ast.comprehension):
            pairs.append((node.target, node.iter))
        for target, it in pairs:
            if isinstance(target, ast.Name):
                values = _strings(it) or (constants.get(it.id, [])
                                          if isinstance(it, ast.Name) else [])
                if values:
                    out.setdefault(target.id, []).extend(values)
    return out


def _resolve(node: ast.AST, names: dict[str, list[str]]) -> list[str]:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, ast.Name):
        return names.get(node.id, [])
    return []


@cache
def environ_reads() -> frozenset[str]:
    """Every variable name the package reads from the environment: ``env.get(X)``,
    ``env[X]``, ``X in env``, ``os.getenv(X)``, ``env.setdefault(X, ...)``, and a helper
    called with the environment first (``_int(env, "SLURM_NTASKS", ...)``); X a literal, a
    module constant, or a loop variable over a tuple of them."""
    found: set[str] = set()
    for tree in package_trees().values():
        names = {**_constants(), **_loop_values(tree, _constants())}
        for node in ast.walk(tree):
            keys: list[ast.AST] = []
            if isinstance(node, ast.Call):
                func = node.func
                if isinstance(func, ast.Attribute) and func.attr in ("get", "setdefault", "pop") \
                        and _is_environ(func.value) and node.args:
                    keys.append(node.args[0])
                elif isinstance(func, ast.Attribute) and func.attr == "getenv" and node.args:
                    keys.append(node.args[0])
                elif node.args and _is_environ(node.args[0]):
                    keys += node.args[1:]
            elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load) \
                    and _is_environ(node.value):
                keys.append(node.slice)
            elif isinstance(node, ast.Compare) and len(node.ops) == 1 \
                    and isinstance(node.ops[0], ast.In) and _is_environ(node.comparators[0]):
                keys.append(node.left)
            for key in keys:
                found.update(v for v in _resolve(key, names) if ENV_VAR.match(v))
    return frozenset(found)


@cache
def keepalive_variables() -> frozenset[str]:
    """Every ``VLLM_KEEPALIVE_*`` name that is a string constant of its own in the package
    (a name a docstring or message only mentions is not one)."""
    return frozenset(s for s in string_literals() if KEEPALIVE_VAR.match(s))


def _is_additional_config(node: ast.AST) -> bool:
    """``x.additional_config`` or ``getattr(x, "additional_config", ...)``."""
    if isinstance(node, ast.Attribute):
        return node.attr == "additional_config"
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
            and node.func.id == "getattr" and len(node.args) >= 2:
        return _strings(node.args[1]) == ["additional_config"]
    if isinstance(node, ast.BoolOp):
        return any(_is_additional_config(v) for v in node.values)
    return False


@cache
def additional_config_keys() -> frozenset[str]:
    """The ``--additional-config`` keys the package reads: ``key in cfg``, ``cfg[key]`` and
    ``cfg.get(key)`` where cfg is vLLM's ``additional_config`` (directly, or a variable
    assigned from it)."""
    found: set[str] = set()
    for tree in package_trees().values():
        names = _constants()
        holders = {t.id for node in ast.walk(tree) if isinstance(node, ast.Assign)
                   and _is_additional_config(node.value)
                   for t in node.targets if isinstance(t, ast.Name)}

        def is_config(n: ast.AST, holders: set[str] = holders) -> bool:
            return _is_additional_config(n) or (isinstance(n, ast.Name) and n.id in holders)

        for node in ast.walk(tree):
            key = None
            if isinstance(node, ast.Compare) and len(node.ops) == 1 \
                    and isinstance(node.ops[0], (ast.In, ast.NotIn)) \
                    and is_config(node.comparators[0]):
                key = node.left
            elif isinstance(node, ast.Subscript) and is_config(node.value):
                key = node.slice
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                    and node.func.attr == "get" and is_config(node.func.value) and node.args:
                key = node.args[0]
            if key is not None:
                found.update(_resolve(key, names))
    return frozenset(found)


# ---------------------------------------------------------------------- the configuration table


def _settings_table() -> tuple[list[str], list[list[str]]]:
    found = [(h, rows) for h, rows in tables(CONFIGURATION.read_text())
             if h and h[0].lower() == "setting"]
    assert len(found) == 1, "docs/configuration.md keeps every setting in ONE table " \
        f"(header 'setting | ...'); found {len(found)}"
    return found[0]


def _table_names() -> tuple[set[str], set[str], dict[str, str]]:
    """(names, additional-config keys, each name's 'read by' cell) of the settings table."""
    header, rows = _settings_table()
    read_by_col = header.index("read by")
    names: set[str] = set()
    keys: set[str] = set()
    read_by: dict[str, str] = {}
    for row in rows:
        spans = code_spans(row[0])
        assert spans, f"a row whose first cell names no setting in code: {row[0]!r}"
        for span in spans:
            if span.startswith("--additional-config"):
                new = set(re.findall(r'"([a-z0-9_]+)"\s*:', span))
                assert new, f"no key in {span!r}"
                keys |= new
                continue
            name = span.split()[0].split("=")[0]
            names.add(name)
            read_by[name] = row[read_by_col]
    return names, keys, read_by


def test_the_code_scan_finds_what_it_looks_for():
    """The scans below can fail: they find the settings known to be read, by each route."""
    assert {"VLLM_KEEPALIVE_TRANSPORT", "VLLM_KEEPALIVE_SECRET"} <= keepalive_variables()
    assert {"VLLM_KEEPALIVE_INTERVAL_S", "VLLM_KEEPALIVE_SECRET_FILE", "SLURM_NTASKS",
            "RANK", "GLOO_SOCKET_IFNAME", "XDG_RUNTIME_DIR"} <= environ_reads()
    assert "keepalive_interval_s" in additional_config_keys()
    assert "srun" not in environ_reads()  # a launcher's name, not a variable


def test_every_keepalive_variable_the_code_reads_is_in_the_table_and_no_other():
    names, _, _ = _table_names()
    listed = {n for n in names if KEEPALIVE_VAR.match(n)}
    read = keepalive_variables() | {n for n in environ_reads() if KEEPALIVE_VAR.match(n)}
    assert not read - listed, f"read by keepalive_executor/, missing from docs/configuration.md: " \
        f"{sorted(read - listed)}"
    assert not listed - read, f"in docs/configuration.md, read nowhere in keepalive_executor/: " \
        f"{sorted(listed - read)}"


def test_every_additional_config_key_the_code_reads_is_in_the_table_and_no_other():
    _, keys, _ = _table_names()
    read = additional_config_keys()
    assert read == keys, f"--additional-config keys read: {sorted(read)}; listed: {sorted(keys)}"


def test_every_other_variable_the_package_reads_is_in_the_table():
    names, _, _ = _table_names()
    unlisted = sorted(n for n in environ_reads() - names if not n.startswith(INTERNAL_PREFIXES))
    assert not unlisted, f"read from the environment, missing from docs/configuration.md: " \
        f"{unlisted}"


@cache
def _vllm_definitions() -> str:
    """vLLM's own flags and variables (its argument and environment definitions), read as
    text without importing vLLM."""
    spec = importlib.util.find_spec("vllm")
    assert spec is not None and spec.origin is not None, "vLLM is not installed"
    base = Path(spec.origin).parent
    return "\n".join((base / p).read_text() for p in ("engine/arg_utils.py", "envs.py"))


def test_every_other_setting_listed_is_referenced_by_the_package_or_defined_by_vllm():
    names, _, read_by = _table_names()
    source = "\n".join(package_sources().values())
    stale = []
    for name in sorted(n for n in names if not KEEPALIVE_VAR.match(n)):
        if name in source or name.replace("-", "_").strip("_") in source:
            continue
        if read_by[name].startswith("vLLM"):
            field = name.lstrip("-").replace("-", "_")
            if name in _vllm_definitions() or field in _vllm_definitions():
                continue
        stale.append(name)
    assert not stale, f"listed in docs/configuration.md, referenced nowhere: {stale}"


# ---------------------------------------------------------------------- troubleshooting


def quoted_fragments() -> list[str]:
    """The first-column code spans of troubleshooting.md's tables of keepalive's messages."""
    out = []
    for header, rows in tables(TROUBLESHOOTING.read_text()):
        if header and header[0].lower().startswith("keepalive's message"):
            for row in rows:
                spans = code_spans(row[0])
                assert spans, f"a row that quotes no message: {row[0]!r}"
                out += spans
    return out


def test_every_quoted_message_is_still_in_the_code():
    fragments = quoted_fragments()
    assert len(fragments) >= 40, f"only {len(fragments)} quoted messages"
    literals = string_literals()
    gone = [f for f in fragments if not any(f in s for s in literals)]
    assert not gone, f"quoted in docs/troubleshooting.md, in no string of the package: {gone}"


def _literal_parts(node: ast.AST) -> list[str]:
    """The literal text of a message expression: constants, f-string parts, ``+`` chains."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, ast.JoinedStr):
        return [v.value for v in node.values
                if isinstance(v, ast.Constant) and isinstance(v.value, str)]
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        return _literal_parts(node.left) + _literal_parts(node.right)
    return []


def user_error_raises() -> list[tuple[str, list[str]]]:
    """Every ``raise E(message)`` of a USER_ERRORS class: (where, the message's literal parts)."""
    out = []
    for path, tree in package_trees().items():
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call)):
                continue
            func = node.exc.func
            name = func.id if isinstance(func, ast.Name) else getattr(func, "attr", "")
            if name in USER_ERRORS and node.exc.args:
                parts = _literal_parts(node.exc.args[0])
                if parts:
                    out.append((f"{path.relative_to(ROOT)}:{node.lineno}", parts))
    return out


def test_every_user_facing_error_the_code_raises_is_on_the_troubleshooting_page():
    raises = user_error_raises()
    assert len(raises) >= 30, f"only {len(raises)} raises found"
    fragments = quoted_fragments()
    missing = [(where, " ".join(parts)[:90]) for where, parts in raises
               if not any(f in part for part in parts for f in fragments)]
    assert not missing, "raised, quoted nowhere in docs/troubleshooting.md:\n" + \
        "\n".join(f"  {w}: {m}" for w, m in missing)


# ---------------------------------------------------------------------- links


def _anchor(heading: str) -> str:
    """GitHub's anchor for a heading: its rendered text, lower case, punctuation dropped,
    spaces to hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = text.replace("`", "").replace("*", "").strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for line in _without_fences(path.read_text()).splitlines():
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            base = _anchor(m.group(1))
            n = seen.get(base, 0)
            out.add(base if n == 0 else f"{base}-{n}")
            seen[base] = n + 1
    return out


def doc_files() -> list[Path]:
    return [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]


def links(path: Path) -> Iterator[str]:
    text = re.sub(r"`[^`\n]*`", "", _without_fences(path.read_text()))
    for m in re.finditer(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)", text):
        yield m.group(1)


def test_every_relative_link_resolves_to_a_file_and_a_heading():
    broken = []
    for doc in doc_files():
        for target in links(doc):
            if re.match(r"^[a-z]+:", target):
                continue  # http(s), mailto: not this test's
            file_part, _, anchor = target.partition("#")
            dest = (doc.parent / file_part).resolve() if file_part else doc
            name = f"{doc.relative_to(ROOT)}: {target}"
            if not dest.exists():
                broken.append(f"{name} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                broken.append(f"{name} (no such heading)")
    assert not broken, "\n".join(broken)


def test_the_anchor_rule_matches_githubs():
    assert _anchor("Data parallelism (`-dp N`)") == "data-parallelism--dp-n"
    assert _anchor("Async scheduling (opt-in: `VLLM_KEEPALIVE_ASYNC_SCHEDULING=1`)") == \
        "async-scheduling-opt-in-vllm_keepalive_async_scheduling1"
    assert _anchor("vLLM releases: 0.32, 0.33, 0.34") == "vllm-releases-032-033-034"


# ---------------------------------------------------------------------- no history in user docs

HISTORY = {
    "an issue number": re.compile(r"\bissues? #?\d+", re.I),
    # 7 to 40 hex digits with at least one letter (a short hash can be letters only:
    # dedbbeb); a number of bytes is digits only
    "a commit hash": re.compile(r"\b(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}\b"),
    "a date": re.compile(r"\b20\d\d-\d\d(?:-\d\d)?\b"),
    "a run's history": re.compile(r"failed here once|before the fix|one CI run|"
                                  r"in CI on|seen here by accident", re.I),
}


def user_docs() -> list[Path]:
    return [p for p in doc_files() if not p.name.startswith("benchmarks")
            and p.name not in DEVELOPER_DOCS]


@pytest.mark.parametrize("doc", [p.name for p in user_docs()])
def test_the_user_docs_carry_no_development_history(doc):
    path = next(p for p in user_docs() if p.name == doc)
    found = []
    for lineno, line in enumerate(path.read_text().splitlines(), 1):
        for what, pattern in HISTORY.items():
            for m in pattern.finditer(line):
                found.append(f"{doc}:{lineno}: {what}: {m.group(0)!r}")
    assert not found, "\n".join(found)


def test_the_history_patterns_catch_what_they_name():
    line = "fixed in issue 9 by dedbbeb on 2026-12-07; it failed here once"
    assert {what for what, p in HISTORY.items() if p.search(line)} == set(HISTORY)
    assert not any(p.search("default 1073741824 bytes, ports 20000-29999, avx512_bf16")
                   for p in HISTORY.values())
