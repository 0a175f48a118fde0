"""Domain errors of the ivcloud library: one module, one hierarchy.

Every error the library raises on purpose is an :class:`IvcloudError`
with a message for people. Messages name things (a server, a region, a
count of instances), never command-line flags: the library is called
from benchmarks and other programs as well as from the CLI. Only the
command-line layer (:mod:`ivcloud.cli`) turns these into one line on
stderr and an exit status:

- :class:`InvalidRequest`: the request itself is wrong (bad name, size,
  count, conflicting settings) -> exit 2;
- :class:`OperationFailed`: a valid request that the machine could not
  carry out (a daemon that did not start, a missing build) -> exit 1.

Each area has its own subclass so that callers can catch one area's
failures; an area error is an InvalidRequest unless it is raised for a
failure of the environment, in which case it also derives from
OperationFailed.
"""

from __future__ import annotations


class IvcloudError(Exception):
    """Base of the library's deliberate errors.

    ``setting`` optionally names the request parameter at fault (a keyword
    argument of the library call, e.g. ``"vcpus"``), so that a front end
    can point at its own spelling of it (the CLI names its option).
    """

    def __init__(self, message: str = "", *, setting: str = ""):
        super().__init__(message)
        self.setting = setting


class InvalidRequest(IvcloudError, ValueError):
    """The request cannot be carried out as given."""


class OperationFailed(IvcloudError, RuntimeError):
    """The request was valid but did not work out."""


# ---------------------------------------------------------------- areas

class ServerError(InvalidRequest):
    """An ivshmem-server request is wrong (name, size, state)."""


class MpiError(InvalidRequest):
    """An MPI launch request is wrong (transport, options that conflict)."""


class MpiFlavorError(MpiError):
    """An MPI is asked for that this machine cannot run as asked: an
    unknown name, one not installed, or a transport it lacks (the
    libfabric provider not built)."""


class MpiSetupError(OperationFailed):
    """The launch request was fine but the environment is not (no mpirun,
    no component build, region cannot be made)."""


class ClusterError(InvalidRequest):
    """An emulated-cloud request is wrong (shape, name, state)."""


class ClusterFailure(OperationFailed):
    """Building, launching into or tearing down a cluster failed."""


class HolderError(ClusterFailure):
    """An instance's holder process (its namespaces) failed."""


class NetworkError(ClusterFailure):
    """A bridge, link or address of the emulated network failed."""


class LaunchError(ClusterFailure):
    """A job could not be launched into a cluster's instances."""


class JobTimeout(OperationFailed):
    """A job ran past its timeout and was torn down (exit status 124, as
    timeout(1) gives)."""
    exit_status = 124


class NetnsError(OperationFailed):
    """A network namespace for a benchmark could not be made."""


class RegionError(IvcloudError):
    """A libivshm call on a region failed (see ivcloud.native)."""


class VmError(InvalidRequest):
    """A VM request is wrong, or the VM cannot be started as asked."""


class ImageError(VmError):
    """A guest image cannot be built (missing package, download failure)."""


class VmFailure(OperationFailed):
    """A VM did not start, stop or answer as it should."""


class QmpError(VmFailure):
    """QEMU's monitor (QMP) refused a command or did not answer."""


class AgentError(VmFailure):
    """The guest's command agent did not answer (not booted, dead, or
    timed out)."""


class PlacementError(InvalidRequest):
    """A placement request cannot be met (graph, topology, balance)."""


class SpecError(InvalidRequest):
    """A domain, device or flavor description that libvirt would refuse."""


class LibvirtFailure(InvalidRequest):
    """libvirt refused or failed a request."""


class MigrationStepFailed(LibvirtFailure, OperationFailed):
    """A step of a libvirt domain's migration failed (and what was done
    was undone, as far as it could be)."""


class IsolationError(InvalidRequest):
    """A host topology cannot hold a CPU-isolation request."""


class BenchError(OperationFailed):
    """A benchmark could not measure what it was asked to."""


class ReportError(InvalidRequest):
    """Benchmark records cannot be turned into a report."""
