"""libvirt domain XML with ivshmem devices and host tuning, hot-attach
through the libvirt API, and the matching Nova flavor (`ivcloud libvirt`).

Modules: cpuset (CPU-list syntax), domain (XML generation, validation),
attach (libvirt API: attach/detach/watch; needs python3-libvirt), nova
(flavor extra specs), projects (one server per Nova project), migrate
(live migration around the device); the subcommands are in
ivcloud/cli/libvirt.py.
"""
