"""libivshm's files in layers: every call inside native/src points down.

A module is a .c file of native/src with the header of the same name
(ring.c + ring.h), or a header alone (layout.h, attachment.h). LAYERS
lists the modules from the bottom up (docs/ARCHITECTURE.md shows the
same order). A function of a module -- out of line in its .c, or static
inline in its header -- may call, or take the address of, functions and
variables of its own module and of modules in lower layers only; modules
of one layer do not reach each other; a module includes only headers of
its own and of lower layers. internal.h gathers every header for the C
tests and the fuzzers, and no file of the library includes it.

The call graph is read in two ways, and both must keep the order:
- from the sources: every function definition (comments, strings and
  preprocessor lines removed) and the names in its body that are
  functions or variables defined in another module. This sees the
  static inline helpers in headers, which an object file shows only as
  calls of the .c file that inlined them.
- from the objects of the last build (build/native, `make build`): `nm`
  lists the symbols each object of libivshm uses but does not define,
  and the object that defines each one. This sees what the compiler
  made of macros and inlining.
A cycle between files is reported as such.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from collections import defaultdict
from pathlib import Path
from typing import Dict, Iterator, List, Set, Tuple

import pytest

REPO = Path(__file__).resolve().parent.parent
SRC = REPO / "native" / "src"
OBJECTS = REPO / "build" / "native" / "CMakeFiles" / "ivshm_objs.dir" / "src"

# From the bottom up; see docs/ARCHITECTURE.md, "native core".
LAYERS: List[List[str]] = [
    ["layout", "error"],         # the region's format; error texts
    ["attachment"],              # the handle, where things lie
    ["clock"],                   # time, deadlines
    ["region"],                  # layout computed, formatted, mapped
    ["window_table"],            # window tables; a leaver's holds released
    ["registry"],                # peer entries: claim, liveness, dead
    ["doorbell"],                # sleeping/may_sleep: wait and kick
    ["doorbell_futex", "doorbell_uio", "doorbell_eventfd",  # backends
     "ring"],                    # a fast channel's SPSC ring
    ["channel"],                 # fast channel descriptors
    ["peer_local"],              # what we keep per peer, incarnations
    ["queue"],                   # the receive queue
    ["rx_area"],                 # our receive area: reset, sweep, repair
    ["send", "recv", "window"],  # the message and window API
    ["attach"],                  # join, reap, attach by path, detach
    ["attach_server", "admin"],  # attach through a server; the admin API
]
FOR_TESTS = {"internal"}  # headers only the tests and fuzzers include

LEVEL: Dict[str, int] = {m: i for i, layer in enumerate(LAYERS)
                         for m in layer}


def _module(path: Path) -> str:
    return path.stem


def _strip(text: str) -> str:
    """The source without comments, string and character literals, and
    preprocessor lines (line breaks kept, so line numbers hold)."""
    out = []
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if text.startswith("/*", i):
            j = text.find("*/", i + 2)
            j = n if j < 0 else j + 2
            out.append("\n" * text.count("\n", i, j))
            i = j
        elif text.startswith("//", i):
            j = text.find("\n", i)
            i = n if j < 0 else j
        elif c in "\"'":
            j = i + 1
            while j < n and text[j] != c:
                j += 2 if text[j] == "\\" else 1
            out.append(c + c)
            i = j + 1
        else:
            out.append(c)
            i += 1
    lines = "".join(out).split("\n")
    cleaned, continued = [], False
    for line in lines:
        directive = continued or line.lstrip().startswith("#")
        continued = directive and line.endswith("\\")
        cleaned.append("" if directive else line)
    return "\n".join(cleaned)


TOKEN = re.compile(r"[A-Za-z_]\w*|->|\S")


def _tokens(text: str) -> List[Tuple[str, int]]:
    toks = []
    for lineno, line in enumerate(text.split("\n"), 1):
        toks.extend((m.group(0), lineno) for m in TOKEN.finditer(line))
    return toks


def _definitions(path: Path) -> Iterator[Tuple[str, bool, List]]:
    """(name, static, body tokens) of every function defined in a file,
    and ("", False, tokens) for each top-level declaration (variables)."""
    toks = _tokens(_strip(path.read_text()))
    i, start = 0, 0
    while i < len(toks):
        t = toks[i][0]
        if t == ";":
            yield "", False, toks[start:i]
            start = i + 1
        elif t == "{":
            head = [x for x, _ in toks[start:i]]
            end = _matching(toks, i)
            if head and head[-1] == ")" and "=" not in head:
                open_at = _open_paren(head)
                if open_at > 0 and re.match(r"[A-Za-z_]", head[open_at - 1]):
                    static = "static" in head or "IVSHM_HOT_INLINE" in head
                    yield head[open_at - 1], static, toks[i:end + 1]
                start = end + 1
                i = end + 1
                continue
            i = end  # struct/enum/initializer body: up to the ';' after
        i += 1


def _matching(toks, i: int) -> int:
    depth = 0
    for j in range(i, len(toks)):
        depth += {"{": 1, "}": -1}.get(toks[j][0], 0)
        if depth == 0:
            return j
    return len(toks) - 1


def _open_paren(head: List[str]) -> int:
    """Index of the '(' that matches the final ')' of a function head."""
    depth = 0
    for j in range(len(head) - 1, -1, -1):
        depth += {")": 1, "(": -1}.get(head[j], 0)
        if depth == 0:
            return j
    return -1


KEYWORDS = {"static", "extern", "const", "volatile", "inline", "unsigned",
            "signed", "int", "char", "void", "bool", "long", "short",
            "_Atomic", "struct", "enum", "union", "typedef"}


def _globals(tokens) -> Set[str]:
    """The variable a top-level declaration defines, if any: `T name;`,
    `T *name = x;`, `T (*name)(args);`. Prototypes, types and extern
    declarations define none."""
    words = [t for t, _ in tokens]
    if "=" in words:
        words = words[:words.index("=")]
    if not words or words[0] in ("extern", "typedef", "_Static_assert") \
            or "{" in words:
        return set()  # declared elsewhere, a type, or a type's definition
    for j in range(len(words) - 4):
        if words[j:j + 2] == ["(", "*"] and words[j + 3:j + 5] == [")", "("]:
            return {words[j + 2]}  # a pointer to a function
    if "(" in words:
        return set()  # a prototype
    names = [w for w in words if re.match(r"[A-Za-z_]\w*$", w) and
             w not in KEYWORDS]
    return {names[-1]} if names else set()


class Source:
    """What native/src defines, and what each definition refers to."""

    def __init__(self) -> None:
        self.files = sorted(SRC.glob("*.[ch]"))
        # name -> module, for what other files can see: non-static
        # definitions in .c files, and everything defined in headers
        self.visible: Dict[str, str] = {}
        self.local: Dict[Path, Set[str]] = defaultdict(set)
        self.bodies: List[Tuple[Path, str, List]] = []
        for f in self.files:
            for name, static, body in _definitions(f):
                if not name:
                    for g in _globals(body):
                        self.local[f].add(g)
                        self.visible.setdefault(g, _module(f))
                    continue
                self.local[f].add(name)
                if f.suffix == ".h" or not static:
                    self.visible[name] = _module(f)
                self.bodies.append((f, name, body))

    def edges(self) -> Iterator[Tuple[Path, int, str, str, str]]:
        """(file, line, function, name used, module defining it) for every
        use of another module's function or variable."""
        for f, fn, body in self.bodies:
            for k, (tok, line) in enumerate(body):
                if k and body[k - 1][0] in (".", "->", "struct", "enum",
                                            "union"):
                    continue  # a member, or a type's name
                if tok in self.local[f] and f.suffix == ".c":
                    continue  # its own file's (a static helper, a local)
                target = self.visible.get(tok)
                if target and target != _module(f):
                    yield f, line, fn, tok, target

    def includes(self) -> Iterator[Tuple[Path, int, str]]:
        for f in self.files:
            for lineno, line in enumerate(f.read_text().split("\n"), 1):
                m = re.match(r'\s*#\s*include\s+"([^"]+)\.h"', line)
                if m:
                    yield f, lineno, m.group(1)


def _allowed(frm: str, to: str) -> bool:
    return frm == to or LEVEL[to] < LEVEL[frm]


def _cycles(graph: Dict[str, Set[str]]) -> List[List[str]]:
    """Strongly connected components of more than one module."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


@pytest.fixture(scope="module")
def source() -> Source:
    return Source()


def _rel(f: Path) -> str:
    return str(f.relative_to(REPO))


def test_every_file_has_a_layer(source):
    modules = {_module(f) for f in source.files} - FOR_TESTS
    assert sorted(modules - set(LEVEL)) == [], \
        "files of native/src missing from LAYERS"
    assert sorted(set(LEVEL) - modules) == [], \
        "LAYERS names modules that native/src does not have"


def test_the_parser_sees_the_calls(source):
    """The source reading finds calls it must find (else the checks below
    would pass on nothing)."""
    seen = {(_module(f), fn, tok) for f, _, fn, tok, _ in source.edges()}
    assert ("send", "send_msg", "ivshm_ring_send") in seen
    assert ("ring", "tx_done", "ivshm_kick") in seen
    assert ("registry", "ivshm_registry_claim", "ivshm_windows_on_leave") in seen
    assert ("doorbell_eventfd", "ivshm_db_server_new", "ivshm_now_ns") in seen
    assert "ivshm_sweep_test_hook" in source.visible
    assert len(source.bodies) > 200


def test_calls_point_down(source):
    bad = [f"{_rel(f)}:{line}: {fn} uses {tok} of {to} "
           f"(layer {LEVEL[to]} >= {LEVEL[_module(f)]})"
           for f, line, fn, tok, to in source.edges()
           if _module(f) not in FOR_TESTS and not _allowed(_module(f), to)]
    assert bad == []


def test_includes_point_down(source):
    bad = []
    for f, line, header in source.includes():
        frm = _module(f)
        if frm in FOR_TESTS or header == "ivshm" or header == "ivshm_admin":
            continue
        if header in FOR_TESTS or header not in LEVEL or \
                not _allowed(frm, header):
            bad.append(f"{_rel(f)}:{line}: includes {header}.h")
    assert bad == []


def test_no_cycles_between_files(source):
    graph: Dict[str, Set[str]] = defaultdict(set)
    for f, _, _, _, to in source.edges():
        if _module(f) not in FOR_TESTS:
            graph[_module(f)].add(to)
    assert _cycles(graph) == []


def _nm(obj: Path) -> Tuple[Set[str], Set[str]]:
    out = subprocess.run(["nm", str(obj)], capture_output=True, text=True,
                         check=True).stdout
    defined, used = set(), set()
    for line in out.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[0] == "U":
            used.add(parts[1])
        elif len(parts) == 3 and parts[1] in "TDBRCV":
            defined.add(parts[2])
    return defined, used


def test_objects_agree():
    """The same order, from the symbols of the built objects."""
    if not shutil.which("nm"):
        pytest.skip("no nm (binutils)")
    objs = {_module(Path(o.name[:-len(".o")])): o
            for o in OBJECTS.glob("*.c.o")
            if (SRC / o.name[:-len(".o")]).exists()}
    if not objs:
        pytest.skip("no build of libivshm in build/native (make build)")
    table = {m: _nm(o) for m, o in objs.items()}
    owner = {sym: m for m, (defined, _) in table.items() for sym in defined}
    graph: Dict[str, Set[str]] = defaultdict(set)
    bad = []
    for m, (_, used) in sorted(table.items()):
        for sym in sorted(used):
            to = owner.get(sym)
            if to is None or to == m:
                continue  # libc, or its own
            graph[m].add(to)
            if not _allowed(m, to):
                bad.append(f"{m}.o uses {sym} of {to}.o")
    assert bad == []
    assert _cycles(graph) == []
    assert graph["send"], "nm found no calls between the objects"
