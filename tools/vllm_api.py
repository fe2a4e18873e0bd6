"""The vLLM API the DualPath connector uses, read statically from vLLM's released sources.

vLLM's connector API is experimental and changes between releases; the connector runs on a
range of them (docs/vllm/gpu.md says which, and where each is tested). This tool reads, with
`ast` and without installing anything, what the connector overrides, calls and imports from
each release's source (the sdist on PyPI, its sha256 checked against the index and recorded),
and writes the signatures into a small snapshot that `make test` compares with the connector's
own source (`tests/integrations/vllm/connector/test_vllm_api_versions.py`):

    python tools/vllm_api.py snapshot            # fetch the sdists once, write the snapshot
    python tools/vllm_api.py check               # the connector against every snapshot version

What is compared: every `from vllm... import ...` of the connector's modules (imports inside
`try/except ImportError` are optional: a fallback handles them; `TYPE_CHECKING` ones are typing
only); each method the connector's classes override (kind, parameter names and order,
defaults: the calls vLLM makes must bind); abstract methods left undefined; `self.X` the
connector reads from its vLLM base; `super()` calls and calls of imported functions and
classes; the attributes of vLLM objects the connector reads (`USED_ATTRIBUTES`); and the base
methods whose default does not suit the connector (`MUST_OVERRIDE`). What it cannot see:
behaviour (what vLLM does with a value), and attributes reached through untyped expressions
beyond `USED_ATTRIBUTES`.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import sys
import tarfile
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
SNAPSHOT = REPO / "tests" / "integrations" / "vllm" / "connector" / "vllm_api.json"
CACHE = REPO / ".cache" / "dualpath" / "vllm-releases"
INDEX = "https://pypi.org/simple/vllm/"
VERSIONS = ("0.26.0", "0.28.0", "0.30.0", "0.32.0", "0.33.0", "0.34.0")
INTEGRATION = REPO / "src" / "dualpath" / "integrations" / "vllm"
NOT_CHECKED = ("connector/paced_fs_tier.py",)
"""The stock baseline's filesystem tier, written for vLLM 0.32's alone."""


def connector_files() -> list[Path]:
    """The connector's modules that import vllm (anywhere in them), less `NOT_CHECKED`, and
    the plugin that registers it."""
    out = []
    for path in [*sorted((INTEGRATION / "connector").rglob("*.py")), INTEGRATION / "plugin.py"]:
        if path.relative_to(INTEGRATION).as_posix() in NOT_CHECKED:
            continue
        if any(isinstance(n, ast.ImportFrom) and (n.module or "").split(".")[0] == "vllm"
               for n in ast.walk(ast.parse(path.read_text("utf-8")))):
            out.append(path)
    return out

USED_ATTRIBUTES: dict[str, tuple[str, ...]] = {
    "vllm.config.VllmConfig": ("model_config", "parallel_config"),
    "vllm.config.model.ModelConfig": ("model", "dtype"),
    "vllm.config.parallel.ParallelConfig": ("tensor_parallel_size", "pipeline_parallel_size"),
    "vllm.config.kv_transfer.KVTransferConfig": ("get_from_extra_config", "kv_role"),
    "vllm.v1.kv_cache_interface.KVCacheConfig": ("kv_cache_groups",),
    "vllm.v1.kv_cache_interface.KVCacheGroupSpec": ("kv_cache_spec", "layer_names"),
    "vllm.v1.kv_cache_interface.AttentionSpec": ("block_size", "page_size_bytes"),
    "vllm.v1.request.Request": ("request_id", "kv_transfer_params", "all_token_ids",
                                "num_prompt_tokens"),
    "vllm.v1.core.kv_cache_manager.KVCacheBlocks": ("get_block_ids",),
    "vllm.v1.core.sched.output.SchedulerOutput": ("scheduled_new_reqs",
                                                  "scheduled_cached_reqs",
                                                  "num_scheduled_tokens"),
    "vllm.v1.core.sched.output.NewRequestData": ("req_id", "block_ids", "num_computed_tokens"),
    "vllm.v1.core.sched.output.CachedRequestData": ("req_ids", "new_block_ids",
                                                    "num_computed_tokens"),
    "vllm.v1.outputs.KVConnectorOutput": ("invalid_block_ids",),
    "vllm.distributed.kv_transfer.kv_connector.v1.base.KVConnectorRole": ("SCHEDULER",),
    "vllm.distributed.kv_transfer.kv_connector.factory.KVConnectorFactory": (
        "register_connector", "_registry"),
}
"""Attributes the connector reads on vLLM objects it is handed (read through `getattr` with a
default, or through `compat`, they are not listed: those are the optional ones)."""

MUST_OVERRIDE = {
    "requires_kv_delivery": "its default is the kv_role's is_kv_producer (true for kv_both "
                            "and kv_producer), which makes vLLM drop and recompute a preempted "
                            "request's in-flight output; the connector's saves and pushes end "
                            "inside the step that fills a block, so it has no hand-off to hold",
}
"""Base methods whose default is wrong for the connector wherever a version has them."""

Param = tuple[str, str, bool]
"""(name, kind: posonly|pos|vararg|kwonly|varkw, has a default)."""


def _params(args: ast.arguments) -> list[Param]:
    pos = [*args.posonlyargs, *args.args]
    first_default = len(pos) - len(args.defaults)
    out: list[Param] = [(a.arg, "posonly" if i < len(args.posonlyargs) else "pos",
                         i >= first_default) for i, a in enumerate(pos)]
    if args.vararg:
        out.append((args.vararg.arg, "vararg", True))
    out += [(a.arg, "kwonly", d is not None) for a, d in zip(args.kwonlyargs, args.kw_defaults,
                                                            strict=True)]
    if args.kwarg:
        out.append((args.kwarg.arg, "varkw", True))
    return out


def _decorators(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> set[str]:
    names = set()
    for d in fn.decorator_list:
        d = d.func if isinstance(d, ast.Call) else d
        names.add(d.attr if isinstance(d, ast.Attribute) else getattr(d, "id", ""))
    return names


def signature(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> dict[str, Any]:
    decos = _decorators(fn)
    kind = next((k for k in ("classmethod", "staticmethod", "property") if k in decos),
                "method")
    body = [s for s in fn.body if not (isinstance(s, ast.Expr)
                                       and isinstance(s.value, ast.Constant))]
    returns = ast.unparse(body[0].value) if len(body) == 1 and isinstance(
        body[0], ast.Return) and body[0].value is not None else None
    return {"kind": kind, "params": [list(p) for p in _params(fn.args)],
            "abstract": "abstractmethod" in decos,
            **({"returns": returns} if returns and len(returns) <= 120 else {})}


def _class_members(node: ast.ClassDef) -> tuple[list[str], dict[str, Any], list[str]]:
    """Its members' names (fields, class attributes, `self.X` assigned in its methods), its
    methods' signatures and its dataclass-style fields in order (name:has-default)."""
    members: set[str] = set()
    methods: dict[str, Any] = {}
    fields: list[str] = []
    for s in node.body:
        if isinstance(s, ast.FunctionDef | ast.AsyncFunctionDef):
            methods[s.name] = signature(s)
            members.add(s.name)
            for n in ast.walk(s):
                if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store) \
                        and isinstance(n.value, ast.Name) and n.value.id == "self":
                    members.add(n.attr)
        elif isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name):
            members.add(s.target.id)
            if "ClassVar" not in ast.unparse(s.annotation):
                fields.append(f"{s.target.id}:{int(s.value is not None)}")
        elif isinstance(s, ast.Assign):
            members.update(t.id for t in s.targets if isinstance(t, ast.Name))
    return sorted(members), methods, fields


# -- reading a release ---------------------------------------------------------------------
class Source:
    """vLLM's Python sources of one release: an sdist (tar.gz) or an installed `vllm` folder."""

    def __init__(self, path: Path) -> None:
        self.files: dict[str, str] = {}
        if path.is_dir():
            for f in path.rglob("*.py"):
                self.files["vllm/" + f.relative_to(path).as_posix()] = f.read_text("utf-8")
            return
        with tarfile.open(path) as tar:
            for m in tar.getmembers():
                parts = m.name.split("/", 1)
                if m.isfile() and len(parts) == 2 and parts[1].startswith("vllm/") \
                        and parts[1].endswith(".py"):
                    data = tar.extractfile(m)
                    assert data is not None
                    self.files[parts[1]] = data.read().decode("utf-8")
        self._trees: dict[str, ast.Module | None] = {}

    def module(self, dotted: str) -> ast.Module | None:
        if not hasattr(self, "_trees"):
            self._trees = {}
        if dotted not in self._trees:
            base = dotted.replace(".", "/")
            text = self.files.get(base + ".py", self.files.get(base + "/__init__.py"))
            self._trees[dotted] = None if text is None else ast.parse(text)
        return self._trees[dotted]

    def is_package(self, dotted: str) -> bool:
        return dotted.replace(".", "/") + "/__init__.py" in self.files

    def resolve(self, dotted: str, name: str, depth: int = 0) -> tuple[str, ast.AST] | None:
        """Where `from dotted import name` leads: (the defining module, its node), or a
        module (`("module", <its tree>)`); None where the name does not exist."""
        tree = self.module(dotted)
        if tree is None or depth > 8:
            return None
        for node in _top_level(tree):
            if isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) \
                    and node.name == name:
                return dotted, node
            if isinstance(node, ast.Assign | ast.AnnAssign):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                if any(isinstance(t, ast.Name) and t.id == name for t in targets):
                    return dotted, node
            if isinstance(node, ast.ImportFrom):
                for a in node.names:
                    if (a.asname or a.name) == name:
                        origin = _absolute(node, dotted, self.is_package(dotted))
                        found = self.resolve(origin, a.name, depth + 1)
                        if found is None and self.module(f"{origin}.{a.name}") is not None:
                            return "module", self.module(f"{origin}.{a.name}")  # type: ignore
                        return found
        sub = self.module(f"{dotted}.{name}")
        return ("module", sub) if sub is not None else None


def _top_level(tree: ast.Module) -> list[ast.stmt]:
    """Module-level statements, those inside top-level try/if too (not `if TYPE_CHECKING`)."""
    out: list[ast.stmt] = []
    for node in tree.body:
        if isinstance(node, ast.If):
            if "TYPE_CHECKING" not in ast.unparse(node.test):
                out += [*node.body, *node.orelse]
        elif isinstance(node, ast.Try):
            out += [*node.body, *(s for h in node.handlers for s in h.body), *node.orelse]
        else:
            out.append(node)
    return out


def _absolute(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    if not node.level:
        return node.module or ""
    parts = module.split(".")
    base = parts if is_package else parts[:-1]
    base = base[:len(base) - node.level + 1]
    return ".".join([*base, *([node.module] if node.module else [])])


def extract(src: Source, ours: Surface) -> dict[str, Any]:
    """What `ours` imports, in full the classes it subclasses or calls and their bases, and of
    the `USED_ATTRIBUTES` classes which of those attributes exist, as this release has them."""
    imports: dict[str, dict[str, str]] = {}
    classes: dict[str, Any] = {}
    functions: dict[str, Any] = {}
    detailed = {b for c in ours.classes for b in c.bases} | {local for local, *_ in ours.calls}
    pending: list[tuple[str, str]] = []
    for imp in sorted(set(ours.imports), key=lambda i: (i.module, i.name)):
        found = src.resolve(imp.module, imp.name)
        entry = imports.setdefault(imp.module, {})
        if src.module(imp.module) is None:
            entry[imp.name] = "no module"
        elif found is None:
            entry[imp.name] = "missing"
        elif found[0] == "module":
            entry[imp.name] = "module"
        elif isinstance(found[1], ast.ClassDef):
            entry[imp.name] = f"class {found[0]}.{imp.name}"
            if imp.local in detailed:
                pending.append((found[0], found[1].name))
        elif isinstance(found[1], ast.FunctionDef | ast.AsyncFunctionDef):
            entry[imp.name] = f"function {found[0]}.{imp.name}"
            functions[f"{found[0]}.{imp.name}"] = signature(found[1])
        else:
            entry[imp.name] = f"value {found[0]}.{imp.name}"
    while pending:
        module, name = pending.pop()
        key = f"{module}.{name}"
        if key not in classes:
            classes[key] = _class_entry(src, module, name, pending)
    for dotted, attrs in USED_ATTRIBUTES.items():
        module, name = dotted.rsplit(".", 1)
        found = src.resolve(module, name)
        if found is None or not isinstance(found[1], ast.ClassDef):
            imports.setdefault(module, {})[name] = "missing"
            continue
        key = f"{found[0]}.{name}"
        imports.setdefault(module, {})[name] = f"class {key}"
        if key in classes:
            continue
        chain: dict[str, Any] = {}
        todo = [(found[0], name)]
        while todo:
            m, n = todo.pop()
            if f"{m}.{n}" not in chain:
                chain[f"{m}.{n}"] = _class_entry(src, m, n, todo)
        present = sorted(a for a in attrs if any(a in c["members"] for c in chain.values()))
        classes[key] = {"bases": [], "members": present, "methods": {}, "fields": [],
                        "checked": sorted(attrs)}
    return {"imports": imports, "classes": classes, "functions": functions}


def _class_entry(src: Source, module: str, name: str, pending: list[tuple[str, str]]
                 ) -> dict[str, Any]:
    """A class's bases (those found in vllm are queued on `pending`), members, methods and
    fields."""
    found = src.resolve(module, name)
    assert found is not None and isinstance(found[1], ast.ClassDef)
    node = found[1]
    members, methods, fields = _class_members(node)
    bases = []
    for b in node.bases:
        text = ast.unparse(b).split("[")[0]
        base = src.resolve(module, text) if "." not in text else None
        if base is not None and isinstance(base[1], ast.ClassDef):
            bases.append(f"{base[0]}.{base[1].name}")
            pending.append((base[0], base[1].name))
        else:
            bases.append(text)
    return {"bases": bases, "members": members, "methods": methods, "fields": fields}


# -- the connector's side -----------------------------------------------------------------
@dataclass(frozen=True)
class Import:
    module: str
    name: str
    local: str
    how: str  # "runtime", "optional" (inside try/except ImportError) or "typing"


@dataclass
class OurClass:
    name: str
    file: str
    bases: list[str]  # local names of vLLM bases
    methods: dict[str, dict[str, Any]] = field(default_factory=dict)
    defines: set[str] = field(default_factory=set)
    self_reads: dict[str, int] = field(default_factory=dict)  # attr -> line
    super_calls: list[tuple[str, int, list[str], int]] = field(default_factory=list)


@dataclass
class Surface:
    """What the connector's modules take from vllm."""

    imports: list[Import] = field(default_factory=list)
    classes: list[OurClass] = field(default_factory=list)
    calls: list[tuple[str, int, list[str], str]] = field(default_factory=list)
    """(local name called, positional args, keyword names, where)."""


def surface(files: list[Path] | None = None) -> Surface:
    out = Surface()
    for path in files or connector_files():
        tree = ast.parse(path.read_text("utf-8"))
        local: dict[str, Import] = {}
        _collect_imports(tree, path.name, "runtime", local, out)
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                bases = [ast.unparse(b) for b in node.bases if ast.unparse(b) in local]
                if bases:
                    out.classes.append(_our_class(node, path.name, bases))
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
                    and node.func.id in local and not any(
                        isinstance(a, ast.Starred) for a in node.args) \
                    and all(k.arg for k in node.keywords):
                out.calls.append((node.func.id, len(node.args),
                                  [str(k.arg) for k in node.keywords],
                                  f"{path.name}:{node.lineno}"))
    return out


def _collect_imports(node: ast.AST, file: str, how: str, local: dict[str, Import],
                     out: Surface) -> None:
    for child in ast.iter_child_nodes(node):
        child_how = how
        if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
            child_how = "typing"
        elif isinstance(child, ast.Try) and any(
                "ImportError" in ast.unparse(h.type or ast.Constant(None))
                or "ModuleNotFoundError" in ast.unparse(h.type or ast.Constant(None))
                for h in child.handlers):
            for s in child.body:
                _collect_imports(ast.Module(body=[s], type_ignores=[]), file, "optional",
                                 local, out)
            for s in [*(x for h in child.handlers for x in h.body), *child.orelse,
                      *child.finalbody]:
                _collect_imports(ast.Module(body=[s], type_ignores=[]), file, how, local, out)
            continue
        if isinstance(child, ast.ImportFrom) and (child.module or "").split(".")[0] == "vllm":
            for a in child.names:
                imp = Import(str(child.module), a.name, a.asname or a.name, child_how)
                local[imp.local] = imp
                out.imports.append(imp)
            continue
        _collect_imports(child, file, child_how, local, out)


def _our_class(node: ast.ClassDef, file: str, bases: list[str]) -> OurClass:
    c = OurClass(node.name, file, bases)
    for s in node.body:
        if isinstance(s, ast.FunctionDef | ast.AsyncFunctionDef):
            c.methods[s.name] = signature(s)
            c.defines.add(s.name)
        elif isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name):
            c.defines.add(s.target.id)
        elif isinstance(s, ast.Assign):
            c.defines.update(t.id for t in s.targets if isinstance(t, ast.Name))
    for n in ast.walk(node):
        if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) \
                and n.value.id in ("self", "cls"):
            if isinstance(n.ctx, ast.Store):
                c.defines.add(n.attr)
            else:
                c.self_reads.setdefault(n.attr, n.lineno)
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) \
                and isinstance(n.func.value, ast.Call) \
                and getattr(n.func.value.func, "id", "") == "super":
            c.super_calls.append((n.func.attr, len(n.args),
                                  [str(k.arg) for k in n.keywords if k.arg], n.lineno))
    return c


# -- the comparison ------------------------------------------------------------------------
def _chain(snap: dict[str, Any], key: str) -> list[dict[str, Any]]:
    """The class and its recorded bases, nearest first."""
    out, todo, seen = [], [key], set()
    while todo:
        k = todo.pop(0)
        if k in seen or k not in snap["classes"]:
            continue
        seen.add(k)
        out.append(snap["classes"][k])
        todo += snap["classes"][k]["bases"]
    return out


def _find_method(snap: dict[str, Any], key: str, name: str) -> dict[str, Any] | None:
    return next((c["methods"][name] for c in _chain(snap, key) if name in c["methods"]), None)


def _has_member(snap: dict[str, Any], key: str, name: str) -> bool:
    return any(name in c["members"] for c in _chain(snap, key))


def _class_key(snap: dict[str, Any], imp: Import) -> str | None:
    what = snap["imports"].get(imp.module, {}).get(imp.name, "")
    return what.split(" ", 1)[1] if what.startswith("class ") else None


def binds(params: list[list[Any]], n_pos: int, keywords: list[str]) -> str | None:
    """Why a call with `n_pos` positional arguments and `keywords` does not bind to
    `params` (without self), or None."""
    pos = [p for p in params if p[1] in ("posonly", "pos")]
    names = {p[0] for p in params if p[1] in ("pos", "kwonly")}
    if n_pos > len(pos) and not any(p[1] == "vararg" for p in params):
        return f"takes {len(pos)} positional arguments, given {n_pos}"
    unknown = [k for k in keywords if k not in names]
    if unknown and not any(p[1] == "varkw" for p in params):
        return f"has no parameter {', '.join(unknown)}"
    given = {p[0] for p in pos[:n_pos]} | set(keywords)
    missing = [p[0] for p in params if not p[2] and p[0] not in given]
    return f"requires {', '.join(missing)}, not given" if missing else None


def override_problem(base: dict[str, Any], ours: dict[str, Any]) -> str | None:
    """Why vLLM's calls of `base` would not bind to `ours`, or None."""
    if base["kind"] != ours["kind"]:
        return f"is a {ours['kind']}, vLLM's is a {base['kind']}"
    if base["kind"] == "property":
        return None
    skip = 0 if base["kind"] == "staticmethod" else 1
    b, o = base["params"][skip:], ours["params"][skip:]
    o_pos = [p for p in o if p[1] in ("posonly", "pos")]
    o_var = any(p[1] == "vararg" for p in o)
    o_varkw = any(p[1] == "varkw" for p in o)
    o_names = {p[0]: p for p in o if p[1] in ("pos", "kwonly")}
    matched: set[str] = set()
    for i, p in enumerate(q for q in b if q[1] in ("posonly", "pos")):
        if i >= len(o_pos):
            if not o_var:
                return f"does not take {p[0]} (parameter {i + 1}), which vLLM passes"
            continue
        mine = o_pos[i]
        matched.add(mine[0])
        if mine[0] != p[0] and p[1] != "posonly" and not o_varkw:
            return f"names parameter {i + 1} {mine[0]!r}, vLLM's is {p[0]!r} (and may " \
                   "pass it by name)"
        if p[2] and not mine[2]:
            return f"requires {mine[0]}, which vLLM may leave out (it has a default there)"
    for p in (q for q in b if q[1] == "kwonly"):
        if p[0] in o_names:
            matched.add(p[0])
            if p[2] and not o_names[p[0]][2]:
                return f"requires {p[0]}, which vLLM may leave out"
        elif not o_varkw:
            return f"does not take keyword {p[0]}, which vLLM passes"
    for kind, what in (("vararg", "*args"), ("varkw", "**kwargs")):
        if any(q[1] == kind for q in b) and not any(q[1] == kind for q in o):
            return f"does not take {what}, which vLLM's signature passes on"
    extra = [p[0] for p in o if p[0] not in matched and p[1] in ("pos", "posonly", "kwonly")
             and not p[2]]
    return f"requires {', '.join(extra)}, which vLLM does not pass" if extra else None


def check(snap: dict[str, Any], ours: Surface) -> tuple[list[str], list[str]]:
    """(errors, notes) of the connector against one version's snapshot."""
    errors: list[str] = []
    notes: list[str] = []
    by_local = {i.local: i for i in ours.imports}
    for imp in ours.imports:
        what = snap["imports"].get(imp.module, {}).get(imp.name)
        text = f"from {imp.module} import {imp.name}"
        if what is None:
            errors.append(f"{text}: not in the snapshot (regenerate: python tools/vllm_api.py "
                          "snapshot)")
        elif what in ("missing", "no module"):
            msg = f"{text}: {'no such module' if what == 'no module' else 'no such name'}"
            if imp.how == "runtime":
                errors.append(msg)
            else:
                why = "a fallback handles it" if imp.how == "optional" else "typing only"
                notes.append(f"{msg} ({why})")
    for cls in ours.classes:
        keys = [k for k in (_class_key(snap, by_local[b]) for b in cls.bases) if k]
        if not keys:
            continue  # its base is missing: reported with the imports
        key = keys[0]
        where = f"{cls.name} ({cls.file})"
        for name, sig in cls.methods.items():
            base = _find_method(snap, key, name)
            if base is None:
                if name in MUST_OVERRIDE:
                    notes.append(f"{where}.{name}: not in vLLM's {key.rsplit('.', 1)[1]} "
                                 "(never called there)")
                continue
            problem = override_problem(base, sig)
            if problem:
                errors.append(f"{where}.{name} {problem}")
        for chain_cls in _chain(snap, key):
            for name, sig in chain_cls["methods"].items():
                if sig["abstract"] and name not in cls.defines and not any(
                        name in c["methods"] and not c["methods"][name]["abstract"]
                        for c in _chain(snap, key)):
                    errors.append(f"{where} does not define {name}, abstract in vLLM's base")
        for name, reason in MUST_OVERRIDE.items():
            if _find_method(snap, key, name) is not None and name not in cls.methods:
                errors.append(f"{where} must override {name}: {reason}")
        for attr, line in sorted(cls.self_reads.items()):
            if attr not in cls.defines and not _has_member(snap, key, attr):
                errors.append(f"{cls.file}:{line}: self.{attr}: not in vLLM's "
                              f"{key.rsplit('.', 1)[1]} or its bases")
        for name, n_pos, kws, line in cls.super_calls:
            base = _find_method(snap, key, name)
            if base is None:
                errors.append(f"{cls.file}:{line}: super().{name}: not in vLLM's base")
            elif why := binds(base["params"][0 if base["kind"] == "staticmethod" else 1:],
                              n_pos, kws):
                errors.append(f"{cls.file}:{line}: super().{name}(...): vLLM's {why}")
    for local, n_pos, kws, where in ours.calls:
        imp = by_local[local]
        what = snap["imports"].get(imp.module, {}).get(imp.name, "")
        params = None
        if what.startswith("function "):
            params = snap["functions"][what.split(" ", 1)[1]]["params"]
        elif what.startswith("class "):
            key = what.split(" ", 1)[1]
            init = _find_method(snap, key, "__init__")
            if init is not None:
                params = init["params"][1:]
            elif snap["classes"][key]["fields"]:  # a dataclass or struct: its fields
                fields = [f for c in reversed(_chain(snap, key)) for f in c["fields"]]
                params = [[f.split(":")[0], "pos", f.endswith(":1")] for f in fields]
        if params is not None and (why := binds(params, n_pos, kws)):
            errors.append(f"{where}: {imp.name}(...): vLLM's {why}")
    for dotted, attrs in USED_ATTRIBUTES.items():
        module, name = dotted.rsplit(".", 1)
        what = snap["imports"].get(module, {}).get(name, "missing")
        if not what.startswith("class "):
            errors.append(f"{dotted}: no such class")
            continue
        key = what.split(" ", 1)[1]
        unchecked = set(attrs) - set(snap["classes"].get(key, {}).get("checked", attrs))
        if unchecked:
            errors.append(f"{name}.{', '.join(sorted(unchecked))}: not in the snapshot "
                          "(regenerate: python tools/vllm_api.py snapshot)")
        missing = [a for a in attrs if not _has_member(snap, key, a)]
        if missing:
            errors.append(f"{name}.{', '.join(missing)}: not in vLLM's {name}")
    return errors, notes


# -- fetching and the command line --------------------------------------------------------
def fetch(version: str, cache: Path = CACHE) -> tuple[Path, str, str]:
    """vLLM `version`'s sdist from PyPI into `cache` (once), its sha256 checked against the
    index's: (path, sha256, url)."""
    req = urllib.request.Request(INDEX, headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        files = json.loads(r.read())["files"]
    entry = next((f for f in files if f["filename"] == f"vllm-{version}.tar.gz"), None)
    if entry is None:
        raise SystemExit(f"vllm_api: no sdist vllm-{version}.tar.gz on {INDEX}")
    path = cache / entry["filename"]
    want = entry["hashes"]["sha256"]
    if not path.is_file() or _sha256(path) != want:
        cache.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".part")
        urllib.request.urlretrieve(entry["url"], tmp)
        if _sha256(tmp) != want:
            raise SystemExit(f"vllm_api: {entry['filename']}: sha256 differs from the index's")
        tmp.replace(path)
    return path, want, str(entry["url"]).split("#")[0]


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _dump(value: Any, depth: int = 0) -> str:
    """JSON with an object per line down to a method's signature (diffs stay readable)."""
    if not isinstance(value, dict) or not value or depth >= 6:
        return json.dumps(value, sort_keys=True, separators=(",", ":"))
    pad = " " * (depth + 1)
    items = [f"{pad}{json.dumps(k)}: {_dump(v, depth + 1)}" for k, v in sorted(value.items())]
    return "{\n" + ",\n".join(items) + "\n" + " " * depth + "}"


def load_snapshot(path: Path = SNAPSHOT) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(path.read_text("utf-8"))
    return data


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    snap = sub.add_parser("snapshot", help="fetch the sdists and write the snapshot")
    snap.add_argument("--versions", default=",".join(VERSIONS))
    snap.add_argument("--out", type=Path, default=SNAPSHOT)
    sub.add_parser("check", help="the connector against every version of the snapshot")
    args = ap.parse_args()
    ours = surface()
    if args.cmd == "snapshot":
        versions: dict[str, Any] = {}
        for v in [x for x in args.versions.split(",") if x]:
            path, sha, url = fetch(v)
            versions[v] = {"release": {"file": path.name, "sha256": sha, "url": url},
                           **extract(Source(path), ours)}
            print(f"{v}: {path.name} sha256 {sha[:16]}...", file=sys.stderr)
        out = {"generated_by": "python tools/vllm_api.py snapshot", "versions": versions}
        args.out.write_text(_dump(out) + "\n", "utf-8")
        print(f"wrote {args.out} ({args.out.stat().st_size} bytes)", file=sys.stderr)
        return 0
    failed = False
    for v, data in load_snapshot()["versions"].items():
        errors, notes = check(data, ours)
        failed |= bool(errors)
        print(f"vLLM {v}: {'FAIL' if errors else 'ok'}")
        for line in errors:
            print(f"  error: {line}")
        for line in notes:
            print(f"  note: {line}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
