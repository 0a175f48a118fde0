"""Tetrahedral meshes for the micromagnetic solver.

A :class:`Mesh` is three arrays: ``points`` (N, 3) float64 in metres,
``tets`` (M, 4) int64 with positive volume (the builders and ``load``
reorder vertices where needed), ``regions`` (M,) int (a material index
per tetrahedron; 0 when the source has none).

Builders take their sizes in metres:

    box(lx, ly, lz, h)            gmsh, corner at the origin
    box(lx, ly, lz, h, structured=True)
                                  cubes of ~h split into 6 tets each
                                  (no gmsh, deterministic, fast)
    box(..., structured=True, edge_h=e)
                                  the same, graded along x and y: cells
                                  of e at the lateral faces, growing
                                  geometrically to h
    cylinder(r, l, h)             gmsh, axis z, base centred at the origin
    ellipsoid(a, b, c, h)         gmsh, centred at the origin
    sphere(r, h)                  ellipsoid(r, r, r, h)
    load(path)                    gmsh .msh (meshio), Netgen .vol (ours)

``stacks(points)`` groups the nodes that share x and y (a structured
box's nodes through the thickness).

gmsh works best with coordinates of order one, so geometry is built in
nanometres and scaled back; it runs single-threaded with a fixed seed so
that the same call gives the same mesh in every process.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import numpy as np

from .constants import NM
from .errors import MeshError


@dataclass
class Mesh:
    points: np.ndarray
    tets: np.ndarray
    regions: np.ndarray = field(default=None)  # type: ignore[assignment]

    def __post_init__(self):
        self.points = np.ascontiguousarray(self.points, dtype=np.float64)
        self.tets = np.ascontiguousarray(self.tets, dtype=np.int64)
        if self.regions is None:
            self.regions = np.zeros(len(self.tets), dtype=np.int64)
        self.regions = np.ascontiguousarray(self.regions, dtype=np.int64)
        if self.points.ndim != 2 or self.points.shape[1] != 3:
            raise MeshError("points must be an (N, 3) array")
        if self.tets.ndim != 2 or self.tets.shape[1] != 4:
            raise MeshError("tets must be an (M, 4) array")
        if len(self.tets) == 0:
            raise MeshError("mesh has no tetrahedra")
        if self.tets.min() < 0 or self.tets.max() >= len(self.points):
            raise MeshError("tetrahedron refers to a point that does "
                            "not exist")
        if self.regions.shape != (len(self.tets),):
            raise MeshError("regions must have one entry per tetrahedron")
        self._orient()

    def signed_volumes(self) -> np.ndarray:
        p = self.points[self.tets]
        d = p[:, 1:] - p[:, :1]
        return np.einsum("ij,ij->i", d[:, 0], np.cross(d[:, 1], d[:, 2])) / 6

    def _orient(self) -> None:
        vol = self.signed_volumes()
        scale = np.abs(vol).max()
        if not scale > 0 or np.any(np.abs(vol) <= 1e-12 * scale):
            raise MeshError("mesh has degenerate (zero-volume) tetrahedra")
        neg = vol < 0
        if neg.any():
            # swapping two vertices flips the orientation
            self.tets[neg, 0], self.tets[neg, 1] = (
                self.tets[neg, 1].copy(), self.tets[neg, 0].copy())

    def drop_unused_points(self) -> "Mesh":
        used = np.unique(self.tets)
        if len(used) == len(self.points):
            return self
        new = -np.ones(len(self.points), dtype=np.int64)
        new[used] = np.arange(len(used))
        return Mesh(self.points[used], new[self.tets], self.regions)

    @property
    def n_points(self) -> int:
        return len(self.points)

    @property
    def volume(self) -> float:
        return float(self.signed_volumes().sum())

    def bounding_box(self):
        return self.points.min(axis=0), self.points.max(axis=0)

    def summary(self) -> str:
        lo, hi = self.bounding_box()
        ext = (hi - lo) / NM
        return (f"{len(self.points)} nodes, {len(self.tets)} tets, "
                f"{ext[0]:.4g} x {ext[1]:.4g} x {ext[2]:.4g} nm")


# ---------------------------------------------------------------- gmsh

def _gmsh_mesh(build, h_nm: float) -> Mesh:
    """Run `build(gmsh)` (which adds one OCC volume, sizes in nm) and
    mesh it with characteristic length h_nm."""
    try:
        import gmsh
    except ImportError as e:  # pragma: no cover - depends on the system
        raise MeshError(f"gmsh is not available ({e}); install python3-gmsh "
                        f"or use a structured box") from None
    if not h_nm > 0:
        raise MeshError("mesh size h must be positive")
    # gmsh keeps global state: one model at a time, always finalized
    gmsh.initialize([], readConfigFiles=False)
    try:
        gmsh.option.setNumber("General.Terminal", 0)
        gmsh.option.setNumber("General.NumThreads", 1)
        gmsh.option.setNumber("Mesh.RandomSeed", 1)
        gmsh.option.setNumber("Mesh.CharacteristicLengthMin", h_nm)
        gmsh.option.setNumber("Mesh.CharacteristicLengthMax", h_nm)
        gmsh.option.setNumber("Mesh.CharacteristicLengthFromCurvature", 0)
        gmsh.option.setNumber("Mesh.Algorithm3D", 1)   # Delaunay
        gmsh.option.setNumber("Mesh.Optimize", 1)
        gmsh.model.add("micromag")
        build(gmsh)
        gmsh.model.occ.synchronize()
        gmsh.model.mesh.generate(3)
        tags, coords, _ = gmsh.model.mesh.getNodes()
        pts = np.asarray(coords, dtype=np.float64).reshape(-1, 3) * NM
        index = {int(t): i for i, t in enumerate(tags)}
        tets = []
        regions = []
        for dim, tag in gmsh.model.getEntities(3):
            etypes, _, enodes = gmsh.model.mesh.getElements(dim, tag)
            for et, en in zip(etypes, enodes):
                if et != 4:        # 4-node tetrahedron
                    continue
                conn = np.asarray(en, dtype=np.int64).reshape(-1, 4)
                tets.append(conn)
                regions.append(np.full(len(conn), 0, dtype=np.int64))
        if not tets:
            raise MeshError("gmsh produced no tetrahedra (mesh size too "
                            "large for the geometry?)")
        conn = np.concatenate(tets)
        lookup = np.vectorize(index.__getitem__, otypes=[np.int64])
        mesh = Mesh(pts, lookup(conn), np.concatenate(regions))
        return mesh.drop_unused_points()
    except Exception as e:
        if isinstance(e, MeshError):
            raise
        raise MeshError(f"gmsh failed: {e}") from None
    finally:
        gmsh.finalize()


def box(lx: float, ly: float, lz: float, h,
        structured: bool = False, edge_h: Optional[float] = None) -> Mesh:
    """Cuboid [0,lx]x[0,ly]x[0,lz] (metres), mesh size h. A structured
    box also takes h = (hx, hy, hz): thin films want finer cells across
    the thickness than in the plane; and `edge_h`, the cell size at the
    lateral faces (x and y), from which the cells grow by at most
    GRADE_RATIO per cell to hx, hy inside (the potential's boundary
    layers at a film's edges are a few nm thick: docs/mag-demag.md)."""
    hs = np.broadcast_to(np.asarray(h, dtype=float), (3,))
    for name, v in (("lx", lx), ("ly", ly), ("lz", lz), ("h", hs.min())):
        if not v > 0:
            raise MeshError(f"box: {name} must be positive")
    if structured:
        if edge_h is not None:
            if not edge_h > 0:
                raise MeshError("box: edge_h must be positive")
            return structured_box_coords(graded_coords(lx, hs[0], edge_h),
                                         graded_coords(ly, hs[1], edge_h),
                                         np.linspace(0, lz, _cells(lz,
                                                                   hs[2]) + 1))
        n = [_cells(v, hv) for v, hv in zip((lx, ly, lz), hs)]
        return structured_box(lx, ly, lz, *n)
    if edge_h is not None:
        raise MeshError("box: edge_h needs structured = true")
    if np.ptp(hs) > 0:
        raise MeshError("box: per-axis mesh sizes need structured = true")
    h = float(hs[0])
    return _gmsh_mesh(lambda g: g.model.occ.addBox(
        0, 0, 0, lx / NM, ly / NM, lz / NM), h / NM)


def cylinder(r: float, l: float, h: float) -> Mesh:
    """Circular cylinder of radius r and length l along z."""
    if not (r > 0 and l > 0):
        raise MeshError("cylinder: r and l must be positive")
    return _gmsh_mesh(lambda g: g.model.occ.addCylinder(
        0, 0, 0, 0, 0, l / NM, r / NM), h / NM)


def ellipsoid(a: float, b: float, c: float, h: float) -> Mesh:
    """Ellipsoid with semi-axes a, b, c along x, y, z."""
    if not (a > 0 and b > 0 and c > 0):
        raise MeshError("ellipsoid: semi-axes must be positive")
    r = max(a, b, c)

    def build(g):
        tag = g.model.occ.addSphere(0, 0, 0, r / NM)
        if not (a == b == c):
            g.model.occ.dilate([(3, tag)], 0, 0, 0, a / r, b / r, c / r)
    return _gmsh_mesh(build, h / NM)


def sphere(r: float, h: float) -> Mesh:
    return ellipsoid(r, r, r, h)


# ---------------------------------------------------------------- structured

# The 6 tetrahedra of the Kuhn (Freudenthal) split of a unit cube, as
# corner indices i + 2j + 4k; every cube is split the same way, so faces
# of neighbouring cubes match.
_KUHN = np.array([[0, 1, 3, 7], [0, 1, 5, 7], [0, 2, 3, 7],
                  [0, 2, 6, 7], [0, 4, 5, 7], [0, 4, 6, 7]], dtype=np.int64)


# Largest ratio of neighbouring cell sizes in a graded box.
GRADE_RATIO = 1.3


def _cells(length: float, h: float) -> int:
    return max(1, int(round(length / h)))


def graded_coords(length: float, h: float, edge_h: float) -> np.ndarray:
    """Node coordinates on [0, length]: cells of edge_h at both ends
    growing by GRADE_RATIO per cell up to h, cells of about h between
    (uniform when edge_h >= h)."""
    if edge_h >= h:
        return np.linspace(0, length, _cells(length, h) + 1)
    sizes = [edge_h]
    while sizes[-1] * GRADE_RATIO < h:
        sizes.append(sizes[-1] * GRADE_RATIO)
    ramp = np.array(sizes)
    middle = length - 2 * ramp.sum()
    if middle <= 0:
        # too short for both ramps: scale them to meet in the middle
        ramp = ramp * length / (2 * ramp.sum())
        middle = 0.0
    n_mid = int(round(middle / h)) if middle > 0 else 0
    if middle > 0 and n_mid == 0:
        # less than half a cell left: spread it over the ramps
        ramp = ramp * (length / 2) / ramp.sum()
    cells = np.concatenate([ramp, np.full(n_mid, middle / max(n_mid, 1)),
                            ramp[::-1]])
    x = np.concatenate([[0.0], np.cumsum(cells)])
    x[-1] = length
    return x


def structured_box(lx: float, ly: float, lz: float,
                   nx: int, ny: int, nz: int) -> Mesh:
    """Cuboid divided into nx*ny*nz cells, 6 tetrahedra per cell."""
    return structured_box_coords(np.linspace(0, lx, nx + 1),
                                 np.linspace(0, ly, ny + 1),
                                 np.linspace(0, lz, nz + 1))


def structured_box_coords(xs, ys, zs) -> Mesh:
    """The box of the cells between the given node coordinates (sorted,
    metres) along each axis, 6 tetrahedra per cell."""
    xs, ys, zs = (np.asarray(v, dtype=float) for v in (xs, ys, zs))
    nx, ny, nz = len(xs) - 1, len(ys) - 1, len(zs) - 1
    # point index = i + (nx+1) * (j + (ny+1) * k)
    Z, Y, X = np.meshgrid(zs, ys, xs, indexing="ij")
    pts = np.stack([X.ravel(), Y.ravel(), Z.ravel()], axis=1)
    i, j, k = np.meshgrid(np.arange(nx), np.arange(ny), np.arange(nz),
                          indexing="ij")
    base = (i + (nx + 1) * (j + (ny + 1) * k)).transpose(2, 1, 0).ravel()
    off = np.array([di + (nx + 1) * (dj + (ny + 1) * dk)
                    for dk in (0, 1) for dj in (0, 1) for di in (0, 1)])
    corners = base[:, None] + off[None, :]          # (cells, 8)
    tets = corners[:, _KUHN].reshape(-1, 4)
    return Mesh(pts, tets)


def stacks(points: np.ndarray) -> np.ndarray:
    """(N,) int64: the same number for the nodes that share x and y (to
    1e-9 of the points' extent), numbered 0.. in order of (x, y)."""
    pts = np.asarray(points, dtype=float)
    ext = float(np.ptp(pts[:, :2], axis=0).max()) or 1.0
    key = np.round((pts[:, :2] - pts[:, :2].min(axis=0)) / (1e-9 * ext))
    _, group = np.unique(key.astype(np.int64), axis=0, return_inverse=True)
    return group.reshape(-1).astype(np.int64)


# ---------------------------------------------------------------- files

def load(path: os.PathLike, scale: Optional[float] = None) -> Mesh:
    """Read a tetrahedral mesh: Netgen .vol (own reader) or anything
    meshio reads (gmsh .msh, .vtu, ...). Coordinates are multiplied by
    `scale` (metres per file unit). Without it they are taken as metres,
    unless the file is a .vol or .msh whose extent suggests nanometres
    (largest extent > 1e-3): those are scaled by 1e-9, as Netgen and
    gmsh meshes of nanostructures are drawn in nm."""
    p = Path(path)
    if not p.is_file():
        raise MeshError(f"mesh file {p} not found")
    if p.suffix.lower() == ".vol":
        mesh = _load_vol(p)
    else:
        try:
            import meshio
        except ImportError as e:  # pragma: no cover
            raise MeshError(f"meshio is not available ({e})") from None
        try:
            m = meshio.read(str(p))
        except Exception as e:
            raise MeshError(f"cannot read mesh {p}: "
                            f"{' '.join(str(e).split()) or type(e).__name__}"
                            ) from None
        tets, regions = [], []
        for idx, block in enumerate(m.cells):
            if block.type != "tetra":
                continue
            tets.append(np.asarray(block.data, dtype=np.int64))
            reg = None
            for key in ("gmsh:physical", "medit:ref", "region"):
                data = m.cell_data.get(key)
                if data is not None and len(data) > idx:
                    reg = np.asarray(data[idx], dtype=np.int64)
                    break
            regions.append(reg if reg is not None
                           else np.zeros(len(block.data), dtype=np.int64))
        if not tets:
            raise MeshError(f"mesh {p} has no tetrahedra")
        mesh = Mesh(np.asarray(m.points, dtype=np.float64)[:, :3],
                    np.concatenate(tets), np.concatenate(regions))
        mesh = mesh.drop_unused_points()
    if scale is None:
        lo, hi = mesh.bounding_box()
        auto = p.suffix.lower() in (".vol", ".msh") and (hi - lo).max() > 1e-3
        scale = NM if auto else 1.0
    if scale != 1.0:
        mesh = Mesh(mesh.points * scale, mesh.tets, mesh.regions)
    return mesh


def _load_vol(p: Path) -> Mesh:
    """Netgen's native .vol: the 'volumeelements' and 'points' blocks."""
    try:
        lines = p.read_text().split("\n")
    except (OSError, UnicodeDecodeError) as e:
        raise MeshError(f"cannot read mesh {p}: {e}") from None
    pts: Optional[np.ndarray] = None
    tets: Optional[np.ndarray] = None
    regions: Optional[np.ndarray] = None
    i = 0
    try:
        while i < len(lines):
            key = lines[i].strip()
            if key == "volumeelements":
                n = int(lines[i + 1])
                rows = [lines[i + 2 + r].split() for r in range(n)]
                # matnr np p1 p2 p3 p4 (1-based)
                regions = np.array([int(r[0]) for r in rows], dtype=np.int64)
                tets = np.array([[int(v) for v in r[2:6]] for r in rows],
                                dtype=np.int64) - 1
                if any(int(r[1]) != 4 for r in rows):
                    raise MeshError(f"mesh {p}: only 4-node tetrahedra "
                                    f"are supported")
                i += 2 + n
            elif key == "points":
                n = int(lines[i + 1])
                pts = np.array([[float(v) for v in lines[i + 2 + r].split()]
                                for r in range(n)], dtype=np.float64)
                i += 2 + n
            else:
                i += 1
    except (ValueError, IndexError):
        raise MeshError(f"mesh {p}: malformed Netgen .vol file") from None
    if pts is None or tets is None:
        raise MeshError(f"mesh {p}: no points or volume elements")
    return Mesh(pts, tets, regions)
