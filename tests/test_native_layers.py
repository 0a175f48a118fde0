"""The native components in layers: every call inside each points down.

A component is a directory of C files built into one program or library:
libivshm (native/src), the Open MPI BTL (native/btl), the libfabric
provider (native/provider) and the ivshmem-server (native/server). COMPONENTS declares each one's modules
from the bottom up (docs/ARCHITECTURE.md shows the same orders); adding
a component is one more entry there. A module is a .c file with the
header of the same name (ring.c + ring.h), or a header alone (layout.h,
btl_ivshmem.h, the provider's fiv.h). A function of a module -- out of line in its .c, or
static inline in its header -- may call, or take the address of,
functions and variables of its own module and of modules in lower layers
only; modules of one layer do not reach each other; a module includes
only headers of its own and of lower layers. Files only the tests and
fuzzers include (libivshm's internal.h) belong to no layer, and no file
of the component includes them. A variable may belong to the module
that declares it rather than the one that defines it (`state`): the
BTL's component and module structures, which Open MPI finds by name,
are defined with the tables that point at the top layers' entry points
and hold the state every layer reads; so is the provider's structure,
which every layer logs through, and its parameters, which fi_prov_ini
fills in and every layer reads.

The BTL, the provider and the server reach libivshm only through its
public headers: they include no header of native/src, and every
function or variable of libivshm they use is declared in the headers
they are allowed (native/include/ivshm.h; ivshm_admin.h too for the
server).

The call graph is read in two ways, and both must keep the order:
- from the sources: every function definition (comments, strings and
  preprocessor lines removed) and the names in its body that are
  functions or variables defined in another module. This sees the
  static inline helpers in headers, which an object file shows only as
  calls of the .c file that inlined them.
- from the objects of the last build (build/native, `make build`): `nm`
  lists the symbols each object uses but does not define, and the
  object that defines each one (of the component, or of libivshm). This
  sees what the compiler made of macros and inlining.
A cycle between files is reported as such.
"""

from __future__ import annotations

import functools
import re
import shutil
import subprocess
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, FrozenSet, Iterator, List, Set, Tuple

import pytest

REPO = Path(__file__).resolve().parent.parent
NATIVE = REPO / "native"
BUILD = REPO / "build" / "native"


@dataclass(frozen=True)
class Component:
    name: str
    src: Path                         # its directory
    layers: List[List[str]]           # module names (file stems), bottom up
    objects: Path                     # where the last build left its .c.o
    public: Tuple[str, ...] = ()      # libivshm's headers it may include
    for_tests: FrozenSet[str] = frozenset()
    # variables defined by one module (with their initializers pointing
    # up) that belong to the module declaring them: name -> that module
    state: Dict[str, str] = field(default_factory=dict)
    # (module, function, name used) the source reading must find, so the
    # checks cannot pass on nothing
    sees: Tuple[Tuple[str, str, str], ...] = ()
    # a module whose object nm must find using another module's symbols
    calls_out: str = ""
    level: Dict[str, int] = field(init=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "level", {
            m: i for i, layer in enumerate(self.layers) for m in layer})

    def files(self) -> List[Path]:
        return sorted(self.src.glob("*.[ch]"))

    def allowed(self, frm: str, to: str) -> bool:
        return frm == to or self.level[to] < self.level[frm]


LIBIVSHM = Component(
    name="libivshm",
    src=NATIVE / "src",
    # see docs/ARCHITECTURE.md, "native core"
    layers=[
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
    ],
    objects=BUILD / "CMakeFiles" / "ivshm_objs.dir" / "src",
    public=("ivshm", "ivshm_admin"),   # its own
    for_tests=frozenset({"internal"}),  # the tests' and fuzzers' header
    sees=(("send", "send_msg", "ivshm_ring_send"),
          ("ring", "tx_done", "ivshm_kick"),
          ("registry", "ivshm_registry_claim", "ivshm_windows_on_leave"),
          ("doorbell_eventfd", "ivshm_db_server_new", "ivshm_now_ns")),
    calls_out="send",
)

BTL = Component(
    name="btl",
    src=NATIVE / "btl",
    # see docs/ARCHITECTURE.md, "native core" and docs/btl.md
    layers=[
        ["btl_ivshmem"],             # types, state; clock, job ids, slot arrays
        ["btl_ivshmem_frag",         # send fragments and their queues
         "btl_ivshmem_copy",         # a large payload into its slot
         "btl_ivshmem_peer"],        # the modex check; a peer's failure
        ["btl_ivshmem_progress"],    # receive, trust, retries, completions
        ["btl_ivshmem_send"],        # alloc/free/prepare_src/send/sendi
        ["btl_ivshmem_module"],      # add/del procs, finalize
        ["btl_ivshmem_component"],   # MCA parameters, init, open/close
    ],
    objects=BUILD / "btl" / "CMakeFiles" / "mca_btl_ivshmem.dir",
    public=("ivshm",),
    # Open MPI finds the component by its name and takes the module from
    # its init: both are defined with the tables that point at the top
    # layers' entry points, and carry the state every layer reads
    state={"mca_btl_ivshmem_component": "btl_ivshmem",
           "mca_btl_ivshmem": "btl_ivshmem"},
    sees=(("btl_ivshmem_send", "mca_btl_ivshmem_send",
           "mca_btl_ivshmem_send_refused"),
          ("btl_ivshmem_progress", "receive_error",
           "mca_btl_ivshmem_peer_failed"),
          ("btl_ivshmem_module", "say_goodbye", "mca_btl_ivshmem_drain"),
          ("btl_ivshmem_copy", "mca_btl_ivshmem_copy_to_slot",
           "mca_btl_ivshmem_now_ns")),
    calls_out="btl_ivshmem_send",
)

PROVIDER = Component(
    name="provider",
    src=NATIVE / "provider",
    # see docs/ARCHITECTURE.md, "native core" and docs/provider.md
    layers=[
        ["fiv_mac"],                 # SipHash: the MAC of introductions
        ["fiv"],                     # objects, wire protocol, inline helpers
        ["fiv_util"],                # parameters' values, clock, error texts
        ["fiv_report",               # the one report line per process
         "fiv_complete",             # completions into CQs and counters
         "fiv_tables",               # peers by id, AV names, bound endpoints
         "fiv_mr",                   # registrations, looked up by key
         "fiv_send"],                # one message out on a region/core path
        ["fiv_intro"],               # keys, an introduction before a first send
        ["fiv_tx"],                  # fragments and queues, per peer
        ["fiv_trigger"],             # triggered operations: wait, then start
        ["fiv_rma"],                 # RMA and atomics, both sides
        ["fiv_msg"],                 # receives: posting, matching, delivery
        ["fiv_probe"],               # message counts, probes, broken paths
        ["fiv_delegate"],            # the core provider and its arrivals
        ["fiv_drain"],               # attach; a pair moved to the core and back
        ["fiv_progress"],            # admission, receive loop, queued sends
        ["fiv_msg_ops",              # sends, the msg and tagged tables
         "fiv_cq", "fiv_cntr",       # CQ and counter objects (they progress)
         "fiv_eq", "fiv_getinfo",    # EQ; the fi_info answered
         "fiv_alias"],               # alias endpoints (fi_ep_alias)
        ["fiv_ep"],                  # the endpoint: binds, opens, closes
        ["fiv_av"],                  # the AV: inserting resolves endpoints' peers
        ["fiv_domain"],              # the domain's table; auto progress
        ["fiv_init"],                # fi_prov_ini, parameters, the fabric
    ],
    objects=BUILD / "provider" / "CMakeFiles" / "ivshm-fi.dir",
    public=("ivshm",),
    # libfabric takes the provider from fi_prov_ini: it is defined with
    # the table that points at the top layers' entry points and every
    # layer logs through it; the parameters are filled in at the top and
    # read by every layer
    state={"fiv_prov": "fiv", "fiv_cfg": "fiv"},
    sees=(("fiv_msg_ops", "send_msg", "fiv_tx_small"),
          ("fiv_tx", "region_frag", "fiv_introduce"),
          ("fiv_intro", "fiv_introduce", "fiv_region_send"),
          ("fiv_progress", "take_message", "fiv_deliver"),
          ("fiv_probe", "fiv_path_broken", "fiv_peer_failed"),
          ("fiv_cq", "cq_readfrom", "fiv_progress_eps"),
          ("fiv_av", "av_insert", "fiv_ep_resolve")),
    calls_out="fiv_msg_ops",
)

SERVER = Component(
    name="server",
    src=NATIVE / "server",
    # see docs/ARCHITECTURE.md, "native core"
    layers=[
        ["log"],                     # stderr, syslog or nothing
        ["ids",                      # doorbell ids, reused only when safe
         "budget",                   # per-uid and per-process budgets
         "marker"],                  # the thread marking leavers dead
        ["server"],                  # the socket, the region, the clients
        ["main"],                    # options, daemon, signals
    ],
    objects=BUILD / "CMakeFiles" / "ivshmem-server.dir" / "server",
    public=("ivshm", "ivshm_admin"),
    sees=(("budget", "log_refusal", "ivs_log_error"),
          ("server", "remove_client", "ivs_marker_push"),
          ("server", "start_accounting", "ivs_ids_new"),
          ("main", "main", "ivs_server_run")),
    calls_out="main",
)

COMPONENTS = [LIBIVSHM, BTL, PROVIDER, SERVER]
USERS = [c for c in COMPONENTS if c is not LIBIVSHM]  # of libivshm


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
    if not words or words[0] in ("typedef", "_Static_assert") \
            or "extern" in words or "{" in words:
        return set()  # declared elsewhere, a type, or a type's definition
    if len(words) >= 2 and words[-2] in ("struct", "union", "enum"):
        return set()  # a type declared ahead
    for j in range(len(words) - 4):
        if words[j:j + 2] == ["(", "*"] and words[j + 3:j + 5] == [")", "("]:
            return {words[j + 2]}  # a pointer to a function
    if "(" in words:
        return set()  # a prototype
    names = [w for w in words if re.match(r"[A-Za-z_]\w*$", w) and
             w not in KEYWORDS]
    return {names[-1]} if names else set()


class Source:
    """What a component defines, and what each definition refers to."""

    def __init__(self, files: List[Path], state: Dict[str, str]) -> None:
        self.files = files
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
        self.visible.update(state)

    def uses(self) -> Iterator[Tuple[Path, int, str, str]]:
        """(file, line, function, name) for every name a function body
        uses that is not its own file's static helper or local, nor a
        member or a type's name."""
        for f, fn, body in self.bodies:
            for k, (tok, line) in enumerate(body):
                if k and body[k - 1][0] in (".", "->", "struct", "enum",
                                            "union"):
                    continue  # a member, or a type's name
                if tok in self.local[f] and f.suffix == ".c":
                    continue  # its own file's (a static helper, a local)
                yield f, line, fn, tok

    def edges(self) -> Iterator[Tuple[Path, int, str, str, str]]:
        """(file, line, function, name used, module defining it) for every
        use of another module's function or variable."""
        for f, line, fn, tok in self.uses():
            target = self.visible.get(tok)
            if target and target != _module(f):
                yield f, line, fn, tok, target

    def includes(self) -> Iterator[Tuple[Path, int, str]]:
        for f in self.files:
            for lineno, line in enumerate(f.read_text().split("\n"), 1):
                m = re.match(r'\s*#\s*include\s+"([^"]+)"', line)
                if m:
                    yield f, lineno, m.group(1)


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


_SOURCES: Dict[str, Source] = {}


def _source(comp: Component) -> Source:
    if comp.name not in _SOURCES:
        _SOURCES[comp.name] = Source(comp.files(), comp.state)
    return _SOURCES[comp.name]


def _public_names(headers: Tuple[str, ...]) -> Set[str]:
    """Every name the given public headers of libivshm mention."""
    names: Set[str] = set()
    for h in headers:
        text = _strip((NATIVE / "include" / f"{h}.h").read_text())
        names.update(t for t, _ in _tokens(text))
    return names


def _rel(f: Path) -> str:
    return str(f.relative_to(REPO))


def _ours(comp: Component, f: Path) -> bool:
    """A file of the component proper (not one for the tests only)."""
    return _module(f) not in comp.for_tests


by_component = pytest.mark.parametrize("comp", COMPONENTS,
                                       ids=lambda c: c.name)
by_user = pytest.mark.parametrize("comp", USERS, ids=lambda c: c.name)


@by_component
def test_every_file_has_a_layer(comp):
    modules = {_module(f) for f in comp.files()} - comp.for_tests
    assert sorted(modules - set(comp.level)) == [], \
        f"files of {_rel(comp.src)} missing from its layers"
    assert sorted(set(comp.level) - modules) == [], \
        f"layers name modules that {_rel(comp.src)} does not have"


@by_component
def test_the_parser_sees_the_calls(comp):
    """The source reading finds calls it must find (else the checks below
    would pass on nothing)."""
    source = _source(comp)
    seen = {(_module(f), fn, tok) for f, _, fn, tok, _ in source.edges()}
    assert sorted(set(comp.sees) - seen) == []
    assert len(seen) > 10


def test_the_parser_sees_libivshm_internals():
    assert "ivshm_sweep_test_hook" in _source(LIBIVSHM).visible
    assert len(_source(LIBIVSHM).bodies) > 200


@by_component
def test_state_is_declared_below(comp):
    """A variable given to a lower module (`state`) is defined by the
    component and declared in that module's header."""
    defined = Source(comp.files(), {}).visible
    for name, module in comp.state.items():
        assert name in defined, f"{name} is not defined in {_rel(comp.src)}"
        header = comp.src / f"{module}.h"
        assert name in {tok for tok, _ in _tokens(_strip(header.read_text()))}, \
            f"{name} is not declared in {_rel(header)}"


@by_component
def test_calls_point_down(comp):
    bad = [f"{_rel(f)}:{line}: {fn} uses {tok} of {to} "
           f"(layer {comp.level[to]} >= {comp.level[_module(f)]})"
           for f, line, fn, tok, to in _source(comp).edges()
           if _ours(comp, f) and not comp.allowed(_module(f), to)]
    assert bad == []


def _elsewhere(comp: Component, f: Path, header: str) -> bool:
    """Whether a quoted include names a header of native/ that is neither
    the component's own nor one of the public headers it may use."""
    name = Path(header).name
    if name in {g.name for g in comp.files()} or \
            Path(header).stem in comp.public:
        return False
    there = (f.parent / header).resolve()
    return there.exists() and there.is_relative_to(NATIVE) or \
        name in _native_headers()


@functools.lru_cache(maxsize=None)
def _native_headers() -> FrozenSet[str]:
    return frozenset(f.name for f in NATIVE.rglob("*.h"))


@by_component
def test_includes_point_down(comp):
    own = {_module(f) for f in comp.files()}
    bad = []
    for f, line, header in _source(comp).includes():
        stem = Path(header).stem
        if not _ours(comp, f):
            continue
        if stem in comp.for_tests or _elsewhere(comp, f, header) or (
                stem in own and not comp.allowed(_module(f), stem)):
            bad.append(f"{_rel(f)}:{line}: includes {header}")
    assert bad == []


@by_component
def test_no_cycles_between_files(comp):
    graph: Dict[str, Set[str]] = defaultdict(set)
    for f, _, _, _, to in _source(comp).edges():
        if _ours(comp, f):
            graph[_module(f)].add(to)
    assert _cycles(graph) == []


@by_user
def test_public_only(comp):
    """Every function or variable of libivshm the component uses is
    declared in a public header it may include (test_includes_point_down
    refuses the others)."""
    public = _public_names(comp.public)
    lib = _source(LIBIVSHM).visible
    source = _source(comp)
    bad = [f"{_rel(f)}:{line}: {fn} uses {tok} of libivshm's {lib[tok]}"
           for f, line, fn, tok in source.uses()
           if tok in lib and tok not in source.visible and tok not in public]
    assert bad == []
    assert any(tok in lib for _, _, _, tok in source.uses()), \
        "the source reading found no use of libivshm"


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


def _objects(comp: Component) -> Dict[str, Tuple[Set[str], Set[str]]]:
    """module -> (symbols defined, symbols used) of the component's
    objects in the last build."""
    if not shutil.which("nm"):
        pytest.skip("no nm (binutils)")
    objs = {_module(Path(o.name[:-len(".o")])): o
            for o in comp.objects.glob("*.c.o")
            if (comp.src / o.name[:-len(".o")]).exists()}
    if not objs:
        pytest.skip(f"no build of {_rel(comp.src)} in build/native "
                    "(make build)")
    return {m: _nm(o) for m, o in objs.items()}


@by_component
def test_objects_agree(comp):
    """The same order, from the symbols of the built objects."""
    table = _objects(comp)
    owner = {sym: m for m, (defined, _) in table.items() for sym in defined}
    owner.update(comp.state)
    graph: Dict[str, Set[str]] = defaultdict(set)
    bad = []
    for m, (_, used) in sorted(table.items()):
        for sym in sorted(used):
            to = owner.get(sym)
            if to is None or to == m:
                continue  # libc, Open MPI, libivshm, or its own
            graph[m].add(to)
            if not comp.allowed(m, to):
                bad.append(f"{m}.o uses {sym} of {to}.o")
    assert bad == []
    assert _cycles(graph) == []
    assert graph[comp.calls_out], "nm found no calls between the objects"


@by_user
def test_objects_use_public_symbols_only(comp):
    """What the component's objects take from libivshm's is declared in
    the public headers it may include."""
    lib = {sym: m for m, (defined, _) in _objects(LIBIVSHM).items()
           for sym in defined}
    public = _public_names(comp.public)
    table = _objects(comp)
    bad = [f"{m}.o uses {sym} of libivshm's {lib[sym]}.o"
           for m, (_, used) in sorted(table.items()) for sym in sorted(used)
           if sym in lib and sym not in public]
    assert bad == []
    assert any(sym in lib for _, used in table.values() for sym in used), \
        "nm found no use of libivshm"
