"""Problem files: TOML in, a validated and completed configuration out.

    title = "Permalloy bar"            # optional

    [mesh]
    shape = "box"       # box | cylinder | ellipsoid | sphere | file
    unit = "nm"         # length unit of the numbers below: nm | um | m
    size = [30, 30, 100]               # box: lx, ly, lz
    radius = 10.0                      # cylinder, sphere
    length = 50.0                      # cylinder (along z)
    semi_axes = [20, 10, 10]           # ellipsoid
    h = 3.0                            # mesh size (structured box: also
                                       # [hx, hy, hz])
    structured = false                 # box: 6 tets per cube, no gmsh
    edge_h = 0.5                       # structured box: cells of this size
                                       # at the lateral (x, y) faces,
                                       # growing to h inside
    uniform_z = false                  # structured box: m the same at
                                       # every node of a stack through
                                       # the thickness (docs/mag.md,
                                       # "Discretization")
    file = "bar.msh"                   # shape = "file": gmsh .msh, Netgen
                                       # .vol, anything meshio reads;
                                       # relative to the problem file
    scale = 1e-9                       # file: metres per file unit
                                       # (default: automatic, see mesh.load)

    [material]                         # or [[material]] with region = N
    Ms = 8.6e5          # A/m, > 0
    A = 1.3e-11         # J/m, >= 0
    alpha = 0.5         # Gilbert damping
    gamma = 2.211e5     # m/(A s)
    K1 = 0.0            # J/m^3, uniaxial; axis = [0, 0, 1]
    Kc1 = 0.0           # J/m^3, cubic; Kc2 = 0.0; cubic_axes = [[1,0,0],[0,1,0]]

    [initial]
    m = [1, 0, 1]       # uniform (normalized)
    # type = "random"; seed = 1      random directions
    # file = "run/m.vtu"              a previous snapshot (nearest node)

    [demag]             # docs/mag-demag.md
    enabled = true
    method = "auto"     # grid: P1 m on a regular grid, Newell tensor by
                        # FFT (exact for boxes and films) | dense: FEM/BEM
                        # with the dense boundary matrix | fmm: FEM/BEM,
                        # fast multipole boundary operator (O(N) memory) |
                        # auto: grid for a body that fills its bounding
                        # box, else dense while it takes at most 4 GB
                        # (22,360 surface nodes) or a third of the host's
                        # memory if more, else fmm
    grid_tol = 0.03     # grid: relative error of the demag energy the
                        # cell size is chosen for (with the mesh size)
    grid_h = 2.5        # grid: at most this cell size instead ([hx, hy,
                        # hz] too), in the mesh's unit (file meshes: nm)
    rtol = 1e-10        # FEM/BEM: Krylov tolerance of its solvers
    tol = 1e-5          # fmm: relative accuracy of the boundary operator

    [[field]]           # applied in every stage (also [[stage.field]])
    H = [0, 0, 10]
    unit = "mT"         # mT | T (both mu0 H) | A/m
    amplitude = [0, 0, 0]   # H(t) = H + amplitude sin(2 pi frequency t + phase)
    frequency = 0.0     # Hz
    phase = 0.0         # rad
    ramp = 0.0          # s: scale linearly from 0 over the stage's first ramp s
    t_on = 0.0          # s (stage time): off before
    t_off = inf         # s: off from then on

    [[stage]]
    type = "llg"        # llg | relax
    duration = 3e-10    # s (llg)
    integrator = "rk5dp"    # rk5dp | rk3bs | rk4 | bdf | beuler
    rtol = 1e-5
    atol = 1e-5
    dt = 0.0            # s: first (adaptive) or fixed step; 0 = automatic
    adaptive = true     # false: fixed step dt (rk4 always)
    order = 0           # bdf order; 0: the highest stable one for the
                        # damping (4 for alpha >= 0.35, 3 >= 0.08, else 2)
    alpha = 0.02        # overrides the materials' damping in this stage
    stop_dmdt = 0.0     # deg/ns: stop early when max |dm/dt| is below
    output_every = 1e-12    # s: table rows (and progress)
    snapshot_every = 0.0    # s: VTU snapshots (0: only at the stage's end)
    # relax stages: method = "bb" (energy minimisation) | "damping"
    # (llg with alpha = 1 until stop_dmdt); tol = 1e-6 (max |m x H| / Ms)
    # max_iter = 50000

    [output]
    vtu = true
    png = true

    [petsc]             # PETSc options database entries (no leading dash):
    mag_ts_adapt_type = "dsp"          # the LLG integrator (prefix mag_)
    demag_poisson_pc_type = "gamg"     # the demag solvers (demag.py)

Each table becomes a frozen settings object (MeshSettings, ...,
OutputSettings below: its fields are the table's keys, their types what
the TOML may give), every default filled in, in a Problem. Every table
accepts only the keys above: an unknown key, a wrong type, a bad value
(e.g. a non-positive Ms), a missing mesh file or invalid TOML raise
ProblemError, whose message is one line naming the file, the table and
the key.
"""

from __future__ import annotations

import math
import os
import typing
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np

from .constants import GAMMA0, MU0
from .errors import ProblemError
from .llg import INTEGRATORS
from .terms.demag_method import METHODS as DEMAG_METHODS

try:
    import tomllib
except ImportError:  # pragma: no cover - python < 3.11
    tomllib = None

UNITS = {"nm": 1e-9, "um": 1e-6, "m": 1.0}
SHAPES = ("box", "cylinder", "ellipsoid", "sphere", "file")
FIELD_UNITS = {"mT": 1e-3 / MU0, "T": 1.0 / MU0, "A/m": 1.0}

Vec = Tuple[float, float, float]


class Section:
    """The settings of one TOML table, validated (frozen dataclasses
    below). Its fields are the table's keys, their types what the TOML
    may give (a tuple: an array); None: not given and not applicable."""

    @classmethod
    def keys(cls) -> Dict[str, Any]:
        """key -> the TOML type(s) it takes."""
        hints = typing.get_type_hints(cls)
        return {f.name: _toml_type(hints[f.name]) for f in fields(cls)}

    @classmethod
    def of(cls, values: dict):
        return cls(**{k: _frozen(v) for k, v in values.items()})

    def to_dict(self) -> dict:
        """The table as TOML gives it (arrays as lists)."""
        return {f.name: _plain(getattr(self, f.name)) for f in fields(self)
                if getattr(self, f.name) is not None}


def _toml_type(hint):
    if typing.get_origin(hint) is Union:
        types = tuple(_toml_type(a) for a in typing.get_args(hint)
                      if a is not type(None))
        return types[0] if len(types) == 1 else types
    return list if typing.get_origin(hint) is tuple else hint


def _frozen(v):
    return tuple(_frozen(x) for x in v) if isinstance(v, list) else v


def _plain(v):
    if isinstance(v, Section):
        return v.to_dict()
    return [_plain(x) for x in v] if isinstance(v, tuple) else v


@dataclass(frozen=True)
class MeshSettings(Section):
    """[mesh]: lengths in `unit` (None for shape "file"), `file`
    absolute."""
    shape: str
    unit: Optional[str] = None
    h: Optional[Union[float, Vec]] = None
    size: Optional[Vec] = None
    structured: Optional[bool] = None
    uniform_z: Optional[bool] = None
    edge_h: Optional[float] = None
    radius: Optional[float] = None
    length: Optional[float] = None
    semi_axes: Optional[Vec] = None
    file: Optional[str] = None
    scale: Optional[float] = None

    @property
    def metres(self) -> float:
        """Metres per length unit of the problem (file meshes: nm)."""
        return UNITS[self.unit or "nm"]


@dataclass(frozen=True)
class MaterialSettings(Section):
    """[material] or one [[material]] (of the mesh region `region`)."""
    Ms: float
    region: int = 0
    name: Optional[str] = None
    A: float = 0.0
    alpha: float = 0.5
    gamma: float = GAMMA0
    K1: float = 0.0
    axis: Vec = (0.0, 0.0, 1.0)
    Kc1: float = 0.0
    Kc2: float = 0.0
    cubic_axes: Tuple[Vec, Vec] = ((1.0, 0.0, 0.0), (0.0, 1.0, 0.0))


@dataclass(frozen=True)
class InitialSettings(Section):
    """[initial]: type uniform (m), random (seed) or file."""
    type: str = "uniform"
    m: Optional[Vec] = None
    seed: Optional[int] = None
    file: Optional[str] = None


@dataclass(frozen=True)
class DemagSettings(Section):
    """[demag]; `method` as asked for (demag_method.resolve settles
    'auto' once the mesh is built), grid_h in the mesh's unit."""
    enabled: bool = True
    rtol: float = 1e-10
    method: str = "auto"
    tol: float = 1e-5
    grid_tol: Optional[float] = None
    grid_h: Optional[Union[float, Vec]] = None


@dataclass(frozen=True)
class FieldSettings(Section):
    """One [[field]] or [[stage.field]]."""
    H: Vec
    unit: str = "mT"
    amplitude: Vec = (0.0, 0.0, 0.0)
    frequency: float = 0.0
    phase: float = 0.0
    ramp: float = 0.0
    t_on: float = 0.0
    t_off: float = math.inf


@dataclass(frozen=True)
class StageSettings(Section):
    """One [[stage]]: llg (duration and the integrator's keys) or relax
    (method bb: tol, max_iter; method damping: LLG at alpha until
    stop_dmdt, some llg keys too). Keys that do not apply are None."""
    type: str
    name: str
    field: Tuple[FieldSettings, ...] = ()
    alpha: Optional[float] = None
    method: Optional[str] = None
    tol: Optional[float] = None
    max_iter: Optional[int] = None
    duration: Optional[float] = None
    integrator: Optional[str] = None
    rtol: Optional[float] = None
    atol: Optional[float] = None
    dt: Optional[float] = None
    adaptive: Optional[bool] = None
    order: Optional[int] = None
    stop_dmdt: Optional[float] = None
    output_every: Optional[float] = None
    snapshot_every: Optional[float] = None

    @property
    def minimizes(self) -> bool:
        """An energy minimisation (relax, bb), not a time integration."""
        return self.type == "relax" and self.method == "bb"


@dataclass(frozen=True)
class OutputSettings(Section):
    vtu: bool = True
    png: bool = True


TOP_KEYS = {"title": str, "mesh": dict, "material": (dict, list),
            "initial": dict, "demag": dict, "field": list, "stage": list,
            "output": dict, "petsc": dict}


def _type_name(t) -> str:
    if isinstance(t, tuple):
        return " or ".join(_type_name(x) for x in t)
    return {str: "a string", float: "a number", int: "an integer",
            bool: "true/false", list: "an array",
            dict: "a table"}.get(t, str(t))


class _Checker:
    def __init__(self, name: str):
        self.name = name

    def fail(self, msg: str):
        raise ProblemError(f"{self.name}: {msg}")

    def table(self, data: Any, keys, where: str) -> dict:
        """The keys of table `data` checked against `keys` (a dict
        key -> type(s), or a Section)."""
        if isinstance(keys, type):
            keys = keys.keys()
        if not isinstance(data, dict):
            self.fail(f"[{where}] must be a table")
        out = {}
        for key, value in data.items():
            if key not in keys:
                self.fail(f"unknown key '{key}' in [{where}] (known: "
                          f"{', '.join(sorted(keys))})")
            want = keys[key]
            if (want is float or (isinstance(want, tuple) and float in want)) \
                    and isinstance(value, int) and not isinstance(value, bool):
                value = float(value)
            ok = isinstance(value, want)
            if want in (int, float) and isinstance(value, bool):
                ok = False
            if not ok:
                self.fail(f"'{key}' in [{where}] must be {_type_name(want)}")
            if isinstance(value, float) and math.isnan(value):
                self.fail(f"'{key}' in [{where}] is NaN")
            out[key] = value
        return out

    def vector(self, value, where: str, n: int = 3) -> List[float]:
        if (not isinstance(value, (list, tuple)) or len(value) != n or not all(
                isinstance(v, (int, float)) and not isinstance(v, bool)
                and math.isfinite(v) for v in value)):
            self.fail(f"{where} must be an array of {n} finite numbers")
        return [float(v) for v in value]

    def positive(self, value, where: str) -> float:
        if not (isinstance(value, float) and value > 0
                and math.isfinite(value)):
            self.fail(f"{where} must be positive")
        return value

    def positive_vector(self, value, where: str) -> List[float]:
        return [self.positive(v, where) for v in self.vector(value, where)]

    def nonneg(self, value, where: str) -> float:
        if not (value >= 0 and math.isfinite(value)):
            self.fail(f"{where} must not be negative")
        return value


@dataclass(frozen=True)
class Problem:
    """A validated problem: one settings object per TOML table, every
    default filled in; `path` the file it came from (or None)."""

    mesh: MeshSettings
    materials: Tuple[MaterialSettings, ...]
    stages: Tuple[StageSettings, ...]
    initial: InitialSettings = InitialSettings(m=(1.0, 0.0, 0.0))
    demag: DemagSettings = DemagSettings()
    fields: Tuple[FieldSettings, ...] = ()
    output: OutputSettings = OutputSettings()
    petsc: Tuple[Tuple[str, Any], ...] = ()    # (option, value)
    title: str = ""
    path: Optional[Path] = None

    @property
    def config(self) -> dict:
        """The effective configuration in the TOML's structure: to_toml
        writes it, from_dict reads it back to the same settings."""
        cfg: Dict[str, Any] = {"title": self.title} if self.title else {}
        cfg.update(mesh=self.mesh.to_dict(),
                   material=[m.to_dict() for m in self.materials],
                   initial=self.initial.to_dict(),
                   demag=self.demag.to_dict(),
                   field=[f.to_dict() for f in self.fields],
                   stage=[s.to_dict() for s in self.stages],
                   output=self.output.to_dict(), petsc=dict(self.petsc))
        return cfg


def load(path: os.PathLike) -> Problem:
    """Read and validate a problem file; ProblemError on any problem."""
    p = Path(path)
    if tomllib is None:  # pragma: no cover
        raise ProblemError("python 3.11 (tomllib) is needed to read TOML")
    try:
        raw = p.read_bytes()
    except OSError as e:
        raise ProblemError(f"{p}: {e.strerror or e}") from None
    try:
        data = tomllib.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise ProblemError(f"{p}: not UTF-8 text") from None
    except tomllib.TOMLDecodeError as e:
        raise ProblemError(f"{p}: invalid TOML: {e}") from None
    return from_dict(data, name=str(p), base=p.resolve().parent, path=p)


def from_dict(data: dict, name: str = "problem", base: Optional[Path] = None,
              path: Optional[Path] = None) -> Problem:
    """Validate a problem given as a dict (the TOML's structure)."""
    c = _Checker(name)
    base = base or Path.cwd()
    top = c.table(data, TOP_KEYS, "top level")
    if "mesh" not in top:
        c.fail("missing [mesh]")
    mesh = _mesh(c, top["mesh"], base)
    if "material" not in top:
        c.fail("missing [material]")
    materials = _materials(c, top["material"])
    initial = _initial(c, top.get("initial", {"m": [1.0, 0.0, 0.0]}), base)
    demag = _demag(c, top.get("demag", {}))
    fields_ = _fields(c, top.get("field", []), "field")
    stages = _table_list(c, top.get("stage", []), "stage")
    if not stages:
        c.fail("no [[stage]]: nothing to run")
    return Problem(
        title=top.get("title", ""), mesh=mesh, materials=materials,
        initial=initial, demag=demag, fields=fields_,
        stages=tuple(_stage(c, s, i + 1) for i, s in enumerate(stages)),
        output=OutputSettings(**c.table(top.get("output", {}),
                                        OutputSettings, "output")),
        petsc=_petsc(c, top.get("petsc", {})), path=path)


# What each mesh shape needs, and what else it may have besides shape
# and unit.
_MESH_NEEDS = {"box": ("size", "h"), "cylinder": ("radius", "length", "h"),
               "ellipsoid": ("semi_axes", "h"), "sphere": ("radius", "h"),
               "file": ("file",)}
_MESH_MAY = {"box": ("structured", "edge_h", "uniform_z"),
             "file": ("scale",)}


def _mesh(c: _Checker, raw, base: Path) -> MeshSettings:
    mesh = c.table(raw, MeshSettings, "mesh")
    shape = mesh.get("shape", "file" if "file" in mesh else "box")
    if shape not in SHAPES:
        c.fail(f"mesh shape '{shape}' unknown (choose from "
               f"{', '.join(SHAPES)})")
    unit = mesh.get("unit", "nm")
    if unit not in UNITS:
        c.fail(f"mesh unit '{unit}' unknown (choose from "
               f"{', '.join(UNITS)})")
    needed = _MESH_NEEDS[shape]
    for key in needed:
        if key not in mesh:
            c.fail(f"[mesh] shape '{shape}' needs '{key}'")
    allowed = set(needed) | {"shape", "unit"} | set(_MESH_MAY.get(shape, ()))
    for key in mesh:
        if key not in allowed:
            c.fail(f"'{key}' does not apply to mesh shape '{shape}'")
    out: Dict[str, Any] = {"shape": shape, "unit": unit}
    if "h" in mesh:
        out["h"] = _mesh_h(c, mesh, shape)
    if shape == "box":
        out["size"] = c.positive_vector(mesh["size"], "mesh size")
        out["structured"] = mesh.get("structured", False)
        if "edge_h" in mesh:
            if not out["structured"]:
                c.fail("mesh edge_h (graded cells) needs a structured box")
            out["edge_h"] = c.positive(mesh["edge_h"], "mesh edge_h")
        if "uniform_z" in mesh:
            if mesh["uniform_z"] and not out["structured"]:
                c.fail("mesh uniform_z needs a structured box")
            out["uniform_z"] = mesh["uniform_z"]
    elif shape in ("cylinder", "sphere"):
        out["radius"] = c.positive(mesh["radius"], "mesh radius")
        if shape == "cylinder":
            out["length"] = c.positive(mesh["length"], "mesh length")
    elif shape == "ellipsoid":
        out["semi_axes"] = c.positive_vector(mesh["semi_axes"],
                                             "mesh semi_axes")
    else:
        out["file"] = str(_existing_file(c, mesh["file"], base,
                                         "mesh file"))
        if "scale" in mesh:
            out["scale"] = c.positive(mesh["scale"], "mesh scale")
        del out["unit"]
    _check_mesh_size(c, out)
    return MeshSettings.of(out)


def _mesh_h(c: _Checker, mesh: dict, shape: str):
    if not isinstance(mesh["h"], list):
        return c.positive(mesh["h"], "mesh h")
    if not (shape == "box" and mesh.get("structured", False)):
        c.fail("per-axis mesh h = [hx, hy, hz] needs a structured box")
    return c.positive_vector(mesh["h"], "mesh h")


def _existing_file(c: _Checker, name: str, base: Path, what: str) -> Path:
    f = Path(name)
    if not f.is_absolute():
        f = base / f
    if not f.is_file():
        c.fail(f"{what} {f} not found")
    return f


def _materials(c: _Checker, raw) -> Tuple[MaterialSettings, ...]:
    mats = [raw] if isinstance(raw, dict) else raw
    if not mats:
        c.fail("[[material]] is empty")
    regions = set()
    out = []
    for i, raw_mat in enumerate(mats):
        where = "material" if len(mats) == 1 else f"material #{i + 1}"
        mat = _material(c, raw_mat, where)
        if len(mats) > 1 and "region" not in raw_mat:
            c.fail(f"[{where}] needs 'region' when several materials are "
                   f"given")
        if mat.region in regions:
            c.fail(f"region {mat.region} has two materials")
        regions.add(mat.region)
        out.append(mat)
    return tuple(out)


def _material(c: _Checker, raw, where: str) -> MaterialSettings:
    mat = c.table(raw, MaterialSettings, where)
    if "Ms" not in mat:
        c.fail(f"[{where}] needs Ms")
    if not (mat["Ms"] > 0 and math.isfinite(mat["Ms"])):
        c.fail(f"Ms in [{where}] must be positive (got {mat['Ms']:g})")
    full = dict(MaterialSettings(Ms=mat["Ms"]).to_dict(), **mat)
    c.nonneg(full["A"], f"A in [{where}]")
    c.nonneg(full["alpha"], f"alpha in [{where}]")
    c.positive(full["gamma"], f"gamma in [{where}]")
    for key in ("K1", "Kc1", "Kc2"):
        if not math.isfinite(full[key]):
            c.fail(f"{key} in [{where}] must be finite")
    full["axis"] = c.vector(full["axis"], f"axis in [{where}]")
    if np.linalg.norm(full["axis"]) == 0:
        c.fail(f"axis in [{where}] is zero")
    full["cubic_axes"] = _cubic_axes(c, full["cubic_axes"], where)
    return MaterialSettings.of(full)


def _cubic_axes(c: _Checker, ca, where: str) -> List[List[float]]:
    if not (isinstance(ca, (list, tuple)) and len(ca) == 2):
        c.fail(f"cubic_axes in [{where}] must be two 3-vectors")
    ca = [c.vector(v, f"cubic_axes in [{where}]") for v in ca]
    a1, a2 = np.array(ca[0]), np.array(ca[1])
    if (np.linalg.norm(a1) == 0 or np.linalg.norm(a2) == 0 or abs(
            a1 @ a2) > 1e-9 * np.linalg.norm(a1) * np.linalg.norm(a2)):
        c.fail(f"cubic_axes in [{where}] must be two orthogonal "
               f"non-zero vectors")
    return ca


# the key each initial type takes
_INITIAL_KEY = {"uniform": "m", "random": "seed", "file": "file"}


def _initial(c: _Checker, raw, base: Path) -> InitialSettings:
    init = c.table(raw, InitialSettings, "initial")
    kind = init.get("type", "file" if "file" in init else "uniform")
    if kind not in _INITIAL_KEY:
        c.fail(f"initial type '{kind}' unknown (uniform, random, file)")
    extra = set(init) - {"type", _INITIAL_KEY[kind]}
    if extra:
        c.fail(f"'{sorted(extra)[0]}' does not apply to initial type "
               f"'{kind}'")
    if kind == "uniform":
        m0 = c.vector(init.get("m", [1.0, 0.0, 0.0]), "initial m")
        if np.linalg.norm(m0) == 0:
            c.fail("initial m is zero")
        return InitialSettings.of({"type": "uniform", "m": m0})
    if kind == "random":
        return InitialSettings(type="random", seed=init.get("seed", 1))
    if "file" not in init:
        c.fail("[initial] type 'file' needs 'file'")
    f = _existing_file(c, init["file"], base, "initial magnetization file")
    return InitialSettings(type="file", file=str(f))


def _demag(c: _Checker, raw) -> DemagSettings:
    d = DemagSettings.of(c.table(raw, DemagSettings, "demag"))
    c.positive(d.rtol, "demag rtol")
    if d.method not in DEMAG_METHODS:
        c.fail(f"demag method '{d.method}' unknown (choose from "
               f"{', '.join(DEMAG_METHODS)})")
    if not 0.0 < d.tol <= 0.1:
        c.fail("demag tol must be in (0, 0.1]")
    if d.grid_tol is not None and not 0.0 < d.grid_tol <= 1.0:
        c.fail("demag grid_tol must be in (0, 1]")
    if isinstance(d.grid_h, tuple):
        return replace(d, grid_h=tuple(c.positive_vector(d.grid_h,
                                                         "demag grid_h")))
    if d.grid_h is not None:
        c.positive(d.grid_h, "demag grid_h")
    return d


def _petsc(c: _Checker, petsc) -> Tuple[Tuple[str, Any], ...]:
    if not isinstance(petsc, dict):
        c.fail("[petsc] must be a table")
    for key, value in petsc.items():
        if not isinstance(value, (str, int, float, bool)):
            c.fail(f"[petsc] option '{key}' must be a string or number")
    return tuple(petsc.items())


def _check_mesh_size(c: _Checker, m: dict) -> None:
    """Refuse meshes that would not fit: rough node count from the
    volume and h (a tetrahedral mesh has ~ volume / (0.1 h^3) / 5 nodes)."""
    if m["shape"] == "file":
        return
    h = float(np.prod(m["h"])) ** (1 / 3) if isinstance(m["h"], list) \
        else m["h"]
    if m["shape"] == "box":
        vol = float(np.prod(m["size"]))
    elif m["shape"] == "cylinder":
        vol = math.pi * m["radius"] ** 2 * m["length"]
    elif m["shape"] == "sphere":
        vol = 4 / 3 * math.pi * m["radius"] ** 3
    else:
        vol = 4 / 3 * math.pi * float(np.prod(m["semi_axes"]))
    nodes = vol / h ** 3
    if nodes > 2e6:
        c.fail(f"mesh size h = {h:g} gives about {nodes:.3g} nodes; the "
               f"dense boundary matrix would not fit: use a larger h")


def _table_list(c: _Checker, value, where: str) -> list:
    if isinstance(value, dict):
        return [value]
    if not isinstance(value, list) or not all(isinstance(v, dict)
                                              for v in value):
        c.fail(f"[[{where}]] must be an array of tables")
    return value


def _fields(c: _Checker, raw, where: str) -> Tuple[FieldSettings, ...]:
    return tuple(_field(c, f, f"{where} #{i + 1}")
                 for i, f in enumerate(_table_list(c, raw, where)))


def _field(c: _Checker, raw, where: str) -> FieldSettings:
    f = c.table(raw, FieldSettings, where)
    if "H" not in f:
        c.fail(f"[{where}] needs H")
    f = FieldSettings.of(f)
    if f.unit not in FIELD_UNITS:
        c.fail(f"field unit '{f.unit}' unknown (choose from "
               f"{', '.join(FIELD_UNITS)})")
    for key in ("frequency", "ramp", "t_on"):
        c.nonneg(getattr(f, key), f"{key} in [{where}]")
    if not f.t_off > f.t_on:
        c.fail(f"t_off in [{where}] must be after t_on")
    return replace(f, H=tuple(c.vector(f.H, f"H in [{where}]")),
                   amplitude=tuple(c.vector(f.amplitude,
                                            f"amplitude in [{where}]")))


# keys of llg stages and of relax stages; a relax stage with method
# "damping" (LLG at alpha = 1 until stop_dmdt) takes some llg keys too
_LLG_KEYS = {"duration", "integrator", "rtol", "atol", "dt", "adaptive",
             "order", "stop_dmdt", "output_every", "snapshot_every"}
_RELAX_KEYS = {"method", "tol", "max_iter"}
_DAMPING_KEYS = {"duration", "stop_dmdt", "integrator", "rtol", "atol",
                 "output_every"}


def _stage(c: _Checker, raw, index: int) -> StageSettings:
    where = f"stage #{index}"
    s = c.table(raw, StageSettings, where)
    kind = s.get("type", "llg")
    if kind not in ("llg", "relax"):
        c.fail(f"type '{kind}' in [{where}] unknown (choose from llg, "
               f"relax)")
    out: Dict[str, Any] = {"type": kind,
                           "name": s.get("name", f"{kind}{index}")}
    out["field"] = _fields(c, s.get("field", []), f"{where} field")
    if "alpha" in s:
        out["alpha"] = c.nonneg(s["alpha"], f"alpha in [{where}]")
    if kind == "relax":
        out.update(_relax_stage(c, s, where))
        if out["method"] == "damping":
            out.setdefault("alpha", 1.0)
    else:
        out.update(_llg_stage(c, s, where))
    return StageSettings.of(out)


def _relax_stage(c: _Checker, s: dict, where: str) -> dict:
    method = s.get("method", "bb")
    if method not in ("bb", "damping"):
        c.fail(f"relax method '{method}' in [{where}] unknown (choose "
               f"from bb, damping)")
    bad = set(s) & (_LLG_KEYS - (_DAMPING_KEYS if method == "damping"
                                 else set()))
    if bad:
        c.fail(f"'{sorted(bad)[0]}' does not apply to a relax stage "
               f"with method '{method}'")
    out: Dict[str, Any] = {"method": method,
                           "tol": c.positive(s.get("tol", 1e-6),
                                             f"tol in [{where}]"),
                           "max_iter": s.get("max_iter", 50_000)}
    if out["max_iter"] < 1:
        c.fail(f"max_iter in [{where}] must be positive")
    if method == "bb":
        return out
    out["duration"] = c.positive(s.get("duration", 5e-9),
                                 f"duration in [{where}]")
    out["stop_dmdt"] = c.positive(s.get("stop_dmdt", 1.0),
                                  f"stop_dmdt in [{where}]")
    out["integrator"] = s.get("integrator", "rk3bs")
    if out["integrator"] not in INTEGRATORS:
        c.fail(f"integrator '{out['integrator']}' in [{where}] unknown "
               f"(choose from {', '.join(INTEGRATORS)})")
    out["rtol"] = c.positive(s.get("rtol", 1e-4), f"rtol in [{where}]")
    out["atol"] = c.positive(s.get("atol", 1e-4), f"atol in [{where}]")
    out["output_every"] = c.positive(
        s.get("output_every", out["duration"] / 100),
        f"output_every in [{where}]")
    out.update(dt=0.0, adaptive=True, order=0, snapshot_every=0.0)
    return out


def _llg_stage(c: _Checker, s: dict, where: str) -> dict:
    bad = set(s) & _RELAX_KEYS
    if bad:
        c.fail(f"'{sorted(bad)[0]}' does not apply to an llg stage")
    if "duration" not in s:
        c.fail(f"[{where}] needs duration (s)")
    out: Dict[str, Any] = {}
    out["duration"] = c.positive(s["duration"], f"duration in [{where}]")
    integ = s.get("integrator", "rk5dp")
    if integ not in INTEGRATORS:
        c.fail(f"integrator '{integ}' in [{where}] unknown (choose from "
               f"{', '.join(INTEGRATORS)})")
    out["integrator"] = integ
    out["rtol"] = c.positive(s.get("rtol", 1e-5), f"rtol in [{where}]")
    out["atol"] = c.positive(s.get("atol", 1e-5), f"atol in [{where}]")
    out["dt"] = c.nonneg(s.get("dt", 0.0), f"dt in [{where}]")
    adaptive = s.get("adaptive", integ not in ("rk4", "beuler"))
    if integ == "rk4" and adaptive:
        c.fail("integrator rk4 has no error estimate: set adaptive = false")
    if not adaptive and out["dt"] <= 0:
        c.fail(f"fixed-step [{where}] needs dt > 0")
    out["adaptive"] = adaptive
    out["order"] = s.get("order", 0)
    if not 0 <= out["order"] <= 6:
        c.fail(f"bdf order in [{where}] must be 1..6 (0: from the damping)")
    out["stop_dmdt"] = c.nonneg(s.get("stop_dmdt", 0.0),
                                f"stop_dmdt in [{where}]")
    out["output_every"] = c.positive(
        s.get("output_every", out["duration"] / 100),
        f"output_every in [{where}]")
    out["snapshot_every"] = c.nonneg(s.get("snapshot_every", 0.0),
                                     f"snapshot_every in [{where}]")
    return out


# ---------------------------------------------------------------- building

def build_mesh(m: MeshSettings):
    """The Mesh the mesh settings describe."""
    from . import mesh as meshmod
    shape = m.shape
    if shape == "file":
        return meshmod.load(m.file, scale=m.scale)
    s = m.metres
    h = np.asarray(m.h) * s if isinstance(m.h, tuple) else m.h * s
    if shape == "box":
        lx, ly, lz = (v * s for v in m.size)
        return meshmod.box(lx, ly, lz, h, structured=m.structured,
                           edge_h=None if m.edge_h is None
                           else m.edge_h * s)
    if shape == "cylinder":
        return meshmod.cylinder(m.radius * s, m.length * s, h)
    if shape == "sphere":
        return meshmod.sphere(m.radius * s, h)
    a, b, c_ = (v * s for v in m.semi_axes)
    return meshmod.ellipsoid(a, b, c_, h)


def material_arrays(mats: Sequence[MaterialSettings],
                    regions: np.ndarray) -> Dict[str, np.ndarray]:
    """Per-tetrahedron material arrays from the mesh's region ids. A
    single material applies everywhere; with several, every region of
    the mesh must have one."""
    M = len(regions)
    if len(mats) == 1:
        idx = np.zeros(M, dtype=np.int64)
    else:
        lookup = {m.region: i for i, m in enumerate(mats)}
        missing = sorted(set(np.unique(regions).tolist()) - set(lookup))
        if missing:
            raise ProblemError(f"mesh region {missing[0]} has no material")
        idx = np.array([lookup[r] for r in regions.tolist()], dtype=np.int64)
    out = {}
    for key in ("Ms", "A", "alpha", "gamma", "K1", "Kc1", "Kc2", "axis"):
        out[key] = np.array([getattr(m, key) for m in mats],
                            dtype=float)[idx]
    out["c1"] = np.array([m.cubic_axes[0] for m in mats], dtype=float)[idx]
    out["c2"] = np.array([m.cubic_axes[1] for m in mats], dtype=float)[idx]
    return out


def field_function(fields: Sequence[FieldSettings], t0: float):
    """H(t) in A/m for a list of applied fields, t0 = the stage's start."""
    specs = []
    for f in fields:
        k = FIELD_UNITS[f.unit]
        specs.append((np.array(f.H) * k, np.array(f.amplitude) * k,
                      f.frequency, f.phase, f.ramp, f.t_on, f.t_off))

    def H(t: float) -> np.ndarray:
        ts = t - t0
        total = np.zeros(3)
        for h0, amp, freq, phase, ramp, t_on, t_off in specs:
            if ts < t_on or ts >= t_off:
                continue
            v = h0 + amp * math.sin(2 * math.pi * freq * ts + phase)
            if ramp > 0 and ts - t_on < ramp:
                v = v * ((ts - t_on) / ramp)
            total += v
        return total
    return H


def to_toml(cfg: dict) -> str:
    """The configuration as TOML (tables, arrays of tables, scalars and
    arrays of numbers), for the effective configuration next to results."""
    lines: List[str] = []

    def scalar(v) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, int):
            return str(v)
        if isinstance(v, float):
            if math.isinf(v):
                return "inf" if v > 0 else "-inf"
            return repr(v)
        if isinstance(v, str):
            return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
        if isinstance(v, (list, tuple)):
            return "[" + ", ".join(scalar(x) for x in v) + "]"
        raise TypeError(type(v))

    def is_table_list(v) -> bool:
        return isinstance(v, list) and v and all(isinstance(x, dict)
                                                 for x in v)

    def emit(table: dict, prefix: str, header: Optional[str]) -> None:
        if header:
            lines.append("")
            lines.append(header)
        for k, v in table.items():
            if not isinstance(v, dict) and not is_table_list(v) and not (
                    isinstance(v, list) and not v and k == "field"):
                lines.append(f"{k} = {scalar(v)}")
        for k, v in table.items():
            name = f"{prefix}{k}"
            if isinstance(v, dict):
                emit(v, name + ".", f"[{name}]")
            elif is_table_list(v):
                for item in v:
                    emit(item, name + ".", f"[[{name}]]")

    emit(cfg, "", None)
    return "\n".join(lines).lstrip("\n") + "\n"
