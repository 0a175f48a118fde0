"""Micromagnetic finite-element solver (Magpar class) on PETSc.

Modules: mesh (tetrahedral meshes), fem (distributed P1 space), terms
(exchange, anisotropy, Zeeman), demag (hybrid FEM/BEM, when present),
llg (time integration, energy minimisation), problem (TOML problem
files), simulation (running a problem: the Python API), output (tables,
VTU, plots), cli (`ivcloud mag ...`). See docs/mag.md.
Heavy dependencies (PETSc, gmsh) are imported by the modules that need
them, so that importing the package stays cheap.
"""


def register(sub) -> None:
    from .cli import register as _register
    _register(sub)
