"""micromag.output: the .vtu snapshots (meshio, uncompressed) read back
exactly, and the PNG of <m>(t)."""

from __future__ import annotations

import numpy as np

from micromag import mesh
from micromag.output import Results, plot_m, write_vtu


def test_vtu_round_trip_through_meshio(tmp_path):
    import meshio
    box = mesh.box(30e-9, 30e-9, 60e-9, 5e-9, structured=True)
    rng = np.random.default_rng(3)
    m = rng.normal(size=(len(box.points), 3))
    ms = np.full(len(box.points), 8.6e5)
    ms[::7] = 0.0
    path = tmp_path / "m.vtu"
    write_vtu(path, box.points, box.tets, {"m": m, "Ms": ms})
    assert b"compressor" not in path.read_bytes()[:400]
    back = meshio.read(path)
    assert np.array_equal(back.points, box.points)
    assert np.array_equal(back.cells_dict["tetra"], box.tets)
    assert np.array_equal(back.point_data["m"], m)
    assert np.array_equal(back.point_data["Ms"], ms)


def test_results_snapshots_and_a_new_mesh(tmp_path):
    import meshio
    a = mesh.box(20e-9, 20e-9, 20e-9, 5e-9, structured=True)
    b = mesh.box(20e-9, 20e-9, 40e-9, 5e-9, structured=True)
    res = Results(tmp_path / "out")
    ma = np.tile([0.0, 0.0, 1.0], (len(a.points), 1))
    mb = np.tile([1.0, 0.0, 0.0], (len(b.points), 1))
    p1 = res.snapshot(a.points, a.tets, ma, 1e-12)
    p2 = res.snapshot(b.points, b.tets, mb, 2e-12, name="m_final.vtu")
    assert np.array_equal(meshio.read(p1).point_data["m"], ma)
    back = meshio.read(p2)
    assert len(back.points) == len(b.points)
    assert np.array_equal(back.point_data["m"], mb)
    times = (res.stage_dir / "snapshots" / "times.txt").read_text()
    assert times.split() == ["snapshots/m_00000.vtu", "1e-12",
                             "m_final.vtu", "2e-12"]


def test_plot_is_a_png(tmp_path):
    t = np.linspace(0, 1e-9, 50)
    m = np.stack([np.cos(t * 1e10), np.sin(t * 1e10), 0 * t], axis=1)
    path = tmp_path / "m_t.png"
    plot_m(path, t, m, "title", [0.5e-9])
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
