"""The user documentation (docs/reference.md, docs/config.md) keeps step with the code.

Everything is found in the source itself, never by a module's path, so that the
tests survive modules moving between packages:

* every error ``code`` the gateway can emit (a JSON error, an SSE error event, a
  usage row's ``error_code``) has a row in the "Errors" table of docs/reference.md,
  and every code of that table is one the source can emit;
* every key the config loader accepts has a row under its table in docs/config.md;
* every column of the ``usage_events`` table has a row in the usage table of
  docs/reference.md.
"""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "kilnproxy"
DOCS = REPO / "docs"
REFERENCE = DOCS / "reference.md"
CONFIG_DOC = DOCS / "config.md"

CODE_ATTRS = ("code", "error_code")
CODE_SHAPE = re.compile(r"[a-z][a-z0-9]*(?:_[a-z0-9]+)*")
SQL_CODE = re.compile(r"error_code\s*(?:=|IS\s+DISTINCT\s+FROM|IS\s+NOT\s+DISTINCT\s+FROM)\s*'(\w+)'", re.I)
CREATE_USAGE = re.compile(r"CREATE\s+TABLE\s+(?:IF\s+NOT\s+EXISTS\s+)?usage_events\s*\((.*?)\n\)", re.I | re.S)
ADD_COLUMN = re.compile(r"ALTER\s+TABLE\s+(?:IF\s+EXISTS\s+)?usage_events\s+ADD\s+(?:COLUMN\s+)?"
                        r"(?:IF\s+NOT\s+EXISTS\s+)?(\w+)", re.I)
SQL_CONSTRAINTS = {"primary", "unique", "constraint", "foreign", "check"}


# -- the source ------------------------------------------------------------------------


def source_files() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts)


def parsed() -> list[tuple[Path, ast.Module]]:
    return [(p, ast.parse(p.read_text(encoding="utf-8"), str(p))) for p in source_files()]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def literals(node: ast.AST | None) -> set[str]:
    """The string literals an expression can evaluate to: ``"x"``, ``a if c else "y"``, ``a or "z"``."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return {node.value}
    if isinstance(node, ast.IfExp):
        return literals(node.body) | literals(node.orelse)
    if isinstance(node, ast.BoolOp):
        return set().union(*(literals(v) for v in node.values))
    return set()


def _code_params(trees) -> dict[str, set[int]]:
    """Callables of the package that take a ``code`` parameter -> its positional index (``self`` and
    ``cls`` left out): ``GatewayError(status, code, ...)``, ``UpstreamFailure(message, code)``,
    ``record.fail(status, code)``, ``error_frame(message, code)``, ..."""
    found: dict[str, set[int]] = {}

    def add(name: str, fn: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        params = [a.arg for a in fn.args.posonlyargs + fn.args.args]
        if params and params[0] in ("self", "cls"):
            params = params[1:]
        if "code" in params:
            found.setdefault(name, set()).add(params.index("code"))
        elif any(a.arg == "code" for a in fn.args.kwonlyargs):
            found.setdefault(name, set())

    for _, tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                add(node.name, node)
            elif isinstance(node, ast.ClassDef):
                for item in node.body:
                    if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and item.name == "__init__":
                        add(node.name, item)
    return found


def emitted_codes() -> dict[str, set[str]]:
    """Every error code literal in the package -> the files it is found in."""
    trees = parsed()
    takes_code = _code_params(trees)
    codes: dict[str, set[str]] = {}

    def found(values: set[str], path: Path) -> None:
        for value in values:
            if CODE_SHAPE.fullmatch(value):  # a code, not the message of a same-named method's call
                codes.setdefault(value, set()).add(str(path.relative_to(REPO)))

    for path, tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, ast.Call):  # GatewayError(403, "forbidden", ...), bad_request(..., code="x")
                func = node.func
                name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None
                for index in takes_code.get(name, ()):
                    if index < len(node.args):
                        found(literals(node.args[index]), path)
                for kw in node.keywords:
                    if kw.arg == "code":
                        found(literals(kw.value), path)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                args = node.args
                positional = args.posonlyargs + args.args
                defaults = list(zip(positional[len(positional) - len(args.defaults):], args.defaults))
                defaults += [(a, d) for a, d in zip(args.kwonlyargs, args.kw_defaults) if d is not None]
                for arg, default in defaults:  # def bad_request(..., code="invalid_request")
                    if arg.arg == "code":
                        found(literals(default), path)
                if "code" in node.name:  # def _error_code(raw): ... return "upstream_rejected"
                    for sub in ast.walk(node):
                        if isinstance(sub, ast.Return):
                            found(literals(sub.value), path)
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                # class ShuttingDown: code = "shutting_down"; record.error_code = "internal_error"
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for target in targets:
                    name = target.id if isinstance(target, ast.Name) else \
                        target.attr if isinstance(target, ast.Attribute) else None
                    if name in CODE_ATTRS:
                        found(literals(node.value), path)
            elif isinstance(node, ast.Dict):  # {"error": {..., "code": "fixture_not_found"}}
                for key, value in zip(node.keys, node.values):
                    if isinstance(key, ast.Constant) and key.value == "code":
                        found(literals(value), path)
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):  # SQL: error_code = 'replica_lost'
                found(set(SQL_CODE.findall(node.value)), path)
    return codes


def string_constants() -> list[str]:
    return [node.value for _, tree in parsed() for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str)]


def usage_columns() -> set[str]:
    """The columns of ``usage_events``: every ``CREATE TABLE usage_events`` (SQLite's and PostgreSQL's),
    every ``ALTER TABLE usage_events ADD COLUMN``, and the row's ``COLUMNS`` tuple."""
    columns: set[str] = set()
    creates = 0
    for text in string_constants():
        for body in CREATE_USAGE.findall(text):
            creates += 1
            for line in body.splitlines():
                word = line.strip().split(" ", 1)[0].strip('",')
                if word and word.lower() not in SQL_CONSTRAINTS:
                    columns.add(word)
        columns.update(ADD_COLUMN.findall(text))
    assert creates, "no CREATE TABLE usage_events found in kilnproxy/"
    for _, tree in parsed():
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "COLUMNS"
                                                    for t in node.targets):
                if isinstance(node.value, (ast.Tuple, ast.List)):
                    columns.update(e.value for e in node.value.elts
                                   if isinstance(e, ast.Constant) and isinstance(e.value, str))
    return columns


def accepted_config_keys(monkeypatch) -> dict[str, set[str]]:
    """Table -> the keys the loader accepts in it ("" for the top level), learnt from the loader itself.

    The loader reads each table with a reader that remembers every key it asked for (``seen``) and,
    in ``done()``, refuses any other key as unknown. Its ``done`` is wrapped to note what each reader
    saw while a config with a model, an org and a key is parsed."""
    defining = [module_name(p) for p, tree in parsed()
                if any(isinstance(n, ast.FunctionDef) and n.name == "parse_config" for n in tree.body)]
    assert defining, "no module of kilnproxy/ defines parse_config"
    module = importlib.import_module(defining[0])
    readers = [c for c in vars(module).values()  # the reader class it uses, defined there or imported
               if isinstance(c, type) and c.__module__.startswith("kilnproxy.")
               and callable(getattr(c, "done", None)) and callable(getattr(c, "fail", None))]
    assert readers, f"{module.__name__} has no reader class with done(): update tests/docs/test_docs.py"
    seen: dict[str, set[str]] = {}
    for reader in readers:
        original = reader.done

        def done(self, _original=original):
            table = re.sub(r"\[\d+\](?: \([^)]*\))?", "", self.where)
            seen.setdefault(table, set()).update(self.seen)
            return _original(self)

        monkeypatch.setattr(reader, "done", done)
    module.parse_config({
        "models": [{"id": "m", "upstreams": ["http://127.0.0.1:1/v1"], "pricing": {"prompt": 1.0}}],
        "orgs": [{"id": "o"}],
        "keys": [{"key": "sk-test", "org": "o"}],
    })
    assert {"", "server", "models", "models.pricing", "orgs", "keys"} <= set(seen), seen
    return seen


# -- the docs ----------------------------------------------------------------------------


def section(text: str, heading: str) -> str:
    """The text under the Markdown heading ``heading`` (any level), up to the next heading of that
    level or higher."""
    match = re.search(rf"^(#+) {re.escape(heading)}\s*$", text, re.M)
    assert match, f"no heading {heading!r}"
    level = len(match.group(1))
    rest = text[match.end():]
    end = re.search(rf"^#{{1,{level}}} ", rest, re.M)
    return rest[:end.start()] if end else rest


def first_cells(text: str) -> set[str]:
    """The backticked names in the first cell of each table row: ``| `a`, `b` | ... |`` -> {a, b}."""
    names = set()
    for line in text.splitlines():
        if line.startswith("|") and not set(line) <= set("|-: "):
            names.update(re.findall(r"`([^`]+)`", line.split("|")[1]))
    return names


def config_tables(text: str) -> dict[str, set[str]]:
    """docs/config.md: each heading naming a table (``### `[server]` ``, ``### `[[models]]` ``,
    ``### `[models.pricing]` ``) -> the keys of its table rows."""
    tables: dict[str, set[str]] = {}
    headings = list(re.finditer(r"^#+ .*?`\[\[?([\w.]+)\]?\]`.*$", text, re.M))
    for i, heading in enumerate(headings):
        end = headings[i + 1].start() if i + 1 < len(headings) else len(text)
        tables[heading.group(1)] = first_cells(text[heading.end():end])
    return tables


# -- the tests -----------------------------------------------------------------------------


def test_every_error_code_is_in_the_errors_table():
    codes = emitted_codes()
    for expected in ("invalid_api_key", "forbidden", "insufficient_credits", "maintenance", "request_too_large",
                     "invalid_request", "model_not_found", "rate_limit_exceeded", "shutting_down", "replica_lost"):
        assert expected in codes, f"the scan of kilnproxy/ missed {expected!r}: update tests/docs/test_docs.py"
    documented = first_cells(section(REFERENCE.read_text(encoding="utf-8"), "Errors"))
    missing = {code: sorted(where) for code, where in codes.items() if code not in documented}
    assert not missing, f"error codes the code emits but docs/reference.md's Errors table lacks: {missing}"
    stale = documented - set(codes)
    assert not stale, f"docs/reference.md's Errors table lists codes no source emits: {sorted(stale)}"


def test_every_config_key_is_in_the_config_docs(monkeypatch):
    tables = config_tables(CONFIG_DOC.read_text(encoding="utf-8"))
    accepted = accepted_config_keys(monkeypatch)
    missing = sorted(f"[{t}]" for t in accepted[""] if t not in tables)
    assert not missing, f"config tables the loader accepts but docs/config.md has no heading for: {missing}"
    missing = sorted(f"{table}.{key}" for table, keys in accepted.items() if table
                     for key in keys if key not in tables.get(table, ()))
    assert not missing, f"config keys the loader accepts but docs/config.md lacks: {missing}"
    stale = sorted(f"{table}.{key}" for table, keys in tables.items() for key in keys
                   if table in accepted and key not in accepted[table])
    assert not stale, f"docs/config.md documents keys the loader refuses: {stale}"


def test_every_usage_column_is_in_the_usage_table():
    columns = usage_columns()
    assert {"id", "org", "cost", "error_code", "disconnected"} <= columns, columns
    documented = first_cells(section(REFERENCE.read_text(encoding="utf-8"), "The usage table"))
    missing = sorted(columns - documented)
    assert not missing, f"usage_events columns that docs/reference.md's usage table lacks: {missing}"
    stale = sorted(documented - columns)
    assert not stale, f"docs/reference.md's usage table lists columns usage_events does not have: {stale}"


def test_the_docs_link_only_to_files_of_the_repository():
    for doc in (REFERENCE, CONFIG_DOC):
        text = doc.read_text(encoding="utf-8")
        assert "SPEC" not in text and "../shared" not in text, f"{doc.name} points outside the repository"
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
            if "://" not in target:
                assert (doc.parent / target).exists(), f"{doc.name} links to {target}, which does not exist"
